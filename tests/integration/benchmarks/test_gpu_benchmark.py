"""benchmarks/gpu.py in its tiny mode: the code a lent GPU runs once, checked here first so that the one call
works. On a CPU it is a smoke run (a 2-layer Llama, the eager compile backend), not a measurement."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
from support import REPO

ROOT = REPO
sys.path.insert(0, str(ROOT))


from benchmarks import gpu  # noqa: E402
from benchmarks.run import gpu_section  # noqa: E402


def test_tiny_run_trains_each_setup_in_its_own_process_and_writes_json(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu, "matmul_peak", lambda: 1e12)  # the tiny run measures training, not the peak
    setups = ("hand_tuned_compile", "gaudi_compile_fp8_flce")
    text, results = gpu.run(tiny=True, setups=setups, json_path=str(tmp_path / "gpu.json"), log=lambda _: None)
    assert json.loads((tmp_path / "gpu.json").read_text()) == json.loads(json.dumps(results))
    base = results["setups"]["hand_tuned_compile"]
    assert base["tokens_per_s"] > 0 and base["train_loss"] > 0
    flce = results["setups"]["gaudi_compile_fp8_flce"]
    if gpu.skip_reason("gaudi_compile_fp8_flce") is None:
        assert flce.get("tokens_per_s", 0) > 0, flce
    else:  # this checkout lacks the flag or torchao: the row says why, the run goes on
        assert set(flce) == {"skipped"} and flce["skipped"] in text
    assert f"{100 * base['tokens_per_s'] * results['flops_per_token'] / 1e12:.1f}%" in text  # MFU column


def test_a_missing_flag_or_torchao_skips_the_setup_with_a_reason(monkeypatch):
    monkeypatch.setitem(gpu.SETUPS, "new_flag", (None, gpu.GaudiTrainingArguments, {"no_such_flag": True}, {}))
    assert gpu.skip_reason("new_flag") == "flag not available: --no_such_flag"
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    assert gpu.skip_reason("gaudi_compile_fp8") == "torchao not importable (--fp8 needs it)"
    assert gpu.skip_reason("gaudi_compile") is None
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "liger_kernel" else real(name, *a)
    )
    assert gpu.skip_reason("liger_compile").startswith("liger-kernel not importable")


def test_a_failed_setup_is_a_row_and_the_targets_are_checked_against_the_others(monkeypatch):
    measured = {
        "hand_tuned_compile": {"tokens_per_s": 100.0, "peak_memory_gb": 50.0, "warmup_excess_s": 30, "train_loss": 12},
        "gaudi_compile": {"failed": "torch._dynamo.exc.BackendCompilerFailed: boom"},
        "gaudi_compile_fp8_flce": {"tokens_per_s": 130.0, "peak_memory_gb": 25.0, "warmup_excess_s": 40, "train_loss": 12},
        "liger_compile": {"tokens_per_s": 125.0, "peak_memory_gb": 24.0, "warmup_excess_s": 35, "train_loss": 12},
    }  # fmt: skip

    def fake_run(tiny, json_path):
        results = {"setups": measured, "peak": 1e15, "flops_per_token": 1e10, "peaks": [1e15, 1e15]}
        return "table", results

    monkeypatch.setattr(gpu, "run", fake_run)
    section = gpu_section(quick=True)
    assert "hand-tuned + compile, tokens/s | >= 1.30x | 1.30x | met" in section
    assert "hand-tuned + compile, peak memory | <= 0.60x | 0.50x | met" in section
    assert "Liger + compile, tokens/s | >= 1.10x | 1.04x | **missed**" in section
    assert "Liger + compile, peak memory | <= 1.00x | 1.04x | **missed**" in section
    assert "GaudiTrainer + compile" not in section.split("+ fp8")[0]  # its targets need its figures
    rows = gpu.section_text({**fake_run(True, None)[1], "device": "d", "torch": "t", "cuda": None, "shape": gpu.SHAPE,
                             "sequence": 2048, "batch": 4, "steps": 15, "warmup": 3, "parameters": 1})  # fmt: skip
    assert "| gaudi_compile | failed: torch._dynamo.exc.BackendCompilerFailed: boom |" in rows
    assert "| gaudi_compile_fp8_flce | 130 | 0.1% | 25.0 | 1.30x | 0.50x | 40 | 12.000 |" in rows


def test_a_setup_that_cannot_start_within_the_budget_is_a_row(monkeypatch, tmp_path):
    monkeypatch.setattr(gpu, "matmul_peak", lambda: 1e12)
    monkeypatch.setattr(gpu, "BUDGET", 30.0)
    monkeypatch.setattr(gpu, "in_new_process", lambda *a, **k: pytest.fail("no time was left to start it"))
    text, results = gpu.run(tiny=True, setups=("gaudi_compile",), log=lambda _: None)
    assert results["setups"]["gaudi_compile"]["skipped"].startswith("not run: ")
    assert "of BENCH_GPU_BUDGET left" in text

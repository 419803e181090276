import importlib.metadata
import json
import re
import sys
from pathlib import Path

import pytest
import torch

from optimum_gaudi import __version__
from optimum_gaudi.cli import main
from optimum_gaudi.devices import FEATURES


def write_state(directory, steps=12, eval_every=4):
    history = []
    for step in range(1, steps + 1):
        history.append(
            {
                "loss": 4.0 / step,
                "learning_rate": 1e-3 * (1 - step / steps),
                "memory_allocated (GB)": 1.0 + step / 100,
                "max_memory_allocated (GB)": 1.5,
                "total_memory_available (GB)": 32.0,
                "epoch": step / steps,
                "step": step,
            }
        )
        if step % eval_every == 0:
            history.append({"eval_loss": 3.0 / step, "eval_samples_per_second": 100.0 + step, "step": step})
    history.append(
        {"train_runtime": 2.0, "train_samples_per_second": 40.0, "train_tokens_per_second": 640.0, "step": steps}
    )
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "trainer_state.json").write_text(
        json.dumps({"global_step": steps, "epoch": 1.0, "log_history": history})
    )


def one_error_line(capsys):
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    return err


def test_env_reports_versions_device_and_every_feature(capsys):
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("```") and out.rstrip().endswith("```")  # pastes as a code block
    assert f"- optimum-gaudi: {__version__}" in out
    assert f"- torch: {torch.__version__}" in out
    for package in ("transformers", "accelerate", "datasets"):
        assert f"- {package}: {importlib.metadata.version(package)}" in out
    assert "- Habana bridge (habana-torch-plugin): " in out
    assert "- device: cpu x 1" in out or "- device: cuda x" in out
    assert "- device memory: total " in out
    for feature in FEATURES:
        assert feature in out


def test_env_on_the_simulated_bridge_reports_the_hpu(bridge, capsys):
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "- device: hpu x " in out
    assert "- Habana bridge (habana-torch-plugin): habana_frameworks importable" in out
    assert "hpex.optimizers.FusedAdamW" in out  # the table explains the HPU behaviour


def memory_line(out):
    (line,) = [line for line in out.splitlines() if line.startswith("- device memory: ")]
    total, free = re.fullmatch(r"- device memory: total ([\d.]+) GB, free ([\d.]+) GB", line).groups()
    return float(total), float(free)


def meminfo_gb(field):
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024**2


@pytest.mark.skipif(not Path("/proc/meminfo").is_file(), reason="reads Linux's /proc/meminfo")
def test_env_on_cpu_reports_system_total_and_available_memory(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["env"]) == 0
    total, free = memory_line(capsys.readouterr().out)
    assert total == pytest.approx(meminfo_gb("MemTotal"), abs=0.01)
    assert free == pytest.approx(meminfo_gb("MemAvailable"), abs=0.5)  # moves a little between the reads
    assert total > 0.5  # the machine's, not this process's few hundred MB


@pytest.mark.parametrize("native", [True, False])
def test_env_says_whether_this_cpu_computes_bf16_natively(capsys, monkeypatch, native):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(
        "optimum_gaudi.devices.cpu.cpu_capabilities", lambda: {"avx2"} | ({"avx512_bf16"} if native else set())
    )
    monkeypatch.setattr("optimum_gaudi.devices.cpu.bf16_matmul_slowdown", lambda: 42.0)
    assert main(["env"]) == 0
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("- bf16: ")]
    assert (line == "- bf16: native") if native else ("no bf16 instructions" in line and "42x" in line)


def test_env_on_cuda_reports_mem_get_info(capsys, monkeypatch):
    # torch.cuda stubbed at its boundary: this machine has no GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (3 * 1024**3, 80 * 1024**3))
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "- device: cuda x 2" in out and memory_line(out) == (80.0, 3.0)


def test_env_on_the_simulated_bridge_reports_hpu_memory(bridge, capsys, monkeypatch):
    monkeypatch.setenv("FAKE_HPU_MEMORY_LIMIT", str(96 * 1024**3))
    assert main(["env"]) == 0
    total, free = memory_line(capsys.readouterr().out)
    assert total == 96.0 and 90 < free < 96  # the limit less what the simulated device has in use
    assert "hpu.mem_get_info" in bridge().names()


def test_plot_writes_a_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    write_state(tmp_path / "run")
    assert main(["plot", str(tmp_path / "run")]) == 0
    png = tmp_path / "run" / "training_plot.png"
    assert capsys.readouterr().out.strip() == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_reads_the_newest_checkpoint_and_honours_out(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    write_state(tmp_path / "run" / "checkpoint-500", steps=20)
    (tmp_path / "run" / "checkpoint-90").mkdir()
    (tmp_path / "run" / "checkpoint-90" / "trainer_state.json").write_text("not json")  # older: never read
    out = tmp_path / "plots" / "run.png"
    assert main(["plot", str(tmp_path / "run"), "--out", str(out)]) == 0
    assert out.is_file()


def test_plot_of_a_missing_directory_is_one_error_line(tmp_path, capsys):
    assert main(["plot", str(tmp_path / "nope")]) == 2
    assert "is not a directory" in one_error_line(capsys)


def test_plot_without_trainer_state_is_one_error_line(tmp_path, capsys):
    assert main(["plot", str(tmp_path)]) == 2
    assert "no trainer_state.json" in one_error_line(capsys)


def test_plot_without_matplotlib_says_how_to_install_it(tmp_path, capsys, monkeypatch):
    write_state(tmp_path)
    for name in ["matplotlib", *(m for m in sys.modules if m.startswith("matplotlib."))]:
        monkeypatch.setitem(sys.modules, name, None)  # makes `import matplotlib...` fail
    assert main(["plot", str(tmp_path)]) == 2
    assert "pip install matplotlib" in one_error_line(capsys)


def test_usage_errors_and_help_return_exit_codes(capsys):
    assert main([]) == 2
    assert main(["--help"]) == 0
    assert "plot" in capsys.readouterr().out

"""--context_parallel_size trainings: a batch whose sequences are split over 2 and over 4 ranks trains the tiny
Llama as the same batch on one process (losses and trained weights), with padding and gradient accumulation; on
CPU over gloo (one torchrun launch, several runs) and on the simulated Gaudi over hccl with gaudi_fused_sdpa.
The in-process checks: tests/unit/distributed/test_sequence_parallel.py."""

import json
import os
import subprocess
import sys

import census
import pytest
import tiny
import torch
from conftest import CPU_FSDP, FAKES
from support import SCRIPTS

from optimum_gaudi import GaudiTrainingArguments

SCRIPT = SCRIPTS / "train_sequence_parallel.py"
COMMON = dict(max_steps=2, gradient_accumulation_steps=2, optim="sgd", learning_rate=0.5, logging_steps=1)


COMMON |= dict(report_to="none", save_strategy="no", train_sampling_strategy="sequential", disable_tqdm=True)


def launch(tmp_path, nproc: int, runs: dict, **env) -> dict:
    """The runs, one after the other, in one launch of `nproc` processes (optimum-gaudi launch)."""
    spec = tmp_path / "runs.json"
    spec.write_text(json.dumps(runs))
    out = tmp_path / "out.json"
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PT_HPU", "FAKE_HPU", "RANK", "WORLD_SIZE"))}
    clean.update(OMP_NUM_THREADS="1", **env)
    command = [sys.executable, "-m", "optimum_gaudi", "launch", "--world_size", str(nproc), str(SCRIPT)]
    result = subprocess.run([*command, str(out), str(spec)], env=clean, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(out.read_text())


def run(tmp_path, name: str, attn: str, side: str, **args) -> dict:
    return {"attn": attn, "padding_side": side, "args": {"output_dir": str(tmp_path / name), **COMMON, **args}}


def single_process(tmp_path, attn: str, side: str, per_device: int, eval_rows: int = 0) -> dict:
    """The same training on one process; evaluation (if any) in one batch, as the ranks' one step together."""
    args = GaudiTrainingArguments(output_dir=str(tmp_path / "single"), per_device_train_batch_size=per_device, **COMMON)
    args.per_device_eval_batch_size = eval_rows or args.per_device_eval_batch_size
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank
    try:
        return tiny.trained_llama(args, attn, side, eval_rows)
    finally:
        torch.set_num_threads(threads)


def assert_same_training(split: dict, single: dict) -> None:
    assert split["losses"] == pytest.approx(single["losses"], rel=1e-5)
    (low, high), (single_low, single_high) = split["logged_batch"], single["logged_batch"]
    assert low <= single_high and single_low <= high, (split["logged_batch"], single["logged_batch"])  # a batch once
    torch.testing.assert_close(torch.tensor(split["parameters"]), torch.tensor(single["parameters"]), atol=2e-6, rtol=0)


def test_sequences_split_over_4_and_2_ranks_train_as_one_process(tmp_path):
    """4 ranks: one group of 4 (sdpa, grouped heads, left padding, lengths 4 does not divide); then 2 groups of 2,
    data parallel over the groups (eager attention, right padding: the one process pads its 4 rows together),
    under DDP, FSDP2, fast_ddp and torch.compile. Evaluation is not split: the eval_loss is the one process's, not 2x it. A trainer with a compute_loss_func is
    refused in one line."""
    runs = {
        "cp4": run(tmp_path, "cp4", "sdpa", "left", per_device_train_batch_size=2, context_parallel_size=4),
        "cp2": run(tmp_path, "cp2", "eager", "right", per_device_train_batch_size=2, context_parallel_size=2),
    }
    if CPU_FSDP:  # not on torch 2.6's CPU (tests/conftest.py)
        runs["cp2_fsdp"] = run(
            tmp_path, "fsdp", "sdpa", "right", per_device_train_batch_size=2, context_parallel_size=2
        )
        runs["cp2_fsdp"]["args"]["fsdp"] = "full_shard"
    runs["cp2_fast"] = run(tmp_path, "fast", "sdpa", "right", per_device_train_batch_size=2, context_parallel_size=2)
    runs["cp2_fast"]["args"]["distribution_strategy"] = "fast_ddp"
    runs["cp2_compile"] = run(
        tmp_path, "compile", "sdpa", "right", per_device_train_batch_size=2, context_parallel_size=2
    )
    runs["cp2_compile"]["args"] |= dict(torch_compile=True, torch_compile_backend="aot_eager")
    runs["refused"] = run(tmp_path, "refused", "sdpa", "right", context_parallel_size=2) | dict(compute_loss_func=True)
    runs["cp2"] |= dict(eval_rows=8)
    runs["cp2"]["args"]["per_device_eval_batch_size"] = 2  # one step of the 4 ranks' own 2 rows
    split = launch(tmp_path, 4, runs)
    assert_same_training(split["cp4"], single_process(tmp_path, "sdpa", "left", per_device=2))
    single = single_process(tmp_path, "eager", "right", per_device=4, eval_rows=8)
    assert_same_training(split["cp2"], single)
    assert split["cp2"]["eval_loss"] == pytest.approx(single["eval_loss"], rel=1e-5)
    single = single_process(tmp_path, "sdpa", "right", per_device=4)
    if CPU_FSDP:
        assert split["cp2_fsdp"]["fsdp"] and not split["cp2"]["fsdp"]  # FSDP2's averaging, DDP's, fast_ddp's
        assert_same_training(split["cp2_fsdp"], single)
    assert_same_training(split["cp2_fast"], single)
    assert_same_training(split["cp2_compile"], single)  # dynamo over the all-to-all (gloo)
    assert split["cp4"]["losses"] != split["cp2"]["losses"]  # two different trainings, each matched
    assert split["refused"]["refused"] == (
        "--context_parallel_size 2 cannot be combined with a compute_loss_func (it would read the slice's own "
        "labels); drop one."
    )


def test_gaudi_fused_sdpa_is_the_local_kernel_on_the_simulated_gaudi(tmp_path):
    """2 processes over hccl on the simulated hpu device in lazy mode (as optimum-habana's long-sequence command):
    FusedSDPA sees the whole sequence for half the heads, between all-to-alls on hpu tensors, and the training is
    the one-process training on CPU."""
    runs = {"cp2": run(tmp_path, "cp2", "sdpa", "right", per_device_train_batch_size=2)}
    runs["cp2"]["args"] |= dict(use_habana=True, use_lazy_mode=True, attn_implementation="gaudi_fused_sdpa")
    runs["cp2"]["args"] |= dict(flash_attention_recompute=True, context_parallel_size=2)
    env = dict(PYTHONPATH=f"{FAKES}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", FAKE_HPU_DEVICE="1")
    env["FAKE_HPU_CALL_LOG"] = str(tmp_path / "simulator.json")
    split = launch(tmp_path, 2, runs, FAKE_HPU_SOFTWARE="1.19", PT_HPU_LAZY_MODE="1", **env)["cp2"]
    issued = {census.key(entry) for entry in census.check(tmp_path / "simulator.json", range(2))}
    assert ("sequence parallelism", "alltoall_base", "-", "float32") in issued
    assert_same_training(split, single_process(tmp_path, "sdpa", "right", per_device=2))
    assert split["fused_sdpa_heads"] and set(split["fused_sdpa_heads"]) == {4}  # 8 heads, 4 on each rank
    assert {"distributed.hccl.alltoall_base", "distributed.hccl.step_marker"} <= set(split["hccl"])  # lazy mode

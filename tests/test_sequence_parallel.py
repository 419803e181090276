"""--context_parallel_size: a batch whose sequences are split over 2 and over 4 ranks trains the tiny Llama as the
same batch on one process (losses and trained weights), with padding and gradient accumulation; on CPU over
gloo (one torchrun launch, several runs) and on the simulated Gaudi over hccl with gaudi_fused_sdpa."""

import json
import os
import subprocess
import sys
from pathlib import Path

import census
import pytest
import tiny
import torch
from conftest import FAKES

from optimum_gaudi import GaudiTrainingArguments

SCRIPT = Path(__file__).parent / "scripts" / "train_sequence_parallel.py"
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
        "cp2_fsdp": run(tmp_path, "fsdp", "sdpa", "right", per_device_train_batch_size=2, context_parallel_size=2),
    }
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
    assert split["cp2_fsdp"]["fsdp"] and not split["cp2"]["fsdp"]  # FSDP2's averaging, DDP's, fast_ddp's
    single = single_process(tmp_path, "sdpa", "right", per_device=4)
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


def test_combinations_that_cannot_split_are_one_line(monkeypatch, tmp_path):
    from optimum_gaudi.distributed.layout import argument_problem

    args = GaudiTrainingArguments(output_dir=str(tmp_path))
    for given, expected in [
        (dict(attn_implementation="flash_attention_2"), "runs attention with sdpa, eager or gaudi_fused_sdpa, not"),
        (dict(use_hpu_graphs_for_training=True), "cannot be combined with --use_hpu_graphs_for_training"),
        (dict(label_smoothing_factor=0.1), "cannot be combined with --label_smoothing_factor (it reads the slice's"),
    ]:
        for name, value in {"context_parallel_size": 2, **given}.items():
            monkeypatch.setattr(args, name, value)
        assert expected in argument_problem(args, world_size=4)
        monkeypatch.undo()
    monkeypatch.setattr(args, "context_parallel_size", 2)
    assert argument_problem(args, world_size=4) is None
    monkeypatch.setattr(args, "torch_compile", True)  # the all-to-all compiles (tested with the commands)
    assert argument_problem(args, world_size=4) is None


def test_a_model_whose_heads_or_attention_cannot_split_is_one_line():
    from optimum_gaudi.distributed.sequence_parallel import model_problem

    model = tiny.llama_8_heads()  # 8 query, 4 key/value heads, sdpa
    assert model_problem(model, 4) is None
    assert model_problem(model, 8) == (
        "--context_parallel_size 8 gives each process 1/8 of the attention heads: the model has 8 query and 4 "
        "key/value heads; choose a size that divides both."
    )
    model.config.sliding_window = 8
    assert "sliding window" in model_problem(model, 2)
    model.config.sliding_window = None
    model.config._attn_implementation = "flash_attention_2"
    assert "the model uses flash_attention_2" in model_problem(model, 2)


def test_an_encoder_is_refused_in_one_line():
    """A bidirectional model would get a causal mask over the whole sequence: refused where the model is wrapped."""
    from transformers import BertConfig, BertForMaskedLM

    from optimum_gaudi.distributed.sequence_parallel import SequenceParallel
    from optimum_gaudi.errors import UserError

    sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=8)
    bert = BertForMaskedLM(BertConfig(vocab_size=tiny.VOCAB, max_position_embeddings=64, **sizes))
    split = SequenceParallel(2, group=None, data_parallel_size=1, data_parallel_index=0)  # no process group
    with pytest.raises(UserError) as refused:
        split.use(bert)
    assert str(refused.value) == (
        "--context_parallel_size 2 splits causal (decoder) models only; this model has bidirectional attention "
        "(an encoder)."
    )
    assert not bert.config._attn_implementation.startswith("gaudi_sequence_parallel")  # left as it was


def test_transformers_parallelism_config_that_disagrees_is_one_line(tmp_path):
    from accelerate import ParallelismConfig

    from optimum_gaudi.distributed.layout import argument_problem

    args = GaudiTrainingArguments(output_dir=str(tmp_path))
    args.context_parallel_size, args.parallelism_config = 2, ParallelismConfig(sp_size=2)
    assert "parallelism_config split the sequences differently" in argument_problem(args, world_size=2)
    args.parallelism_config = ParallelismConfig(cp_size=2)  # what a CUDA run under FSDP gets: torch's path
    assert argument_problem(args, world_size=2) is None


def test_cuda_under_fsdp_takes_transformers_context_parallel_path(tmp_path, monkeypatch):
    """Where torch's context parallelism shards the device's SDPA (CUDA) and FSDP2 runs, --context_parallel_size
    becomes transformers' parallelism_config (FSDP over world / N, cp N): the layout's one choice."""
    from optimum_gaudi.devices import CPUDevice, CUDADevice
    from optimum_gaudi.distributed.layout import CP_ALL_TO_ALL, CP_TORCH, ParallelLayout

    assert CUDADevice.torch_context_parallel and not CPUDevice.torch_context_parallel
    args = GaudiTrainingArguments(output_dir=str(tmp_path))
    args.context_parallel_size, args.fsdp, args.gaudi_device = 4, "full_shard", CUDADevice()
    layout = ParallelLayout.from_arguments(args, world_size=8)
    assert (layout.cp_implementation, layout.data_parallel_size, layout.dp_shard_size) == (CP_TORCH, 2, 2)
    config = layout.parallelism_config()
    assert (config.cp_size, config.dp_shard_size, config.total_size) == (4, 2, 8)
    args.gaudi_device = CPUDevice()  # no sharding rule for its kernels: ours, FSDP over the whole world
    layout = ParallelLayout.from_arguments(args, world_size=8)
    assert (layout.cp_implementation, layout.dp_shard_size, layout.parallelism_config()) == (CP_ALL_TO_ALL, 8, None)

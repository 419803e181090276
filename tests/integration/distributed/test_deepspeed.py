"""DeepSpeed ZeRO really run: 2 CPU processes over gloo with DeepSpeed's CPU accelerator, started by
``optimum-gaudi launch`` (torchrun) and by ``optimum-gaudi launch --use_deepspeed`` (DeepSpeed's launcher),
with the bundled configs of examples/deepspeed/ given to the script as ``--deepspeed CONFIG``.

Each launch runs a whole plan of trainings in the same two processes (tests/scripts/train_deepspeed.py): a DDP
reference, then ZeRO-1, 2 and 3 on the same data, seed and steps. DeepSpeed trains bf16 weights with fp32
master weights, DDP fp32 weights under bf16 autocast, so the losses agree to LOSS_TOLERANCE, not bit for bit;
the tolerance is small against what the 8 steps change (the loss falls by more than 0.3). A ZeRO checkpoint
saved halfway and resumed reproduces the uninterrupted run.

The first DeepSpeed run on a machine compiles DeepSpeed's shared-memory all-reduce (and for ZeRO-Offload its
CPU Adam): about a minute each, once, kept in the venv (TORCH_EXTENSIONS_DIR, unless set) so that venvs with
other torch builds do not overwrite each other's. Every launch here puts this interpreter's bin directory first
on PATH: DeepSpeed's launcher is found there, and so is the ninja that compiles; a system ninja of another
version would take the cached build for stale and compile it again.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tiny
from support import REPO, SCRIPTS

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed: make test-deepspeed")

CONFIGS = REPO / "examples" / "deepspeed"
SCRIPT = SCRIPTS / "train_deepspeed.py"
FAULT = SCRIPTS / "fault.py"

STEPS, SAVE_AT, PER_DEVICE_BATCH, MAX_GRAD_NORM = 8, 4, 4, 1.0
COMMON = [
    *("--max_steps", str(STEPS), "--logging_steps", "1", "--per_device_train_batch_size", str(PER_DEVICE_BATCH)),
    *("--bf16", "--learning_rate", "1e-2", "--max_grad_norm", str(MAX_GRAD_NORM), "--seed", "0"),
    *("--train_sampling_strategy", "sequential", "--report_to", "none", "--disable_tqdm", "true"),
    *("--save_strategy", "no"),
]
LOSS_TOLERANCE = (
    3e-3  # |DeepSpeed - DDP| at every step; measured here: at most 9.2e-4, see examples/deepspeed/README.md
)
GRAD_NORM_TOLERANCE = 5e-2  # relative; measured here: at most 2.2% (DeepSpeed computes it from bf16 gradients)
# on the simulated Gaudi, DDP autocasts by Habana's op lists and DeepSpeed trains bf16 weights; measured here: 3.1e-3
# at most (step 6), each stage alike
SIMULATED_LOSS_TOLERANCE = 5e-3
SAVING = ["--save_strategy", "steps", "--save_steps", str(SAVE_AT)]
# the parameters of the model train_deepspeed.py trains (the LM head is tied to the embedding: counted once)
MODEL_NUMEL = sum(p.numel() for p in tiny.gpt2(**tiny.NO_DROPOUT).parameters())


def zero_run(stage: int | str, *extra: str) -> dict:
    return {"name": f"zero{stage}", "args": ["--deepspeed", str(CONFIGS / f"zero{stage}.json"), *extra]}


def job_env() -> dict[str, str]:
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))  # one build per venv
    return env


def launch(
    tmp_path: Path,
    plan: list[dict],
    *launcher_flags: str,
    timeout: int = 900,
    env: dict[str, str] | None = None,
    world_size: int = 2,
) -> dict[str, list[dict]]:
    """Run the plan on ``world_size`` processes with ``optimum-gaudi launch`` (``env`` added to the job's); return
    each run's records, rank 0 first."""
    out = tmp_path / "runs"
    out.mkdir()
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(plan))
    command = [sys.executable, "-m", "optimum_gaudi", "launch", "--world_size", str(world_size), *launcher_flags]
    command += [str(SCRIPT), str(out), str(plan_file), *COMMON]
    result = subprocess.run(
        command, env={**job_env(), **(env or {})}, capture_output=True, text=True, timeout=timeout, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-4000:]
    (tmp_path / "stderr.txt").write_text(result.stderr)
    return {
        run["name"]: [json.loads((out / f"{run['name']}.rank{rank}.json").read_text()) for rank in range(world_size)]
        for run in plan
    }


def losses(record: dict) -> list[float]:
    return [record["losses"][str(step)] for step in range(1, STEPS + 1)]


def grad_norms(record: dict) -> list[float]:
    return [record["grad_norms"][str(step)] for step in range(1, STEPS + 1)]


def assert_zero_stage(records: list[dict], stage: int) -> None:
    """DeepSpeed ran this stage for real: the fp32 master weights (and Adam's states with them) are split between
    the ranks, ZeRO-3 splits the parameters too, and the config's "auto" values came from the arguments."""
    facts, ranks = [r["deepspeed"] for r in records], len(records)
    assert [f["stage"] for f in facts] == [stage] * ranks
    assert all(f["model_numel"] == MODEL_NUMEL for f in facts)
    assert sum(f["master_numel"] for f in facts) == MODEL_NUMEL
    assert all(0 < f["master_numel"] < MODEL_NUMEL for f in facts)
    params_held = [f["local_param_numel"] for f in facts]
    assert all(n < MODEL_NUMEL for n in params_held) if stage == 3 else params_held == [MODEL_NUMEL] * ranks
    assert all(f["param_dtype"] == "torch.bfloat16" for f in facts)  # "bf16": {"enabled": true}
    assert all(f["gradient_clipping"] == MAX_GRAD_NORM and f["micro_batch"] == PER_DEVICE_BATCH for f in facts)
    assert all(r["world_size"] == ranks for r in records)
    assert all(losses(r) == losses(records[0]) for r in records)  # every rank logs the same averaged loss


def assert_matches_ddp(zero: dict, ddp: dict, loss_tolerance: float = LOSS_TOLERANCE) -> None:
    assert losses(zero) == pytest.approx(losses(ddp), abs=loss_tolerance)
    assert grad_norms(zero) == pytest.approx(grad_norms(ddp), rel=GRAD_NORM_TOLERANCE)
    assert losses(ddp)[0] - losses(ddp)[-1] > 0.3  # the tolerance is small against what training changes


def assert_checkpoints(run_dir: Path, records: list[dict]) -> None:
    """Each checkpoint holds one ZeRO shard per rank, full model weights, and gaudi_config.json written by rank 0."""
    from transformers import GPT2LMHeadModel

    checkpoints = [run_dir / f"checkpoint-{step}" for step in range(SAVE_AT, STEPS + 1, SAVE_AT)]
    for checkpoint in checkpoints:
        shards = sorted(p.name for p in (checkpoint / f"global_step{checkpoint.name.split('-')[1]}").iterdir())
        assert [name for name in shards if "optim_states" in name] == [
            "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
            "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
        ]
        assert (checkpoint / "gaudi_config.json").is_file()
    # written where the checkpoint is staged before it is published (optimum_gaudi's checkpoint safety)
    assert [Path(p).name for p in records[0]["gaudi_config_saved_to"]] == [c.name for c in checkpoints]
    assert records[1]["gaudi_config_saved_to"] == []
    model = GPT2LMHeadModel.from_pretrained(checkpoints[-1])  # ZeRO-3 too: gathered at save time
    assert sum(p.numel() for p in model.parameters()) == MODEL_NUMEL


def test_zero_1_2_3_under_torchrun_match_ddp_and_resume(tmp_path):
    """`optimum-gaudi launch --world_size 2 SCRIPT --deepspeed zeroN.json`: each stage against DDP, each stage
    saved at step 4 and resumed from that ZeRO checkpoint."""
    runs = tmp_path / "runs"
    plan = [{"name": "ddp"}, *(zero_run(stage, *SAVING) for stage in (1, 2, 3))]
    plan += [
        {
            **zero_run(stage),
            "name": f"zero{stage}_resumed",
            "resume": str(runs / f"zero{stage}" / f"checkpoint-{SAVE_AT}"),
        }
        for stage in (1, 2, 3)
    ]
    records = launch(tmp_path, plan)
    ddp = records["ddp"][0]
    assert ddp["deepspeed"] == {} and ddp["world_size"] == 2
    for stage in (1, 2, 3):
        zero, resumed = records[f"zero{stage}"], records[f"zero{stage}_resumed"]
        assert_zero_stage(zero, stage)
        assert_matches_ddp(zero[0], ddp)
        assert_checkpoints(runs / f"zero{stage}", zero)
        assert zero[0]["steps_run"] == STEPS and resumed[0]["steps_run"] == STEPS - SAVE_AT
        assert losses(resumed[0])[SAVE_AT:] == pytest.approx(losses(zero[0])[SAVE_AT:], abs=1e-5)
        assert zero[0]["deepspeed"]["optimizer"] == "torch.optim.adamw.AdamW"  # the trainer's, partitioned


@pytest.mark.parametrize("world_size", [2, 4])
def test_zero_1_2_3_on_simulated_gaudis_issue_only_collectives_the_bridge_takes(tmp_path, world_size):
    """DeepSpeed's own HPU accelerator (found by importing habana_frameworks) on 2 and 4 simulated Gaudis, 'hccl'
    on hpu tensors: each stage against DDP on the same devices, and every collective DeepSpeed, accelerate and
    transformers issue on the device's group one the bridge maps and listed in docs/collectives.md's census."""
    import census

    gaudi = ["--use_habana", "--gaudi_config_name", "gpt2"]
    plan = [{"name": "ddp", "args": gaudi}, *(zero_run(stage, *gaudi) for stage in (1, 2, 3))]
    plan += [{"name": "ddp_llama", "args": gaudi, "model": "llama"}]  # the models Gaudi users train
    plan += [{**zero_run(3, *gaudi), "name": "zero3_llama", "model": "llama"}]
    log = tmp_path / "simulator.json"
    path = os.pathsep.join(filter(None, [str(REPO / "tests" / "fakes"), os.environ.get("PYTHONPATH")]))
    simulated = {"PYTHONPATH": path, "FAKE_HPU_DEVICE": "1", "FAKE_HPU_DEVICE_COUNT": str(world_size)}
    simulated.update(FAKE_HPU_SOFTWARE="1.21", FAKE_HPU_CALL_LOG=str(log))
    records = launch(tmp_path, plan, env=simulated, world_size=world_size)
    ddp = records["ddp"][0]
    for stage in (1, 2, 3):
        zero = records[f"zero{stage}"]
        assert [(r["device"], r["backend"]) for r in zero] == [("hpu", "hccl")] * world_size
        assert_zero_stage(zero, stage)
        assert_matches_ddp(zero[0], ddp, SIMULATED_LOSS_TOLERANCE)
    llama = records["zero3_llama"]
    facts = [r["deepspeed"] for r in llama]
    assert [(r["device"], r["backend"], r["deepspeed"]["stage"]) for r in llama] == [("hpu", "hccl", 3)] * world_size
    assert sum(f["master_numel"] for f in facts) == facts[0]["model_numel"]  # the weights split over the ranks
    assert all(f["local_param_numel"] < f["model_numel"] for f in facts)
    assert_matches_ddp(llama[0], records["ddp_llama"][0], SIMULATED_LOSS_TOLERANCE)
    issuers = {entry["issuer"] for entry in census.check(log, range(world_size))}
    assert "DeepSpeed" in issuers


def test_zero_1_2_3_with_use_deepspeed_and_the_gaudi_features(tmp_path):
    """`optimum-gaudi launch --use_deepspeed`: DeepSpeed's own launcher starts the ranks. With the bundled gpt2
    Gaudi config (fused AdamW, fused clipping, op-list autocast) DeepSpeed partitions the fused AdamW the trainer
    made, clips with its own "gradient_clipping", and still matches DDP run with the same Gaudi config."""
    gaudi = ["--gaudi_config_name", "gpt2"]
    plan = [{"name": "ddp", "args": gaudi}, *(zero_run(stage, *gaudi) for stage in (1, 2, 3))]
    records = launch(tmp_path, plan, "--use_deepspeed")
    ddp = records["ddp"][0]
    for stage in (1, 2, 3):
        zero = records[f"zero{stage}"]
        assert_zero_stage(zero, stage)
        assert_matches_ddp(zero[0], ddp)
        assert zero[0]["deepspeed"]["optimizer"] == "torch.optim.adamw.AdamW"
        assert zero[0]["deepspeed"]["optimizer_fused"] is True  # the device's fused AdamW (use_fused_adam)
    log = (tmp_path / "stderr.txt").read_text()
    said = "DeepSpeed replaces these Gaudi features on this run: use_fused_clip_norm"
    assert log.count(said) == 3 and "use_fused_adam (the DeepSpeed config" not in log  # rank 0, each ZeRO run


def test_zero_offload_steps_with_deepspeed_cpu_adam(tmp_path):
    """zero2_offload.json: the optimizer states live on the host and DeepSpeed's CPU Adam (a C++ extension compiled
    on first use) runs the step; the trainer's optimizer, the Gaudi config's fused AdamW, is not made."""
    gaudi = ["--gaudi_config_name", "gpt2"]
    plan = [{"name": "ddp", "args": gaudi}, {**zero_run("2_offload", *gaudi), "name": "offload"}]
    records = launch(tmp_path, plan)
    assert "use_fused_adam (the DeepSpeed config names its own optimizer)" in (tmp_path / "stderr.txt").read_text()
    offload = records["offload"]
    assert [r["deepspeed"]["offload"] for r in offload] == [True, True]
    assert offload[0]["deepspeed"]["optimizer"] == "deepspeed.ops.adam.cpu_adam.DeepSpeedCPUAdam"
    assert sum(r["deepspeed"]["master_numel"] for r in offload) == MODEL_NUMEL
    assert_matches_ddp(offload[0], records["ddp"][0])


@pytest.mark.parametrize(
    "config, flags, found",
    [
        ("zero1.json", {}, "ds bf16.enabled=True vs hf bf16|bf16_full_eval=False"),
        ({"zero_optimization": {"stage": 2}, "gradient_clipping": 0.5}, {"bf16": True}, "gradient_clipping=0.5"),
    ],
    ids=["bf16-config-without---bf16", "clipping-disagrees"],
)
def test_a_config_that_disagrees_with_the_arguments_fails_at_once(tmp_path, config, flags, found):
    """transformers would say so only when training starts, after the model is loaded."""
    from optimum_gaudi import GaudiArgumentError, GaudiTrainingArguments

    config = str(CONFIGS / config) if isinstance(config, str) else config
    with pytest.raises(GaudiArgumentError) as error:
        GaudiTrainingArguments(output_dir=str(tmp_path), deepspeed=config, report_to="none", **flags)
    message = str(error.value)
    assert found in message and '"auto"' in message and "\n" not in message


@pytest.mark.parametrize(
    "gaudi_config, stage, expected",
    [("gpt2", 3, False), (None, 3, None), ("gpt2", 2, None)],
    ids=["zero3-op-lists", "zero3-no-gaudi-config", "zero2-op-lists"],
)
def test_zero3_keeps_torch_linear_under_op_list_autocast(tmp_path, gaudi_config, stage, expected):
    """ZeRO-3's own F.linear re-enters only torch.autocast in backward; under the op-list autocast of CPU/CUDA it
    failed with "expected m1 and m2 to have the same dtype" (seen in the --use_deepspeed run above)."""
    from optimum_gaudi import GaudiTrainingArguments

    config = {"zero_optimization": {"stage": stage}, "bf16": {"enabled": True}}
    args = GaudiTrainingArguments(
        output_dir=str(tmp_path), deepspeed=config, bf16=True, gaudi_config_name=gaudi_config, report_to="none"
    )
    assert args.hf_deepspeed_config.config["zero_optimization"].get("memory_efficient_linear") is expected
    del args
    gc.collect()  # transformers keeps a weak reference to the DeepSpeed config: let it go before the next test


def test_zero3_memory_efficient_linear_with_op_lists_is_refused(tmp_path):
    from optimum_gaudi import GaudiArgumentError, GaudiTrainingArguments

    config = {"zero_optimization": {"stage": 3, "memory_efficient_linear": True}, "bf16": {"enabled": True}}
    with pytest.raises(GaudiArgumentError, match="memory_efficient_linear.*remove that key or set it to false"):
        GaudiTrainingArguments(
            output_dir=str(tmp_path), deepspeed=config, bf16=True, gaudi_config_name="gpt2", report_to="none"
        )
    gc.collect()


def test_a_failing_rank_under_use_deepspeed_stops_the_job(tmp_path):
    """DeepSpeed's launcher ends the other rank (blocked in an all_reduce) and the launcher says what happened."""
    command = [sys.executable, "-m", "optimum_gaudi", "launch", "--use_deepspeed", "--world_size", "2"]
    command += [str(FAULT), "raise", str(tmp_path)]
    result = subprocess.run(command, env=job_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "RuntimeError: rank 1 fails on purpose" in result.stderr
    assert result.stderr.rstrip().splitlines()[-1].startswith("error: deepspeed exited with code")
    assert "rank 0 got past" not in result.stderr

"""FSDP (FSDP2, ``fully_shard``) trainings with each Gaudi feature: on 2 CPU processes over gloo against DDP and
one process, on 2 simulated Gaudis over 'hccl' with sharded checkpoints, and lazy mode refused on one simulated
Gaudi. The settings, checked in process: tests/unit/distributed/test_fsdp.py.

The trainings run in tests/scripts/fsdp_features.py, several in one launch (sharded and replicated in the same
processes), at the same global batch of 8 rows a step."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import census
import pytest
from conftest import FAKES, SIMULATED_PATH, TORCHAO_DIR, cpu_fsdp, has_torchao, use_torchao
from support import SCRIPTS, TESTS

SCRIPT = SCRIPTS / "fsdp_features.py"
FP32_CASES = ("fused", "lora", "compile", "gpt2")
CASES = [*FP32_CASES, "autocast", *(["fp8"] if has_torchao else [])]
EXACT = 1e-5  # float32 sums in another order
BF16 = 5e-3  # bf16 all-gathers against float32 weights: the worst step differed by 9e-5 here
FP8 = 0.01  # relative, as tests/integration/precision/test_fp8.py


def torchrun(tmp_path, modes: str, cases: list[str], **env) -> dict[int, dict]:
    """The worker on 2 processes; each rank's results."""
    out = tmp_path / "results.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1"]
    command += ["--master_port", str(free_port()), str(SCRIPT), str(out), modes, *cases]
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("PT_HPU", "FAKE_HPU", "RANK", "WORLD_SIZE"))}
    environ.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", **env)
    if "fp8" in cases and (TORCHAO_DIR / "torchao").is_dir():  # whether or not this process has put it on sys.path
        environ["PYTHONPATH"] = os.pathsep.join(filter(None, [environ.get("PYTHONPATH"), str(TORCHAO_DIR)]))
    result = subprocess.run(command, env=environ, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    return {rank: json.loads(Path(f"{out}.{rank}").read_text()) for rank in (0, 1)}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_process(tmp_path, cases: list[str]) -> dict:
    """The same cases in this process, alone."""
    if "fp8" in cases:
        use_torchao()
    spec = importlib.util.spec_from_file_location("fsdp_features", SCRIPT)
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    return {name: worker.run_case(name, "single", str(tmp_path / "single")) for name in cases}


@cpu_fsdp
def test_fsdp_with_each_gaudi_feature_trains_as_ddp_and_one_process(tmp_path):
    """Fused AdamW and clipping with accumulation, op-list autocast, LoRA, regional compilation, fp8 (torchao) on
    a Llama sharded by optimum-habana's fsdp_config.json, and a GPT-2: FSDP's losses are DDP's and one
    process's, its gradient norm the global one."""
    ranks = torchrun(tmp_path, "fsdp,ddp", CASES)
    fsdp, ddp = ranks[0]["fsdp"], ranks[0]["ddp"]
    single = one_process(tmp_path, CASES)
    for case in FP32_CASES:
        assert len(fsdp[case]["losses"]) == 4
        assert fsdp[case]["losses"] == pytest.approx(ddp[case]["losses"], abs=EXACT), case
        assert fsdp[case]["losses"] == pytest.approx(single[case]["losses"], abs=EXACT), case
        assert fsdp[case]["grad_norms"] == pytest.approx(single[case]["grad_norms"], abs=EXACT), case
    # clipping bit at every step (max_grad_norm 0.05), on the norm of the whole model, not of a rank's shard
    assert min(fsdp["fused"]["grad_norms"]) > 10 * 0.05
    assert fsdp["autocast"]["losses"] == pytest.approx(ddp["autocast"]["losses"], abs=BF16)
    assert fsdp["autocast"]["param_dtype"] == "torch.bfloat16" and ddp["autocast"]["param_dtype"] is None
    if "fp8" in CASES:
        for a, b in zip(fsdp["fp8"]["losses"], ddp["fp8"]["losses"], strict=True):
            assert abs(a - b) / b < FP8
    # optimum-habana's GaudiLlamaDecoderLayer, as this Llama calls it: each decoder layer sharded on its own
    assert "FSDPLlamaDecoderLayer" in fsdp["fused"]["sharded_modules"] and not ddp["fused"]["sharded_modules"]
    assert "FSDPGPT2Block" in fsdp["gpt2"]["sharded_modules"]
    for case in ("fused", "lora"):  # use_fused_adam: torch's fused AdamW takes the DTensor shards
        assert fsdp[case]["optimizer"] == single[case]["optimizer"] == "AdamW(fused=True)"
    for rank in (0, 1):  # each rank logs its own memory
        assert ranks[rank]["fsdp"]["fused"]["memory"]["max_memory_allocated (GB)"] > 0


@pytest.fixture(scope="module")
def two_simulated_gaudis(tmp_path_factory) -> tuple[Path, dict[int, dict]]:
    """One launch on 2 simulated Gaudis (software 1.21, eager), 'hccl' on hpu tensors: FSDP saved and resumed, DDP,
    and fp8 under DDP saved and resumed (tests/scripts/fsdp_features.py ``resume``); the folder and each rank's
    results. The Transformer Engine keeps its scaling state as an io.BytesIO here (FAKE_HPU_TE_EXTRA_STATE)."""
    tmp_path = tmp_path_factory.mktemp("gaudis")
    path = os.pathsep.join(filter(None, [FAKES, os.environ.get("PYTHONPATH")]))
    env = {"PYTHONPATH": path, "FAKE_HPU_DEVICE": "1", "FAKE_HPU_DEVICE_COUNT": "2", "FAKE_HPU_SOFTWARE": "1.21"}
    env.update(FAKE_HPU_CALL_LOG=str(tmp_path / "simulator.json"), FAKE_HPU_TE_EXTRA_STATE="bytesio")
    try:
        return tmp_path, torchrun(tmp_path, "resume", [], **env)
    except AssertionError as stopped:  # a launch that stops fails each test with its output (not a fixture error)
        return tmp_path, stopped


def launched(fixture: tuple) -> tuple[Path, dict[int, dict]]:
    tmp_path, ranks = fixture
    if isinstance(ranks, AssertionError):
        pytest.fail(f"the launch on 2 simulated Gaudis stopped: {ranks}")
    return tmp_path, ranks


def test_the_ddp_run_after_two_fsdp_runs_in_one_process_counts_its_gradient_reductions(two_simulated_gaudis):
    """Issue 46: the collective count (on here: the simulated hccl numbers no collectives) hooks the DDP module of
    the third training in these processes, after two FSDP ones, on every rank; FSDP's modules are not DDP's."""
    _, ranks = launched(two_simulated_gaudis)
    for rank in (0, 1):
        runs = ranks[rank]
        assert runs["ddp"]["counting_hook"] is True, rank
        assert runs["whole"]["counting_hook"] is runs["resumed"]["counting_hook"] is None, rank


def one_simulated_gaudi(tmp_path) -> dict:
    """tests/scripts/fsdp_features.py ``resume`` on one process on the simulated Gaudi: the same training, 8 rows a
    step on the one device."""
    path = os.pathsep.join(filter(None, [FAKES, os.environ.get("PYTHONPATH")]))
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("PT_HPU", "FAKE_HPU", "RANK", "WORLD_SIZE"))}
    environ.update(PYTHONPATH=path, FAKE_HPU_DEVICE="1", FAKE_HPU_SOFTWARE="1.21", OMP_NUM_THREADS="1")
    out = tmp_path / "one" / "results.json"
    out.parent.mkdir()
    command = [sys.executable, str(SCRIPT), str(out), "resume"]
    result = subprocess.run(command, env=environ, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(Path(f"{out}.0").read_text())["one"]


def test_fsdp_on_two_simulated_gaudis_saves_sharded_checkpoints_and_resumes(two_simulated_gaudis):
    """Gaudi software 1.21 (eager), 'hccl' on hpu tensors: the Llama trains with the fused-AdamW, fused-clip and
    autocast config (the bridge's FusedAdamW takes no DTensor: torch's AdamW), its gradients reduce-scattered with
    SUM and divided (HCCL has no AVG: collective_utils.cpp) to DDP's and one process's on the simulated Gaudi (4
    simulated Gaudis: tests/integration/optimum_habana/test_optimum_habana_commands.py), saves SHARDED_STATE_DICT checkpoints, and a
    run resumed from step 2 trains steps 3 and 4 to the uninterrupted run's losses; its ``save_model`` writes the
    folder plain transformers loads, with the trained weights."""
    tmp_path, ranks = launched(two_simulated_gaudis)
    one = one_simulated_gaudi(tmp_path)
    assert one["device"].startswith("hpu") and not one["sharded"]
    # every collective on 'hccl' one the bridge maps and docs/collectives.md lists; FSDP's gradients summed
    issued = {census.key(entry) for entry in census.check(tmp_path / "simulator.json", range(2))}
    assert ("FSDP2", "reduce_scatter_tensor", "SUM", "float32") in issued
    assert ("FSDP2", "allgather_into_tensor", "-", "bfloat16") in issued  # the autocast's bf16 gathers
    assert ("gradient clipping", "allreduce", "SUM", "float32") in issued
    assert {"torch.distributed.checkpoint", "DDP", census.DDP_REDUCER} <= {key[0] for key in issued}
    for rank in (0, 1):
        run = ranks[rank]
        assert run["whole"]["device"].startswith("hpu") and run["whole"]["steps_run"] == [1, 2, 3, 4]
        assert run["resumed"]["steps_run"] == [3, 4]
        assert run["resumed"]["losses"] == pytest.approx(run["whole"]["losses"], abs=EXACT)
        assert run["whole"]["optimizer"] == run["resumed"]["optimizer"] == "AdamW"
        # the DDP run after the FSDP ones in the same processes is not sharded (ACCELERATE_USE_FSDP was left set)
        assert run["whole"]["sharded"] and not run["ddp"]["sharded"]
        # the mean of the ranks' gradients, as DDP's and one process's (bf16 all-gathers under FSDP: bf16's
        # rounding apart; one process's logged loss is one bf16 number where the ranks' is the mean of two)
        assert run["whole"]["losses"] == pytest.approx(run["ddp"]["losses"], abs=BF16)
        assert run["whole"]["losses"] == pytest.approx(one["losses"], rel=2**-8)
        for reference in (run["ddp"], one):
            assert run["whole"]["grad_norms"] == pytest.approx(reference["grad_norms"], rel=0.02)
        calls = run["bridge_calls"]
        assert {"distributed.hccl.allgather_into_tensor", "distributed.hccl.reduce_scatter_tensor"} <= set(calls)
        assert not any(name.startswith("hpex.") for name in calls)  # neither FusedAdamW nor FusedClipNorm
    files = ranks[0]["checkpoint"]
    for part in ("pytorch_model_fsdp_0", "optimizer_0"):  # one shard per rank
        assert {f"{part}/__0_0.distcp", f"{part}/__1_0.distcp", f"{part}/.metadata"} <= set(files)
    final = ranks[0]["final"]  # save_model's rows went to rank 0 over gloo, beside hccl
    assert {"model.safetensors", "config.json", "gaudi_config.json"} <= set(final["files"]) and final["equal"] is True


def test_the_cpu_says_whether_gloos_reduce_scatter_averages_on_this_torch(tmp_path):
    """FSDP2 reduce-scatters float32 gradients with ReduceOp.AVG; gloo took it but summed on torch 2.6 and 2.7, and
    FSDP's gradients came out twice too large on 2 CPU processes (hidden from the losses by Adam and clipping; the
    gradient norm was twice one process's). The CPU device says so, and FSDP then sums and divides."""
    from optimum_gaudi.devices.cpu import CPUDevice

    out = tmp_path / "avg.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1"]
    command += ["--master_port", str(free_port()), str(SCRIPTS / "gloo_reduce_scatter_avg.py"), str(out)]
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE"))}
    result = subprocess.run(command, env=environ, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    averaged = json.loads(out.read_text())["result"] == [3.5, 3.5]  # the mean of 3 and 4; a sum gives 7
    assert CPUDevice.collectives_average == averaged


def test_fsdp_sums_for_avg_as_ddp_on_two_simulated_gaudis_on_every_torch(tmp_path):
    """HCCL takes no ReduceOp.AVG. torch 2.8+ sums and divides with FSDPModule.set_force_sum_reduction_for_comms;
    torch 2.6 and 2.7 (Gaudi software 1.20-1.22) have no such switch, so each unit's group sums and the loss's
    gradient is divided by the world size, the same mean (make test-compat-torch runs this on both). Fused AdamW,
    clipping that bites and two micro-batches a step: the losses and gradient norms DDP's."""
    path = os.pathsep.join(filter(None, [FAKES, os.environ.get("PYTHONPATH")]))
    env = {"PYTHONPATH": path, "FAKE_HPU_DEVICE": "1", "FAKE_HPU_DEVICE_COUNT": "2", "FAKE_HPU_SOFTWARE": "1.21"}
    env.update(FAKE_HPU_CALL_LOG=str(tmp_path / "simulator.json"))
    ranks = torchrun(tmp_path, "fsdp,ddp", ["fused"], **env)
    issued = {census.key(entry) for entry in census.check(tmp_path / "simulator.json", range(2))}
    assert ("FSDP2", "reduce_scatter_tensor", "SUM", "float32") in issued
    for rank in (0, 1):
        fsdp, ddp = ranks[rank]["fsdp"]["fused"], ranks[rank]["ddp"]["fused"]
        assert "FSDPLlamaDecoderLayer" in fsdp["sharded_modules"]
        # float32 sums in another order, through Adam's steps (1.4e-5 at step 3 seen on torch 2.13)
        assert fsdp["losses"] == pytest.approx(ddp["losses"], rel=1e-5)
        assert fsdp["grad_norms"] == pytest.approx(ddp["grad_norms"], rel=1e-4)
        assert min(fsdp["grad_norms"]) > 10 * 0.05  # clipped at every step


def test_fp8_scaling_state_is_each_ranks_own_and_resumed_exactly_on_two_simulated_gaudis(two_simulated_gaudis):
    """optimum-habana's recipe (reduce_amax=False): each card keeps its own amax history; every rank saves its own
    into the checkpoint and loads its own, so the resumed run's losses and each rank's histories equal the
    uninterrupted run's. The modules' ``_extra_state`` is an io.BytesIO here, kept as well as a tensor."""
    _, ranks = launched(two_simulated_gaudis)
    histories = []
    for rank in (0, 1):
        fp8 = ranks[rank]["fp8"]
        assert {"fp8_scaling_state.rank0.pt", "fp8_scaling_state.rank1.pt"} <= set(fp8["checkpoint"])
        assert fp8["fp8_resumed"]["losses"][-2:] == fp8["fp8_whole"]["losses"][-2:]
        assert fp8["fp8_resumed"]["amax"] == fp8["fp8_whole"]["amax"] and fp8["fp8_whole"]["amax"]
        histories.append(fp8["fp8_whole"]["amax"])
    assert histories[0] != histories[1]  # each rank scaled its own batches


LAZY_FSDP = """
import sys
import tiny
from optimum_gaudi import GaudiTrainer, GaudiTrainingArguments
from optimum_gaudi.errors import run_main

def main(argv):
    args = GaudiTrainingArguments(
        output_dir=sys.argv[1], use_habana=True, use_lazy_mode=True, fsdp="full_shard auto_wrap", max_steps=1,
        fsdp_config={"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}, per_device_train_batch_size=2,
        report_to="none", save_strategy="no", disable_tqdm=True,
    )
    GaudiTrainer(model=tiny.llama(), args=args, train_dataset=tiny.lm_data()).train()

run_main(main, [])
"""


def test_lazy_mode_with_fsdp_on_a_simulated_gaudi_stops_at_the_arguments(tmp_path):
    """Gaudi software 1.19 (lazy by default), one rank over 'hccl': one line, nothing trained. Without the check the
    first forward's freeing of a gathered parameter (``untyped_storage().resize_``, which runs ``set_``) aborts the
    process in the bridge's lazy kernels (``habana_kernels/lazy_kernels.cpp``), as the simulator does."""
    tests = str(TESTS)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PT_HPU", "FAKE_HPU", "RANK", "WORLD_SIZE"))}
    env.update(PYTHONPATH=os.pathsep.join([SIMULATED_PATH, tests]), FAKE_HPU_DEVICE="1", FAKE_HPU_SOFTWARE="1.19")
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    env.update(MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    command = [sys.executable, "-c", LAZY_FSDP, str(tmp_path / "out")]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and lines, (result.returncode, result.stderr[-3000:])  # run_main: a usage error
    assert "--use_lazy_mode cannot be combined with --fsdp" in lines[-1] and "Traceback" not in result.stderr

"""run_clm.py end to end on the simulated Gaudi (tests/fakes, a test double), on both software generations.

Subprocess runs are started as a user starts them (``optimum-gaudi launch`` or ``python run_clm.py``) with the
simulator on PYTHONPATH: torch's own autoload loads it where the real bridge would load. They run on the
simulated ``hpu`` device (FAKE_HPU_DEVICE=1): transformers and accelerate take their Gaudi path and the model,
batches, optimizer state and collectives live on ``hpu``. The simulator writes
what it saw (calls, environment at load, autocast lists) to ``FAKE_HPU_CALL_LOG.RANK`` when the process exits.
Every bundled config runs in-process (cheaper), with the environment the launcher would export.
"""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import census
import pytest
import torch
from conftest import DYNAMO_BREAKS_IN_TRANSFORMERS, GAUDI_SOFTWARE, ON_DEVICE, SIMULATED_PATH
from support import REPO, TESTS

from optimum_gaudi import GaudiConfig
from optimum_gaudi.configuration.gaudi_config import bundled_configs_dir
from optimum_gaudi.launch.environment import launch_environment
from optimum_gaudi.precision.op_lists import config_uses_op_lists, resolve_op_lists

RUN_CLM = REPO / "examples" / "language-modeling" / "run_clm.py"
TINY = ["--model_type", "gpt2", "--config_overrides", "n_layer=1,n_embd=32,n_head=2", "--block_size", "32"]
SHORT = ["--max_steps", "2", "--per_device_train_batch_size", "4", "--report_to", "none", "--save_strategy", "no"]
CONFIGS = sorted(p.stem for p in bundled_configs_dir().glob("*.json"))


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tokenizer-cache"))  # the embedded corpus' tokenizer, trained once


def expected_lists(name):
    config = GaudiConfig.from_pretrained(name)
    if not config_uses_op_lists(config):
        return None
    bf16, fp32 = resolve_op_lists(config.autocast_bf16_ops, config.autocast_fp32_ops)
    return [sorted(bf16), sorted(fp32)]


def run_clm_process(tmp_path, cache, software, *argv, launcher=(), **env):
    """run_clm.py in a fresh process on the simulated Gaudi and its hpu device; returns (completed process,
    rank 0's log)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PT_HPU", "FAKE_HPU", "RANK", "WORLD_SIZE"))}
    log = tmp_path / "simulator.json"
    clean.update(PYTHONPATH=SIMULATED_PATH, FAKE_HPU_SOFTWARE=software, FAKE_HPU_CALL_LOG=str(log), OMP_NUM_THREADS="1")
    clean.update(FAKE_HPU_DEVICE="1")
    clean.update(OPTIMUM_GAUDI_CACHE=cache, HF_HUB_OFFLINE="1", **env)
    python = [sys.executable, "-m", "optimum_gaudi", "launch", *launcher] if launcher is not None else [sys.executable]
    command = [*python, str(RUN_CLM), *TINY, *SHORT, "--use_habana", "--output_dir", str(tmp_path / "out"), *argv]
    result = subprocess.run(command, env=clean, capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stderr[-4000:]
    return result, rank_log(tmp_path, 0)


def rank_log(tmp_path, rank):
    """What the simulator saw in that rank; the run placed its model on the simulated hpu device."""
    log = json.loads(Path(f"{tmp_path / 'simulator.json'}.{rank}").read_text())
    assert log["device"]["allocations"] > 100 and log["device"]["peak_bytes"] > 100_000, log.get("device")
    return log


def test_lazy_with_hpu_graphs_and_evaluation_during_training_on_todays_software(tmp_path, cache):
    """1.21+ with the legacy lazy mode: the launcher exports PT_HPU_LAZY_MODE=1, so the bridge does not autoload;
    training graphs, inference graphs kept off the trained model, a non-empty profiler trace."""
    flags = ["--do_train", "--do_eval", "--max_eval_samples", "8", "--use_lazy_mode", "--gaudi_config_name", "gpt2"]
    flags += ["--use_hpu_graphs_for_training", "--use_hpu_graphs_for_inference", "--eval_strategy", "steps"]
    flags += ["--eval_steps", "1", "--profiling_steps", "1", "--logging_steps", "1"]
    result, log = run_clm_process(tmp_path, cache, "1.21", *flags, launcher=())
    names = log["names"]
    assert log["env_at_import"]["PT_HPU_LAZY_MODE"] == "1" and "autoload" not in names
    assert log["autocast_lists"] == expected_lists("gpt2")
    assert "hpu.ModuleCacher.capture" in names and names.count("core.mark_step") >= 4
    assert names.count("hpu.wrap_in_hpu_graph") == 1  # the final evaluation, after training
    assert "Evaluations during training run without HPU Graphs" in result.stderr + result.stdout
    trace = json.loads((tmp_path / "out" / "profile_rank0.pt.trace.json").read_text())
    assert any(e.get("name") == "ProfilerStep#0" for e in trace["traceEvents"])
    assert math.isfinite(json.loads((tmp_path / "out" / "eval_results.json").read_text())["eval_loss"])


def test_eager_torch_compile_with_autoload_and_no_launcher(tmp_path, cache):
    """1.21+ default path, started with plain python: the bridge loads during `import torch` in eager mode and
    torch.compile uses hpu_backend. bert-base-uncased leaves its op lists out: Habana's defaults, already loaded."""
    flags = ["--do_train", "--torch_compile", "--gaudi_config_name", "bert-base-uncased"]
    result, log = run_clm_process(tmp_path, cache, "1.21", *flags, launcher=None)
    names = log["names"]
    assert "autoload" in names and log["env_at_import"].get("PT_HPU_LAZY_MODE") is None
    assert "dynamo.hpu_backend" in names and "core.mark_step" not in names
    assert "loaded its autocast op lists" not in result.stderr  # the defaults are what the config means
    assert log["autocast_lists"] == expected_lists("bert-base-uncased")


def test_fast_ddp_with_hpu_graphs_on_two_processes(tmp_path, cache):
    """Gaudi software 1.19 (lazy default), two processes over 'hccl' (hpu tensors only; gloo on host copies
    underneath on the simulator), with --loss_spike_factor: its collective is in the census."""
    flags = ["--do_train", "--use_lazy_mode", "--use_hpu_graphs_for_training", "--distribution_strategy", "fast_ddp"]
    flags += ["--gaudi_config_name", "gpt2", "--loss_spike_factor", "1000"]  # the guard's all-reduce, in the census
    run_clm_process(tmp_path, cache, "1.19", *flags, launcher=("--world_size", "2"), FAKE_HPU_DEVICE_COUNT="2")
    for rank in (0, 1):
        log = rank_log(tmp_path, rank)
        assert log["env_at_import"]["PT_HPU_LAZY_MODE"] == "1"
        assert log["names"].count("distributed.hccl.allreduce") >= 2  # fast_ddp's fused buffer, on hpu
        assert "hpu.ModuleCacher.capture" in log["names"] and log["names"].count("hpex.optimizers.FusedAdamW.step") == 2
        assert log["autocast_lists"] == expected_lists("gpt2")
    issued = {census.key(entry) for entry in census.check(tmp_path / "simulator.json", range(2))}
    assert ("fast_ddp", "allreduce", "SUM", "bfloat16") in issued  # the fused buffer in bf16 (the device's default)
    assert ("non-finite guard", "allreduce", "SUM", "float32") in issued  # the loss spike's mean loss


def load_run_clm():
    spec = importlib.util.spec_from_file_location("run_clm_under_test", RUN_CLM)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def pytest_on_device(*tests: str) -> subprocess.CompletedProcess:
    """Tests in one pytest process started on the simulated hpu device (a process cannot load the device after
    torch answered that it has no accelerator, nor unload it for the other tests)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PT_HPU", "FAKE_HPU", "RANK", "WORLD_SIZE"))}
    env.update(PYTHONPATH=SIMULATED_PATH, FAKE_HPU_DEVICE="1", OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests]
    return subprocess.run(command, cwd=TESTS, env=env, capture_output=True, text=True, timeout=600)


def test_every_bundled_config_runs_on_the_simulated_device():
    """The matrix below: every bundled config on both Gaudi software generations."""
    result = pytest_on_device(
        f"{Path(__file__).resolve().relative_to(TESTS)}::test_run_clm_trains_and_evaluates_with_each_bundled_config"
    )
    passed = f"{len(CONFIGS) * len(GAUDI_SOFTWARE)} passed"
    assert result.returncode == 0 and passed in result.stdout, result.stdout[-4000:]


# The in-process tests of the HPU path's defects and of the simulator's strictness, again with the model, batches
# and optimizer state on the hpu device (in the main pytest process they run on CPU tensors); tests marked
# `cpu` skip there.
ON_DEVICE_TOO = [
    "unit/devices/test_hpu_graphs_launch_and_op_names.py", "integration/features/test_static_batch.py",
    "unit/trainers/test_seq2seq.py", "unit/devices/test_hpu_user_settings.py", "unit/features/test_graphs.py",
    "integration/features/test_llm_kernels.py", "integration/devices/test_hpu_launch_and_lazy_mode.py",
]  # fmt: skip


def test_the_hpu_path_tests_pass_on_the_simulated_device():
    result = pytest_on_device(*ON_DEVICE_TOO)
    summary = result.stdout.strip().splitlines()[-1]
    assert result.returncode == 0 and " passed" in summary and "failed" not in summary, result.stdout[-6000:]


@pytest.mark.skipif(not ON_DEVICE, reason="run on the simulated device by the test above")
@pytest.mark.parametrize(
    "name, gaudi_software", [(n, g) for n in CONFIGS for g in GAUDI_SOFTWARE], indirect=["gaudi_software"]
)
def test_run_clm_trains_and_evaluates_with_each_bundled_config(
    name, gaudi_software, bridge, tmp_path, cache, monkeypatch
):
    """1.19 configs run lazy, 1.21 eager; the environment is what `optimum-gaudi launch` exports, and the
    bridge loads where it would (at `import torch` when its autoload is on, else when the arguments import it)."""
    lazy = ["--use_lazy_mode"] if gaudi_software == "1.19" else []
    argv = [*TINY, *SHORT, "--do_train", "--do_eval", "--max_eval_samples", "8", "--use_habana", *lazy]
    argv += ["--gaudi_config_name", name, "--output_dir", str(tmp_path), "--disable_tqdm", "true"]
    monkeypatch.setenv("OPTIMUM_GAUDI_CACHE", cache)
    for key, value in launch_environment(argv).items():
        monkeypatch.setenv(key, value)
    import habana_frameworks.autoload as autoload

    if autoload.is_autoload_enabled():
        import habana_frameworks.torch  # noqa: F401  (what torch's entry point does at `import torch`)
    allocations = torch.ops.fake_hpu.num_allocs()  # the simulated device's allocator (loaded at `import torch`)
    metrics = load_run_clm().main(argv)
    assert math.isfinite(metrics["eval_loss"]) and metrics["train_throughput_steps"] == 2
    names = bridge().names()
    assert names.count("hpex.optimizers.FusedAdamW.step") == 2
    assert (names.count("core.mark_step") >= 4) is bool(lazy)
    lists = expected_lists(name)
    if lists is not None:
        assert [sorted(s) for s in bridge().autocast_lists] == lists
    assert torch.ops.fake_hpu.num_allocs() - allocations > 100  # model, batches, optimizer state on hpu


def test_a_llama_compiles_once_with_gaudis_fused_kernels_on_the_device(tmp_path, cache):
    """The bundled llama config on a Llama-family model: FusedSDPA, fused RMSNorm and RoPE inside torch.compile,
    one graph for three same-shape steps. The simulated kernels' call log had made dynamo guard on its length:
    a recompilation at every step."""
    llama = ["--model_type", "llama", "--config_overrides"]
    llama += ["num_hidden_layers=1,hidden_size=32,num_attention_heads=4,num_key_value_heads=2,intermediate_size=64"]
    flags = [*llama, "--do_train", "--max_steps", "3", "--torch_compile", "--bf16", "--gaudi_config_name", "llama"]
    flags += ["--attn_implementation", "gaudi_fused_sdpa"]
    result, log = run_clm_process(tmp_path, cache, "1.21", *flags, launcher=None)
    # traced kernels leave no record (they run in the graph); torch 2.6 compiles the model as 3 graphs (dynamo breaks
    # twice in transformers' wrappers), each once: a recompilation at every step would make 9
    graphs = 3 if DYNAMO_BREAKS_IN_TRANSFORMERS else 1
    assert log["names"].count("dynamo.hpu_backend") == graphs
    assert math.isfinite(json.loads((tmp_path / "out" / "train_results.json").read_text())["train_loss"])

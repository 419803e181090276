"""Shared fixtures: offline by default, small tensors, a tiny GPT-2 and its data."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

# before transformers, huggingface_hub and datasets are imported (tiny imports them): they read these once
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_DISABLED", "true")
torch.set_num_threads(1)
# Every process a test starts imports this checkout's optimum_gaudi, not the one the environment's editable install
# points at: from a second work tree, the ranks a test launched ran the first tree's code while the test ran its own
# (tests/unit/test_launched_processes.py). The likeliest reading of issue 46's "the DDP training after two FSDP ones
# in tests/scripts/fsdp_features.py ran without the counting hook": with this tree's code its ranks carry it. A
# process given a PYTHONPATH of its own adds to this one or takes SIMULATED_PATH.
REPO = Path(__file__).resolve().parent.parent
_paths = [str(REPO), *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(REPO))]
os.environ["PYTHONPATH"] = os.pathsep.join(_paths)
# where a run that asks for no particular device lands without a Gaudi: the suite also runs on a CUDA machine
FALLBACK_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

import tiny  # noqa: E402


@pytest.fixture
def tiny_lm_data():
    """tiny.lm_data(): 64 random 16-token sequences over a 100-token vocabulary, labels = inputs."""
    return tiny.lm_data()


@pytest.fixture
def tiny_gpt2():
    """tiny.gpt2, a factory so each trainer gets the same freshly initialised weights."""
    return tiny.gpt2


FAKES = str(Path(__file__).parent / "fakes")
SIMULATED_PATH = os.pathsep.join([FAKES, str(REPO)])  # a process on the simulated Gaudi: the simulator, this checkout
# a pytest process started on the simulated hpu device (FAKE_HPU_DEVICE=1 with tests/fakes on PYTHONPATH, see
# tests/integration/devices/test_run_clm_on_the_simulated_hpu.py): transformers then places every model on hpu, so CPU-only tests are skipped there
ON_DEVICE = os.environ.get("FAKE_HPU_DEVICE") == "1"


# tests/unit mirrors optimum_gaudi/'s folders with in-process tests fast enough for `make test-fast`; tests/integration
# holds what starts processes (launches, several ranks, kill sweeps, the pytest runs on the simulated device) and
# in-process runs too slow for that loop. Each test is marked by its folder: `pytest -m "not integration"` works too.
COST_FOLDERS = ("unit", "integration")
TESTS = Path(__file__).resolve().parent


def pytest_configure(config):
    config.addinivalue_line("markers", "cpu: a run on CPU; skipped in a process on the simulated hpu device")
    config.addinivalue_line("markers", "unit: in tests/unit: in process and fast (make test-fast)")
    config.addinivalue_line("markers", "integration: in tests/integration: real processes, or in process and slow")


def pytest_collection_modifyitems(config, items):
    for item in items:
        try:
            folder = Path(item.path).resolve().relative_to(TESTS).parts[0]
        except ValueError:  # a test file outside tests/
            continue
        if folder in COST_FOLDERS:
            item.add_marker(folder)
    if ON_DEVICE:
        skip = pytest.mark.skip(reason="a CPU run, and this process has the simulated hpu device")
        for item in items:
            if item.get_closest_marker("cpu"):
                item.add_marker(skip)


GAUDI_SOFTWARE = ("1.19", "1.21")  # the simulator's two generations: lazy default / eager default + autoload


def _unload_bridge():
    simulator = sys.modules.get("habana_frameworks")
    if getattr(simulator, "SIMULATED", False):
        simulator.unload()  # also restores what importing it patched in torch (the profiler enum)
    for name in [m for m in sys.modules if m.split(".")[0] in ("habana_frameworks", "intel_transformer_engine")]:
        del sys.modules[name]


@pytest.fixture
def gaudi_software(request, monkeypatch):
    """The simulated Gaudi software generation (1.21 unless a test parametrizes it indirectly)."""
    version = getattr(request, "param", "1.21")
    monkeypatch.setenv("FAKE_HPU_SOFTWARE", version)
    return version


def hide_cuda(monkeypatch) -> None:
    """A Gaudi host has no NVIDIA GPU. Without the simulated hpu device (the in-process tests) accelerate finds no
    hpu and would place the "Gaudi" run on CUDA where the suite runs on a GPU machine, against a CPU reference."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


@pytest.fixture
def bridge(monkeypatch, gaudi_software):
    """The simulated Habana bridge (tests/fakes, a test double), importable but not yet imported, and the
    environment as a new process has it. Returns a getter for the imported simulator's call log.

    Importing the simulator changes the environment as the bridge does (MASTER_ADDR, ...): the whole
    environment is restored afterwards."""
    saved = dict(os.environ)
    for var in [v for v in os.environ if v.startswith(("PT_HPU", "PT_TE_", "HLS_MODULE_ID"))]:
        monkeypatch.delenv(var)
    monkeypatch.delenv("OPTIMUM_GAUDI_REQUIRE_HPU", raising=False)
    monkeypatch.syspath_prepend(FAKES)
    hide_cuda(monkeypatch)
    _unload_bridge()
    yield lambda: sys.modules["habana_frameworks"]
    _unload_bridge()
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(autouse=True)
def _accelerate_environment():
    """transformers 4.57's TrainingArguments export settings as ACCELERATE_* variables (a torch_compile
    backend, mixed precision) that would leak into later tests; each test starts from the same ones."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("ACCELERATE_")}
    yield
    for key in [k for k in os.environ if k.startswith("ACCELERATE_") and k not in saved]:
        del os.environ[key]
    os.environ.update(saved)


# torchao (--fp8 on CPU) sits beside .venv (the Makefile's TORCHAO): off sys.path until a test needs it, because
# transformers imports it in every process and it logs about its CUDA extensions there. tests/compat/torch.sh names
# the one that goes with each older torch (TORCHAO_DIR).
TORCHAO_DIR = Path(os.environ.get("TORCHAO_DIR") or Path(__file__).resolve().parents[1] / ".venv-torchao")
has_torchao = importlib.util.find_spec("torchao") is not None or (TORCHAO_DIR / "torchao").is_dir()


def _cpu_fsdp_problem() -> str | None:
    from optimum_gaudi.devices.cpu import CPUDevice

    return CPUDevice().fsdp_problem()


# FSDP2 on CPU processes: torch 2.6's CPU streams record no events, so the arguments refuse --fsdp there in one line
# (tests/unit/distributed/test_fsdp.py); FSDP on simulated Gaudis runs on every torch.
CPU_FSDP = _cpu_fsdp_problem() is None
cpu_fsdp = pytest.mark.skipif(not CPU_FSDP, reason=str(_cpu_fsdp_problem()))
# torch 2.6's dynamo breaks in transformers 5's own wrappers (co_varnames, a dict subclass's super().get): a model
# compiles there in pieces, whatever the package does (README, "Which torch each Gaudi release ships")
TORCH_RELEASE = tuple(map(int, torch.__version__.split(".")[:2]))
DYNAMO_BREAKS_IN_TRANSFORMERS = TORCH_RELEASE < (2, 7)


def use_torchao() -> None:
    """Make torchao importable in this process (it stays: an imported module cannot be taken back anyway)."""
    if importlib.util.find_spec("torchao") is None:
        if not has_torchao:
            pytest.skip("--fp8 on CPU needs torchao: make test installs it in .venv-torchao")
        sys.path.append(str(TORCHAO_DIR))


@pytest.fixture
def torchao():
    use_torchao()


@pytest.fixture
def group_without_a_count(tmp_path, monkeypatch):
    """A gloo group of one process whose backend reads as one that numbers no collectives (as HCCL); every share
    of the collective count a test left is stopped after it (tests/unit/supervision)."""
    import torch.distributed as dist

    from optimum_gaudi.supervision import collective_count

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    monkeypatch.setattr(collective_count, "backend_counts", lambda group=None: False)
    try:
        yield
    finally:
        while collective_count.active() is not None:
            collective_count.stop()
        dist.destroy_process_group()

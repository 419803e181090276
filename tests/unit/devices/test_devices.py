import logging
import sys

import pytest
import torch
from conftest import FALLBACK_DEVICE

from optimum_gaudi import GaudiConfig, GaudiTrainingArguments
from optimum_gaudi.devices import FEATURES, CPUDevice, CUDADevice, HPUDevice, NoGaudiError, detect_device
from optimum_gaudi.features.table import feature_table


@pytest.fixture
def no_gaudi(monkeypatch):
    """This machine has no Gaudi; make sure no simulator on sys.path pretends otherwise."""
    monkeypatch.delenv("OPTIMUM_GAUDI_REQUIRE_HPU", raising=False)
    monkeypatch.setattr("optimum_gaudi.devices.hpu_available", lambda: False)


def cpu_capabilities(monkeypatch, **found):
    """This CPU, as torch's cpuinfo would report it: only the capabilities named are present."""
    monkeypatch.setattr("optimum_gaudi.devices.cpu.cpu_capabilities", lambda: {n for n, on in found.items() if on})
    monkeypatch.setattr("optimum_gaudi.devices.cpu.bf16_matmul_slowdown", lambda: 42.0)  # the ratio it would measure


def test_detects_best_available_device_without_gaudi(no_gaudi):
    assert detect_device().type == FALLBACK_DEVICE
    assert detect_device(use_cpu=True).type == "cpu"


def test_use_habana_without_gaudi_falls_back_with_one_warning(no_gaudi, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="optimum_gaudi"):
        args = GaudiTrainingArguments(output_dir=str(tmp_path), use_habana=True, report_to=[])
    warnings = [r for r in caplog.records if "no Gaudi is available" in r.getMessage()]
    assert len(warnings) == 1
    assert args.gaudi_device.type == FALLBACK_DEVICE == args.device.type


def test_without_use_habana_there_is_no_warning(no_gaudi, caplog):
    with caplog.at_level(logging.WARNING, logger="optimum_gaudi"):
        detect_device(use_habana=False)
    assert "no Gaudi" not in caplog.text


def test_require_hpu_turns_fallback_into_an_error(no_gaudi, monkeypatch, tmp_path):
    monkeypatch.setenv("OPTIMUM_GAUDI_REQUIRE_HPU", "1")
    with pytest.raises(NoGaudiError, match="OPTIMUM_GAUDI_REQUIRE_HPU=1 but no Gaudi is usable"):
        GaudiTrainingArguments(output_dir=str(tmp_path), use_habana=True, report_to=[])


def test_hpu_is_preferred_when_the_bridge_sees_a_gaudi(monkeypatch):
    monkeypatch.setattr("optimum_gaudi.devices.hpu_available", lambda: True)
    assert isinstance(detect_device(use_habana=True), HPUDevice)
    assert isinstance(detect_device(use_habana=True, use_cpu=True), CPUDevice)


def test_habana_frameworks_is_not_imported_on_this_machine():
    detect_device()
    assert "habana_frameworks.torch" not in sys.modules or "fakes" in str(sys.modules["habana_frameworks"].__file__)


@pytest.mark.parametrize("device_cls", [CPUDevice, CUDADevice, HPUDevice])
def test_every_device_explains_every_feature(device_cls):
    assert set(device_cls.behaviour) == set(FEATURES)
    assert device_cls.ddp_backend in {"gloo", "nccl", "hccl"}


def test_cpu_memory_stats_are_positive_and_ordered():
    stats = CPUDevice().memory_stats()
    assert (
        0 < stats["memory_allocated (GB)"] <= stats["max_memory_allocated (GB)"] < stats["total_memory_available (GB)"]
    )


def test_cpu_clip_matches_torch_and_returns_the_pre_clip_norm():
    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.randn(5))
    a.grad, b.grad = torch.randn(5) * 10, torch.randn(5) * 10
    expected = torch.cat([a.grad, b.grad]).norm()
    norm = CPUDevice().clip_grad_norm_([a, b], 1.0)
    assert torch.allclose(norm, expected)
    assert torch.allclose(torch.cat([a.grad, b.grad]).norm(), torch.tensor(1.0), atol=1e-5)


def test_feature_table_lists_settings_and_behaviour(tmp_path, monkeypatch):
    cpu_capabilities(monkeypatch, amx_bf16=True)  # a CPU that computes bf16 natively: no bf16 line
    args = GaudiTrainingArguments(output_dir=str(tmp_path), use_lazy_mode=True, gaudi_config_name="gpt2", report_to=[])
    table = feature_table(CPUDevice(), args, args.gaudi_config)
    lines = table.splitlines()
    assert len(lines) == len(FEATURES) + 2
    assert any(line.startswith("use_lazy_mode") and " on " in line and "eager" in line for line in lines)
    assert any(line.startswith("use_fused_adam") and "AdamW(fused=True)" in line for line in lines)
    assert any(line.startswith("distribution_strategy") and "ddp" in line for line in lines)


# ---- bf16 where the CPU only emulates it: detection is monkeypatched, so the tests pass on any host ------------


@pytest.mark.parametrize(
    ("found", "native"),
    [
        ({"avx2": True, "avx512_f": True}, False),  # Intel Skylake-X to Ice Lake: AVX-512 without its bf16 part
        ({"avx2": True, "avx512_bf16": True}, True),
        ({"amx_tile": True, "amx_bf16": True}, True),
        ({"neon": True, "bf16": True}, True),  # Arm with BF16 (Graviton 3, Apple M2+)
        ({"neon": True}, False),
    ],
)
def test_cpu_knows_whether_it_computes_bf16_natively(monkeypatch, found, native):
    cpu_capabilities(monkeypatch, **found)
    device = CPUDevice()
    assert device.native_bf16 is native
    note = device.bf16_note()
    assert (note is None) is native
    if not native:
        assert "no bf16 instructions" in note and "42x as long as in float32" in note


@pytest.mark.parametrize(
    ("cpuinfo", "native"),
    [
        ("flags\t\t: fpu sse2 avx2 avx512f avx512bw\n", False),
        ("flags\t\t: fpu avx2 avx512f avx512_bf16 amx_tile amx_bf16\n", True),  # Sapphire Rapids: AMX
        ("Features\t: fp asimd sve svebf16 bf16\n", True),  # Graviton 3
        ("Features\t: fp asimd\n", False),
    ],
)
def test_a_torch_without_get_capabilities_reads_the_kernels_cpu_flags(monkeypatch, tmp_path, cpuinfo, native):
    """torch 2.6-2.10 (every Gaudi release's) has no ``torch.cpu.get_capabilities``: an AMX or Arm BF16 CPU must not
    read as one that emulates bf16 there."""
    from optimum_gaudi.devices import cpu

    monkeypatch.delattr(torch.cpu, "get_capabilities", raising=False)
    for check in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        monkeypatch.setattr(torch.cpu, check, lambda: False, raising=False)  # this host's answer left out
    (tmp_path / "cpuinfo").write_text("processor\t: 0\n" + cpuinfo)
    monkeypatch.setattr(cpu, "CPUINFO", str(tmp_path / "cpuinfo"))
    assert cpu.cpu_has_bf16_instructions() is native


def test_this_cpus_capabilities_agree_with_the_kernels_flags():
    from optimum_gaudi.devices.cpu import BF16_CAPABILITIES, cpu_capabilities

    with open("/proc/cpuinfo") as f:
        flags = {word for line in f if line.split(":")[0].strip() in ("flags", "Features") for word in line.split()}
    assert flags.isdisjoint(BF16_CAPABILITIES) is cpu_capabilities().isdisjoint(BF16_CAPABILITIES)


def test_bf16_slowdown_is_measured_without_touching_the_random_stream_or_the_threads():
    from optimum_gaudi.devices.cpu import bf16_matmul_slowdown

    state, threads = torch.get_rng_state(), torch.get_num_threads()
    bf16_matmul_slowdown.cache_clear()
    assert bf16_matmul_slowdown() > 0
    assert torch.equal(torch.get_rng_state(), state)  # a seeded run trains the same with the note logged
    assert torch.get_num_threads() == threads  # timed on one thread, then the run's threads again


def bf16_lines(table):
    return [line for line in table.splitlines() if line.startswith("bf16:")]


@pytest.mark.parametrize(
    ("autocast", "bf16", "said"), [(True, False, True), (False, True, True), (True, True, True), (False, False, False)]
)
def test_feature_table_says_in_one_line_that_bf16_is_emulated_where_the_run_uses_it(
    monkeypatch, tmp_path, autocast, bf16, said
):
    cpu_capabilities(monkeypatch, avx2=True)
    args = GaudiTrainingArguments(output_dir=str(tmp_path), bf16=bf16, use_cpu=True, report_to=[])
    config = GaudiConfig(use_fused_adam=True, use_torch_autocast=autocast)
    lines = bf16_lines(feature_table(CPUDevice(), args, config))
    assert len(lines) == int(said)
    if said:  # bf16 stays on, as asked: only the user can trade its numerics for speed
        assert "42x" in lines[0] and "without --bf16 and use_torch_autocast" in lines[0]


def test_feature_table_has_no_bf16_line_where_bf16_is_native(monkeypatch, tmp_path):
    cpu_capabilities(monkeypatch, amx_bf16=True)
    args = GaudiTrainingArguments(
        output_dir=str(tmp_path), gaudi_config_name="gpt2", bf16=True, use_cpu=True, report_to=[]
    )
    assert bf16_lines(feature_table(CPUDevice(), args, args.gaudi_config)) == []


@pytest.mark.parametrize("version", ["2.5.1+hpu.synapse.v1.19.0", "2.1.0", "1.13.1+cpu"])
def test_a_torch_older_than_the_floor_is_one_line(version):
    from optimum_gaudi.devices import TorchTooOldError, check_torch_release

    with pytest.raises(TorchTooOldError, match=r"^optimum-gaudi needs torch >= 2\.6 .*this is torch ") as caught:
        check_torch_release(version)
    assert "\n" not in str(caught.value)
    for supported in ("2.6.0+hpu.synapse.v1.21.0", "2.10.0", "2.13.0+cpu"):
        check_torch_release(supported)


def test_setup_py_declares_the_floor_the_package_checks():
    import re
    from pathlib import Path

    from optimum_gaudi.devices import TORCH_FLOOR

    setup = (Path(__file__).parents[3] / "setup.py").read_text()
    assert re.search(r'"torch>=(\d+\.\d+)"', setup).group(1) == ".".join(map(str, TORCH_FLOOR))
    matrix = (Path(__file__).parents[3] / "tests" / "compat" / "gaudi_torch.txt").read_text()
    oldest = min(tuple(map(int, line.split()[1].split(".")[:2])) for line in matrix.splitlines() if line[:1].isdigit())
    assert oldest == TORCH_FLOOR  # the floor is the oldest torch the matrix tests

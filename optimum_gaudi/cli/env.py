"""``optimum-gaudi env``: what to paste into a bug report."""

from __future__ import annotations

import importlib.metadata
import os
import platform

# Environment variables that change what the Habana bridge, torch or this package do: shown by `env`.
_ENV_PREFIXES = ("PT_HPU_", "PT_ENABLE_", "HABANA_", "HCCL_", "OPTIMUM_GAUDI_", "CUDA_VISIBLE_DEVICES")
_SECRET_WORDS = ("TOKEN", "KEY", "SECRET", "PASSWORD")


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _bridge_version() -> str:
    from ..devices.hpu import bridge_installed

    version = _version("habana-torch-plugin")
    if version == "not installed" and bridge_installed():
        return "habana_frameworks importable, version unknown"
    return version


def _usable_cpus() -> str:
    total = os.cpu_count()
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return str(total)
    return str(total) if usable == total else f"{total} ({usable} usable by this process)"


def environment_report() -> str:
    """Plain text in a markdown code block: versions, platform, device, memory and the feature table."""
    import torch

    import optimum_gaudi

    from ..devices import CPUDevice, CUDADevice, NoGaudiError, detect_device
    from ..devices.base import GB
    from ..features.table import feature_table

    notes = []
    try:
        device = detect_device()
    except NoGaudiError as e:  # OPTIMUM_GAUDI_REQUIRE_HPU=1 without a Gaudi: report it, describe the fallback
        notes.append(f"device detection failed: {e}")
        device = CUDADevice() if torch.cuda.is_available() else CPUDevice()
    try:
        count = str(device.count())
    except Exception as e:  # a half-working driver is exactly what a bug report is for
        count = f"unknown ({type(e).__name__}: {e})"
    try:
        free, total = device.memory_info()
        memory = f"total {total / GB:.2f} GB, free {free / GB:.2f} GB"  # system RAM on CPU
    except Exception as e:
        memory = f"unavailable ({type(e).__name__}: {e})"

    rows = [
        ("optimum-gaudi", optimum_gaudi.__version__),
        ("Python", f"{platform.python_version()} ({platform.python_implementation()})"),
        ("torch", f"{torch.__version__} (CUDA build: {torch.version.cuda or 'no'})"),
        ("transformers", _version("transformers")),
        ("accelerate", _version("accelerate")),
        ("datasets", _version("datasets")),
        ("Habana bridge (habana-torch-plugin)", _bridge_version()),
        ("platform", platform.platform()),
        ("CPUs", _usable_cpus()),
        ("device", f"{device.type} x {count}"),
        ("device memory", memory),
        ("bf16", device.bf16_note() or "native"),
    ]
    env = sorted(
        f"{name}={value}"
        for name, value in os.environ.items()
        if name.startswith(_ENV_PREFIXES) and not any(word in name for word in _SECRET_WORDS)
    )
    rows.append(("environment", " ".join(env) if env else "(no PT_HPU_/HABANA_/HCCL_/OPTIMUM_GAUDI_ variables set)"))

    lines = ["```text", *(f"- {name}: {value}" for name, value in rows), *(f"- note: {n}" for n in notes)]
    lines += ["", f"Gaudi features on {device.type} (settings are per run: '-' here):", feature_table(device)]
    lines.append("```")
    return "\n".join(lines)


def add_command(subparsers) -> None:
    parser = subparsers.add_parser(
        "env", help="print versions, device and feature table for a bug report", description=environment_report.__doc__
    )
    parser.set_defaults(run=lambda args: print(environment_report()) or 0)

"""The ``optimum-gaudi`` command (also ``python -m optimum_gaudi``).

    optimum-gaudi env                      what to paste into a bug report
    optimum-gaudi plot OUTPUT_DIR [--out]  a PNG of a run's loss, learning rate, throughput, memory
    optimum-gaudi launch [--world_size N] [--nnodes N ...] SCRIPT ARGS...
                                           run SCRIPT on N processes per node (torchrun, deepspeed or mpirun)

Each subcommand is one ``add_*`` function that adds its parser and sets ``run`` to a function taking the
parsed arguments and returning the exit code; list it in ``COMMANDS``. A run function reports a problem the
user can fix by raising ``CommandError``: it is printed as one ``error: ...`` line, exit code 2.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import sys
from collections.abc import Callable, Sequence

from .errors import UserError

# Environment variables that change what the Habana bridge, torch or this package do: shown by `env`.
_ENV_PREFIXES = ("PT_HPU_", "PT_ENABLE_", "HABANA_", "HCCL_", "OPTIMUM_GAUDI_", "CUDA_VISIBLE_DEVICES")
_SECRET_WORDS = ("TOKEN", "KEY", "SECRET", "PASSWORD")


class CommandError(UserError):
    """Something the user can fix; the message is one line."""


# ---- env --------------------------------------------------------------------------------------------------


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _bridge_version() -> str:
    from .devices.hpu import bridge_installed

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

    from .devices import CPUDevice, CUDADevice, NoGaudiError, detect_device
    from .devices.base import GB
    from .features import feature_table

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


def add_env(subparsers) -> None:
    parser = subparsers.add_parser(
        "env", help="print versions, device and feature table for a bug report", description=environment_report.__doc__
    )
    parser.set_defaults(run=lambda args: print(environment_report()) or 0)


# ---- plot -------------------------------------------------------------------------------------------------


def _run_plot(args: argparse.Namespace) -> int:
    from .plot import PlotError, plot_run

    try:
        path = plot_run(args.output_dir, args.out)
    except PlotError as e:
        raise CommandError(str(e)) from e
    print(path)
    return 0


def add_plot(subparsers) -> None:
    parser = subparsers.add_parser(
        "plot",
        help="draw loss, learning rate, throughput and memory of a run to a PNG",
        description="Reads OUTPUT_DIR/trainer_state.json (or the newest checkpoint's) and writes a PNG.",
    )
    parser.add_argument("output_dir", metavar="OUTPUT_DIR", help="the --output_dir of a training run")
    parser.add_argument("--out", metavar="PATH", help="where to write the PNG (default: OUTPUT_DIR/training_plot.png)")
    parser.set_defaults(run=_run_plot)


# ---- launch -----------------------------------------------------------------------------------------------


def _run_launch(args: argparse.Namespace) -> int:
    from .distributed.launch import LaunchError, launch

    try:
        return launch(args)
    except LaunchError as e:
        raise CommandError(str(e)) from e


def add_launch(subparsers) -> None:
    from .distributed import launch

    parser = subparsers.add_parser(
        "launch",
        help="run a training script on several processes, cards or nodes",
        description=launch.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # an abbreviation before SCRIPT would silently become a launcher option
    )
    launch.add_arguments(parser)
    parser.set_defaults(run=_run_launch)


# ---- entry point ------------------------------------------------------------------------------------------

COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [add_env, add_plot, add_launch]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="optimum-gaudi", description="Tools for training Hugging Face models on Intel Gaudi (HPU)."
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in COMMANDS:
        add(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2): argparse already printed it
        return e.code if isinstance(e.code, int) else 2
    try:
        return args.run(args)
    except CommandError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

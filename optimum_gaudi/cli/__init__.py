"""The ``optimum-gaudi`` command (also ``python -m optimum_gaudi``).

    optimum-gaudi env                      what to paste into a bug report
    optimum-gaudi plot OUTPUT_DIR [--out]  a PNG of a run's loss, learning rate, throughput, memory
    optimum-gaudi launch [--world_size N] [--nnodes N ...] SCRIPT ARGS...
                                           run SCRIPT on N processes per node (torchrun, deepspeed or mpirun)
    optimum-gaudi plan MODEL [--card gaudi2 --cards 8 --sequence N --global_batch N ...]
                                           will MODEL fit on these cards, with which settings, how fast

Each subcommand is one module here whose ``add_command`` adds its parser and sets ``run`` to a function taking
the parsed arguments and returning the exit code; list it in ``COMMANDS``. A run function reports a problem the
user can fix by raising ``CommandError``: it is printed as one ``error: ...`` line, exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from ..errors import CommandError
from . import env, launch, plan, plot

COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    env.add_command,
    plot.add_command,
    launch.add_command,
    plan.add_command,
]


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

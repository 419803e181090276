"""``optimum-gaudi launch``: the command line of the multi-process launcher (``launch/launcher.py``)."""

from __future__ import annotations

import argparse

from ..errors import CommandError


def _run_launch(args: argparse.Namespace) -> int:
    from ..launch.launcher import launch
    from ..launch.plan import LaunchError

    try:
        return launch(args)
    except LaunchError as e:
        raise CommandError(str(e)) from e


def add_command(subparsers) -> None:
    from ..launch import plan as launch_plan

    parser = subparsers.add_parser(
        "launch",
        help="run a training script on several processes, cards or nodes",
        description=launch_plan.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # an abbreviation before SCRIPT would silently become a launcher option
    )
    launch_plan.add_arguments(parser)
    parser.set_defaults(run=_run_launch)

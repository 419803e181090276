"""What ``optimum-gaudi launch`` and its ranks tell each other: the environment it gives them, the exit code of a
rank that ended on a stall. Read by both sides (the launcher, distributed/watchdog.py), so torch-free.

A user error's line travels the same way (``errors.LAUNCH_USER_ERROR_ENV``), defined in errors.py because
``run_main`` writes it.
"""

from __future__ import annotations

import os

STALL_EXIT_CODE = 124  # a rank that ended on a stall (as coreutils' timeout exits)
STALL_LINE_ENV = "OPTIMUM_GAUDI_LAUNCH_STALL"  # optimum-gaudi launch: where the deciding rank leaves its line
FLIGHT_RECORDER_ENV = "TORCH_FR_BUFFER_SIZE"  # torch's flight recorder: the collectives each group issued
FLIGHT_RECORDER_ENTRIES = "2000"


def enable_flight_recorder(environ: dict | os._Environ = os.environ) -> None:
    """Ask torch to record each group's collectives (read when the first group is made), so a report can name the
    one a rank waits in; a user's own setting is kept."""
    environ.setdefault(FLIGHT_RECORDER_ENV, FLIGHT_RECORDER_ENTRIES)

"""What ``optimum-gaudi launch`` and its ranks tell each other: the environment it gives them, the exit code of a
rank that ended on a stall. Read by both sides (the launcher, supervision/watchdog.py), so torch-free.

A user error's line travels the same way (``errors.LAUNCH_USER_ERROR_ENV``), defined in errors.py because
``run_main`` writes it.
"""

from __future__ import annotations

import os

STALL_EXIT_CODE = 124  # a rank that ended on a stall (as coreutils' timeout exits)
STALL_LINE_ENV = "OPTIMUM_GAUDI_LAUNCH_STALL"  # optimum-gaudi launch: where the deciding rank leaves its line
FLIGHT_RECORDER_ENV = "TORCH_FR_BUFFER_SIZE"  # torch's flight recorder: the collectives each group issued
# the only one NCCL's recorder reads on torch 2.6 and 2.7; from 2.8 every recorder reads it after the first, with a
# deprecation warning (torch's FlightRecorder.hpp, getCvarInt in c10d/Utils.hpp)
NCCL_FLIGHT_RECORDER_ENV = "TORCH_NCCL_TRACE_BUFFER_SIZE"
FLIGHT_RECORDER_ENTRIES = "2000"


def enable_flight_recorder(environ: dict | os._Environ = os.environ, nccl_variable: bool = False) -> None:
    """Ask torch to record each group's collectives (read when the first group is made), so a report can name the
    one a rank waits in; a user's own setting is kept. ``nccl_variable``: NCCL's own variable too (torch < 2.8)."""
    environ.setdefault(FLIGHT_RECORDER_ENV, FLIGHT_RECORDER_ENTRIES)
    if nccl_variable:
        environ.setdefault(NCCL_FLIGHT_RECORDER_ENV, environ[FLIGHT_RECORDER_ENV])

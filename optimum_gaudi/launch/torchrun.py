"""torchrun as ``optimum-gaudi launch`` runs it: ``python -m optimum_gaudi.launch.torchrun TORCHRUN-ARGS``.

The same program as ``python -m torch.distributed.run``, except how it ends. When a rank fails, torchrun raises
``ChildFailedError`` and Python prints its traceback and failure table after the rank's own error; when it is
stopped by a signal it raises ``SignalException``. Here neither is printed: the first failure goes, as JSON, to
the file named by ``OPTIMUM_GAUDI_LAUNCH_REPORT`` and the launcher ends the job with one line naming the rank.
When a rank ended on a user error (it left its line for the launcher, errors.py), torchrun's lines about the
failed rank and stopping the others are left out too: the launcher prints that one line. When the ranks were
preempted (each got SIGTERM, wrote its checkpoint and exited 143, supervision/preemption.py) the job exits 143 too:
a scheduler reads that as a preemption, where 1 reads as a failure.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys

from ..errors import LAUNCH_USER_ERROR_ENV

REPORT_ENV = "OPTIMUM_GAUDI_LAUNCH_REPORT"
PREEMPTED = 128 + signal.SIGTERM  # a rank's exit code after SIGTERM and its checkpoint (supervision/preemption.py)
_WORKER_LOGGER = "torch.distributed.elastic.multiprocessing.api"  # "failed (exitcode: ...)", "Sending process ..."


class _AfterUserError(logging.Filter):
    """Drops torchrun's records once a rank has left a user error's line for the launcher."""

    def filter(self, record: logging.LogRecord) -> bool:
        path = os.environ.get(LAUNCH_USER_ERROR_ENV)
        return not (path and os.path.exists(path))


def _report(record: dict) -> None:
    path = os.environ.get(REPORT_ENV)
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(record, f)


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    logging.getLogger(_WORKER_LOGGER).addFilter(_AfterUserError())
    try:
        torchrun_main(sys.argv[1:] if argv is None else argv)
    except ChildFailedError as e:
        if e.failures and all(failure.exitcode == PREEMPTED for failure in e.failures.values()):
            _report({"preempted": True})
            return PREEMPTED
        rank, failure = e.get_first_failure()
        _report({"rank": rank, "local_rank": failure.local_rank, "exitcode": failure.exitcode})
        return 1
    except SignalException as e:  # the launcher passed a stop signal on; the workers were stopped
        return 128 + int(e.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""torchrun as ``optimum-gaudi launch`` runs it: ``python -m optimum_gaudi.distributed.torchrun TORCHRUN-ARGS``.

The same program as ``python -m torch.distributed.run``, except how it ends. When a rank fails, torchrun raises
``ChildFailedError`` and Python prints its traceback and failure table after the rank's own error; when it is
stopped by a signal it raises ``SignalException``. Here neither is printed: the first failure goes, as JSON, to
the file named by ``OPTIMUM_GAUDI_LAUNCH_REPORT`` and the launcher ends the job with one line naming the rank.
"""

from __future__ import annotations

import json
import os
import sys

REPORT_ENV = "OPTIMUM_GAUDI_LAUNCH_REPORT"


def _report(record: dict) -> None:
    path = os.environ.get(REPORT_ENV)
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(record, f)


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    try:
        torchrun_main(sys.argv[1:] if argv is None else argv)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        _report({"rank": rank, "local_rank": failure.local_rank, "exitcode": failure.exitcode})
        return 1
    except SignalException as e:  # the launcher passed a stop signal on; the workers were stopped
        return 128 + int(e.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())

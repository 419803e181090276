"""`optimum-gaudi plan` is arithmetic: the planner and its command load without torch or transformers (a fresh
process, as a user's shell on a login node without an accelerator runs it)."""

from __future__ import annotations

import subprocess
import sys

from support import REPO


def test_the_planner_and_its_command_import_no_torch():
    code = (
        "import sys, optimum_gaudi.planning, optimum_gaudi.cli.plan; "
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"

"""A process a test starts imports this checkout's optimum_gaudi (tests/conftest.py), as the test itself does.

A work tree beside the one the environment's editable install points at ran its tests on its own code but the ranks
they launched on the other tree's: tests/scripts/fsdp_features.py's ranks, started with the test's PYTHONPATH (the
simulator only), imported the other tree's package, which could lack what the test checks (issue 46: a DDP run
read as trained without the counting hook)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import SIMULATED_PATH
from support import REPO

WHERE = "import importlib.util; print(importlib.util.find_spec('optimum_gaudi').origin)"


@pytest.mark.parametrize("pythonpath", ["inherited", "simulated"])
def test_a_launched_process_imports_this_checkouts_package(tmp_path, pythonpath):
    """Started as the tests start ranks: the test's environment, its PYTHONPATH inherited (torchrun in
    tests/integration/distributed/test_fsdp_trainings.py) or the simulated Gaudi's; from another folder, as a
    script's rank runs (sys.path[0] is the script's folder, not the repository)."""
    env = dict(os.environ)
    if pythonpath == "simulated":
        env["PYTHONPATH"] = SIMULATED_PATH
    found = subprocess.run([sys.executable, "-c", WHERE], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert found.returncode == 0, found.stderr
    assert found.stdout.strip() == str(REPO / "optimum_gaudi" / "__init__.py")

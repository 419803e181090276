"""`python -m optimum_gaudi` in a process of its own runs the command line (tests/unit/cli/test_cli.py: in
process)."""

import subprocess
import sys


def test_python_dash_m_runs_the_cli(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "optimum_gaudi", "plot", str(tmp_path / "nope")], capture_output=True, text=True
    )
    assert result.returncode == 2
    assert result.stderr.startswith("error: ") and "Traceback" not in result.stderr

"""optimum_gaudi.trl without TRL installed names the extra to install (a fresh process where TRL cannot be
imported). TRL's trainers made Gaudi trainers: tests/unit/trainers/test_trl.py."""

import subprocess
import sys

import pytest

trl = pytest.importorskip("trl")


def test_importing_without_trl_names_the_extra():
    code = "import sys; sys.modules['trl'] = None; import optimum_gaudi.trl"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert result.stderr.strip().splitlines()[-1] == (
        "ImportError: optimum_gaudi.trl needs TRL: pip install optimum-gaudi[trl]"
    )

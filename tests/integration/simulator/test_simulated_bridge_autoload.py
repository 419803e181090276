"""The simulated bridge (tests/fakes, a test double) loads at `import torch` as the real bridge's autoload does, per
software generation, in fresh processes. Its other behaviours: tests/unit/simulator/test_simulated_bridge.py."""

import json
import os
import subprocess
import sys

import pytest
from conftest import SIMULATED_PATH


def child(code: str, **env: str) -> dict:
    """Run `code` in a fresh Python with the simulator on PYTHONPATH (as if the bridge were installed)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PT_HPU", "FAKE_HPU", "HLS_MODULE_ID"))}
    base = {**base, "PYTHONPATH": SIMULATED_PATH, **env}
    result = subprocess.run([sys.executable, "-c", code], env=base, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


IMPORT_TORCH = (
    "import json, sys, torch; "
    "print(json.dumps({'loaded': 'habana_frameworks.torch' in sys.modules, "
    "'lazy': 'habana_frameworks.torch' in sys.modules "
    "and sys.modules['habana_frameworks.torch.utils.internal'].is_lazy()}))"
)


@pytest.mark.parametrize(
    "software, env, loaded, lazy",
    [
        ("1.19", {}, False, None),  # lazy default: no autoload
        ("1.19", {"PT_HPU_LAZY_MODE": "0"}, True, False),
        ("1.19", {"PT_HPU_AUTOLOAD": "1"}, True, True),
        ("1.21", {}, True, False),  # eager default: the bridge loads during `import torch`
        ("1.21", {"PT_HPU_LAZY_MODE": "1"}, False, None),
        ("1.21", {"PT_HPU_AUTOLOAD": "0"}, False, None),
        ("1.21", {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}, False, None),
    ],
)
def test_autoload_at_import_torch_follows_the_generation(software, env, loaded, lazy):
    result = child(IMPORT_TORCH, FAKE_HPU_SOFTWARE=software, **env)
    assert result["loaded"] is loaded
    if loaded:
        assert result["lazy"] is lazy

"""Issue 8's defects of the HPU path that need a fresh process, against the strict simulator (tests/fakes, a test
double): an autoloaded bridge gets one actionable line, and the launcher exports the config's op lists before
Python starts. The in-process ones: tests/unit/devices/test_hpu_strict_bridge.py."""

import json
import os
import subprocess
import sys

import pytest
from conftest import GAUDI_SOFTWARE, SIMULATED_PATH

from optimum_gaudi import GaudiConfig

BOTH = pytest.mark.parametrize("gaudi_software", GAUDI_SOFTWARE, indirect=True)


# ---- 1. autoload: op lists reach the bridge on every generation ----------------------------------------------

PROBE = """
import json, sys
import torch
autoloaded = "habana_frameworks.torch" in sys.modules
from transformers import HfArgumentParser
from optimum_gaudi import GaudiTrainingArguments
(args,) = HfArgumentParser(GaudiTrainingArguments).parse_args_into_dataclasses(sys.argv[1:])
import habana_frameworks as hf
lower, fp32 = hf.autocast_lists
print(json.dumps({"autoloaded": autoloaded, "device": args.gaudi_device.type, "lower": sorted(lower),
                  "fp32": sorted(fp32)}))
"""


def run_probe(tmp_path, launcher=(sys.executable,), **env):
    """The probe script run as a user runs a training script: `python probe.py ARGS`, or through a launcher."""
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PT_HPU", "FAKE_HPU", "WORLD_SIZE", "RANK"))}
    clean.update(PYTHONPATH=SIMULATED_PATH, OMP_NUM_THREADS="1", **env)
    flags = ["--output_dir", str(tmp_path / "out"), "--report_to", "none", "--use_habana"]
    command = [*launcher, str(script), *flags, "--gaudi_config_name", "gpt2"]
    return subprocess.run(command, env=clean, capture_output=True, text=True, timeout=180)


def expected_gpt2_lists():
    from optimum_gaudi.precision.op_lists import resolve_op_lists

    config = GaudiConfig.from_pretrained("gpt2")
    return resolve_op_lists(config.autocast_bf16_ops, config.autocast_fp32_ops)


def test_autoloaded_bridge_gets_one_actionable_line_not_an_error(tmp_path):
    result = run_probe(tmp_path, FAKE_HPU_SOFTWARE="1.21")
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["autoloaded"] and out["device"] == "hpu"
    lines = [line for line in result.stderr.splitlines() if "PT_HPU_AUTOCAST_LOWER_PRECISION_OPS_LIST=" in line]
    assert len(lines) == 1
    assert "PT_HPU_AUTOCAST_FP32_OPS_LIST=" in lines[0] and "optimum-gaudi launch" in lines[0]
    assert "PT_HPU_AUTOLOAD=0" in lines[0]


@BOTH
def test_launch_exports_the_config_op_lists_before_python_starts(tmp_path, gaudi_software):
    launcher = (sys.executable, "-m", "optimum_gaudi", "launch")
    result = run_probe(tmp_path, launcher, FAKE_HPU_SOFTWARE=gaudi_software)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    bf16, fp32 = expected_gpt2_lists()
    # no --use_lazy_mode: PT_HPU_LAZY_MODE is left unset, so 1.21+ loads the bridge (eager) at `import torch`;
    # 1.19 loads it when the arguments import it, after they set the mode (issue 20): the lists reach it either way
    assert out["autoloaded"] is (gaudi_software == "1.21")
    assert (out["lower"], out["fp32"]) == (sorted(bf16), sorted(fp32))
    warnings = [line for line in result.stderr.splitlines() if "loaded its autocast op lists" in line]
    assert not warnings  # the bridge got the config's lists

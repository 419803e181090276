"""Issue 20's defects of the HPU path that need a launched process, against the simulator (tests/fakes, a test
double): the script sets lazy mode in code under `optimum-gaudi launch` on Gaudi software 1.19, and the launcher
checks no op name and imports no torch. The in-process ones: tests/unit/devices/test_hpu_graphs_launch_and_op_names.py."""

from support import REPO

LAZY_IN_CODE = """
import json, sys
from optimum_gaudi import GaudiTrainingArguments
args = GaudiTrainingArguments(output_dir=sys.argv[1], use_habana=True, use_lazy_mode=True, report_to=[])
from habana_frameworks.torch.utils.internal import is_lazy
print(json.dumps({"device": args.gaudi_device.type, "lazy": is_lazy()}))
"""


def test_launch_lets_the_script_set_lazy_mode_in_code_on_gaudi_software_1_19(tmp_path):
    """1.18-1.20: the launcher exported PT_HPU_LAZY_MODE=0 without --use_lazy_mode on the command line, which
    also turns autoload on: the bridge loaded in eager mode at `import torch`, and the script's lazy mode failed."""
    import json
    import os
    import subprocess
    import sys

    from conftest import FAKES

    script = tmp_path / "lazy_in_code.py"
    script.write_text(LAZY_IN_CODE)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PT_HPU", "FAKE_HPU", "WORLD_SIZE", "RANK"))}
    repo = str(REPO)  # this checkout's optimum_gaudi, in the launched script too
    env.update(PYTHONPATH=os.pathsep.join([FAKES, repo]), OMP_NUM_THREADS="1", FAKE_HPU_SOFTWARE="1.19")
    command = [sys.executable, "-m", "optimum_gaudi", "launch", str(script), str(tmp_path / "out")]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {"device": "hpu", "lazy": True}


def test_the_launcher_checks_no_op_name_and_imports_no_torch(bridge):
    """The vocabulary comes from torch: the launcher, which exports a config's lists, must not import it (with
    Gaudi software 1.21+ that would load the bridge in the launcher)."""
    import os
    import subprocess
    import sys

    from conftest import FAKES

    code = (
        "import sys; from optimum_gaudi.launch.environment import launch_environment; "
        "assert launch_environment(['--gaudi_config_name', 'gpt2']); print('torch' in sys.modules)"
    )
    repo = str(REPO)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([FAKES, repo])}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "False"

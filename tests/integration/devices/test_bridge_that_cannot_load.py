"""A Habana bridge that is installed but cannot load (built for another torch, plugin library missing) falls
back to CPU/CUDA with one line, and stays out of the way of transformers and accelerate, which import it again
on their own (issue 20, defect 6). The simulator (tests/fakes, a test double) fails as the bridge's
``torch/__init__.py`` does: FAKE_HPU_PLUGIN_MISSING=1 (OSError), FAKE_HPU_STOCK_TORCH=untagged (AttributeError)."""

import os
import subprocess
import sys

import pytest
from conftest import SIMULATED_PATH
from support import TESTS

TRAIN = f"""
import sys
sys.path.insert(0, {str(TESTS)!r})
import tiny
from optimum_gaudi import GaudiTrainer, GaudiTrainingArguments
args = GaudiTrainingArguments(output_dir=sys.argv[1], use_habana=True, max_steps=2, report_to=[], save_steps=1,
                              per_device_train_batch_size=4)
trainer = GaudiTrainer(model=tiny.gpt2(), args=args, train_dataset=tiny.lm_data(16))
trainer.train()
print("device", args.gaudi_device.type, "steps", trainer.state.global_step)
"""


@pytest.mark.parametrize("software", ["1.19", "1.21"])
@pytest.mark.parametrize("failure", [{"FAKE_HPU_PLUGIN_MISSING": "1"}, {"FAKE_HPU_STOCK_TORCH": "untagged"}])
def test_a_bridge_that_cannot_load_is_one_line_and_training_runs_on_cpu(tmp_path, software, failure):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PT_HPU", "FAKE_HPU"))}
    # 1.21 would load the bridge during `import torch` and fail there, before any of our code: the documented
    # way to start Python past it is TORCH_DEVICE_BACKEND_AUTOLOAD=0
    env.update(PYTHONPATH=SIMULATED_PATH, FAKE_HPU_SOFTWARE=software, TORCH_DEVICE_BACKEND_AUTOLOAD="0", **failure)
    result = subprocess.run(
        [sys.executable, "-c", TRAIN, str(tmp_path)], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[-4:] == ["device", "cpu", "steps", "2"]
    assert "Traceback" not in result.stderr
    assert sum("habana_frameworks cannot load" in line for line in result.stderr.splitlines()) == 1
    assert (tmp_path / "checkpoint-2" / "rng_state.pth").is_file()  # transformers saved RNG state past the bridge

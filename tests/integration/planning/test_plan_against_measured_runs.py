"""The planner's per-rank memory against training runs measured on this CPU (issue 48: within 15%).

Each case trains 3 steps in fresh processes (benchmarks/plan_accuracy.py: a 7M-parameter Llama or a 5M GPT-2,
float32, bf16 autocast or bf16 weights, LoRA adapters on the frozen Llama, one thread) and compares the largest rank's peak resident set above its resident set
before the model was built with the plan's peak less its runtime reserve. `BENCH_SECTIONS=plan make bench` runs every setting,
FSDP and context parallelism included, and writes the table into docs/benchmarks.md. The arithmetic alone:
tests/unit/planning/test_plan_arithmetic.py."""

from __future__ import annotations

import sys

import pytest
from support import REPO

sys.path.insert(0, str(REPO))

from benchmarks import plan_accuracy  # noqa: E402

TOLERANCE = 0.15


@pytest.mark.parametrize(
    "name", ["llama_ckpt", "llama_fused", "gpt2", "llama_ddp2", "llama_bf16", "llama_bf16_weights", "llama_lora"]
)
def test_the_predicted_peak_is_within_15_percent_of_the_measured_one(name):
    shape, predicted = plan_accuracy.predict(name)
    measured = plan_accuracy.measure(name)
    counted = plan_accuracy.counted_parameters(name, shape)  # (all, trained): LoRA trains its adapters alone
    assert (measured["parameters"], measured["trained"]) == counted
    ratio = predicted.training / measured["training_peak"]
    assert abs(ratio - 1) <= TOLERANCE, (
        f"{name}: predicted {predicted.training / 1e6:.0f} MB, measured {measured['training_peak'] / 1e6:.0f} MB"
    )

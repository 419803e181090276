"""fast_ddp's marker taken off by the accelerator's ``unwrap_model`` before accelerate's own unwrapping
(distributed/fast_ddp.py); the trainings: tests/integration/distributed/test_fast_ddp.py."""

from __future__ import annotations

import types

from torch import nn

from optimum_gaudi.distributed.fast_ddp import FastDDPModel, unwrap_the_marker_too


def test_the_marker_comes_off_before_accelerates_unwrap_and_the_rest_is_passed_on():
    seen = []

    def accelerate_unwrap(model: nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True):
        seen.append((model, keep_torch_compile))
        return model

    accelerator = types.SimpleNamespace(unwrap_model=accelerate_unwrap)
    model = nn.Linear(2, 2)
    unwrap_the_marker_too(accelerator)
    assert accelerator.unwrap_model(FastDDPModel(model), keep_torch_compile=False) is model
    assert accelerator.unwrap_model(model) is model
    assert seen == [(model, False), (model, True)]
    unwrap_the_marker_too(accelerator)  # again on the same accelerator: the same result
    assert accelerator.unwrap_model(FastDDPModel(model)) is model

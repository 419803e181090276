"""TEST DOUBLE of ``intel_transformer_engine.distributed.activation_checkpointing``, as optimum-habana uses it
(``optimum/habana/accelerate/utils/transformer_engine.py``: ``te.distributed.activation_checkpointing()(function)``
wraps the function a checkpointed layer runs).

Modelled on NVIDIA Transformer Engine's activation-recompute phases (``transformer_engine/pytorch/distributed.py``,
``activation_recompute_forward``; ``module/base.py``, ``prepare_forward``): in the first forward of a checkpointed
function the fp8 modules keep the scales they quantized with; when the function runs again to recompute its
activations in the backward, they quantize with those same scales and leave the amax history alone, so the
recomputed activations are the first forward's. Here the phase is told apart by call order: a wrapped function is
called once for the forward and once for the recomputation.
"""

import contextlib
import functools

_phase: dict = {"recompute": None, "saved": None}  # read by te.Linear in an fp8 forward


class activation_checkpointing(contextlib.ContextDecorator):  # noqa: N801 (the real name)
    def __init__(self) -> None:
        self.calls = 0
        self.saved: dict = {}

    def __enter__(self):
        self.calls += 1
        self.outer = dict(_phase)
        _phase.update(recompute=self.calls > 1, saved=self.saved)
        return self

    def __exit__(self, *exc):
        _phase.update(self.outer)
        return False

    def __call__(self, function):
        @functools.wraps(function)
        def wrapped(*args, **kwargs):
            with self:
                return function(*args, **kwargs)

        return wrapped

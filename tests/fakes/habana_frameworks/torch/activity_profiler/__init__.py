"""TEST DOUBLE of ``habana_frameworks.torch.activity_profiler``.

Follows ``activity_profiler/activity_profiler.py``: importing the bridge replaces
``torch.profiler.ProfilerActivity`` with its own enum (CPU, CUDA, HPU) and ``torch.profiler.profile`` with a
subclass whose activities must be members of that new enum: CPU and CUDA become torch's original members,
anything else (an HPU member, or a member of the original enum bound before the import) becomes None.
torch of the bridge's release ignored None, so a profiler given only such values records nothing; torch
here refuses None, so the simulator drops them and writes an empty trace when no activity is left.
HPU activity, when asked for with the new enum, is recorded in the call log.
"""

import json
from enum import Enum

import torch

import habana_frameworks as _hf

_original_activity = torch.profiler.ProfilerActivity
_original_profile = torch.profiler.profile


class HabanaProfilerActivity(Enum):
    CPU = 1
    CUDA = 2
    HPU = 3


class habana_profile(_original_profile):  # noqa: N801  (the bridge's name)
    def __init__(
        self,
        *,
        activities=None,
        debug_activities=None,
        schedule=None,
        on_trace_ready=None,
        record_shapes=False,
        profile_memory=False,
        with_stack=False,
        with_flops=False,
        with_modules=False,
        experimental_config=None,
        use_cuda=None,
    ):  # activity_profiler.py's fixed keyword-only signature: any other of torch's arguments is a TypeError
        kwargs = dict(
            schedule=schedule, on_trace_ready=on_trace_ready, record_shapes=record_shapes,
            profile_memory=profile_memory, with_stack=with_stack, with_flops=with_flops, with_modules=with_modules,
            experimental_config=experimental_config,
        )  # fmt: skip
        if use_cuda is not None:
            kwargs["use_cuda"] = use_cuda
        current = torch.profiler.ProfilerActivity
        activities = (current.CPU, current.HPU) if activities is None else list(activities)
        self.hpu_profiling_active = current.HPU in activities
        mapped = [self._exchange_activity(a) for a in activities]
        kept = [a for a in mapped if a is not None]
        self.records_nothing = not kept
        _hf.record("activity_profiler.profile", activities=[str(a) for a in activities], kept=[str(a) for a in kept])
        super().__init__(activities=kept or [_original_activity.CPU], **kwargs)

    @staticmethod
    def _exchange_activity(activity):
        current = torch.profiler.ProfilerActivity
        if activity == current.CPU:
            return _original_activity.CPU
        if activity == current.CUDA:
            return _original_activity.CUDA
        return None

    def start_trace(self):
        if self.hpu_profiling_active:
            _hf.record("activity_profiler.start_hpu")
        super().start_trace()

    def export_chrome_trace(self, path):
        if not self.records_nothing:
            return super().export_chrome_trace(path)
        with open(path, "w") as f:
            json.dump({"traceEvents": []}, f)


def _restore():
    torch.profiler.ProfilerActivity = _original_activity
    torch.profiler.profile = _original_profile


torch.profiler.ProfilerActivity = HabanaProfilerActivity
torch.profiler.profile = habana_profile
_hf.on_unload(_restore)

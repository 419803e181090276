"""HPU Graphs' CUDA counterpart, tested on CPU as far as it goes: no GPU here or in CI.

torch.compile's reduce-overhead mode records CUDA graphs only for CUDA tensors; on CPU tensors it runs the
same compiled code without a graph, so the wrapping, the per-call iteration marker and the numerics are
checked here, and the graph capture itself only on a machine with a GPU.
"""

import inspect

import pytest
import torch
import torch._dynamo
from torch import nn

from optimum_gaudi.devices import CPUDevice, CUDADevice
from optimum_gaudi.devices.cuda import CUDA_GRAPH_COMPILE


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, input_ids, labels=None):
        return self.proj(input_ids).pow(2).mean()


@pytest.fixture
def compile_calls(monkeypatch):
    """Records torch.compile's arguments and still compiles (with the cheap eager backend)."""
    calls, real = [], torch.compile

    def recording(fn, **kwargs):
        calls.append(kwargs)
        return real(fn, backend="eager")

    monkeypatch.setattr(torch, "compile", recording)
    torch._dynamo.reset()
    yield calls
    torch._dynamo.reset()


@pytest.mark.parametrize("wrap", ["training", "inference"])
def test_graph_flags_compile_in_reduce_overhead_mode_once(compile_calls, wrap):
    device, model = CUDADevice(), Tiny()
    for _ in range(2):  # a second train()/evaluate() must not compile again
        if wrap == "training":
            wrapped = device.wrap_for_training(model, max_graphs=None)
        else:
            wrapped = device.wrap_for_inference(model, disable_tensor_cache=False)
    assert wrapped is model  # in place, like ModuleCacher(inplace=True): the trainer keeps its model
    assert compile_calls == [CUDA_GRAPH_COMPILE] and CUDA_GRAPH_COMPILE["mode"] == "reduce-overhead"
    assert list(inspect.signature(model.forward).parameters) == ["input_ids", "labels"]  # Trainer reads it
    del model.forward  # what the trainer does to unwrap: the next wrap compiles again
    device.wrap_for_inference(model, disable_tensor_cache=False)
    assert len(compile_calls) == 2


def test_each_call_starts_a_new_graph_iteration_outside_the_compiled_code(compile_calls, monkeypatch):
    marks = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    model = CUDADevice().wrap_for_training(Tiny(), max_graphs=None)
    x = torch.randn(2, 4)
    for _ in range(3):
        model(x).backward()
    assert len(marks) == 3


def test_outputs_kept_across_evaluation_batches_survive_the_next_replay(monkeypatch):
    """A CUDA graph writes its outputs into the same memory at every replay; evaluation keeps each batch's
    logits while the next batch runs. Modelled here by a compiled function with one static output buffer."""
    static = torch.zeros(2, 3)

    def replay_into_static_memory(fn, **kwargs):
        def replay(input_ids, labels=None):
            static.copy_(input_ids)
            return {"logits": static}

        return replay

    monkeypatch.setattr(torch, "compile", replay_into_static_memory)
    model = CUDADevice().wrap_for_inference(Tiny(), disable_tensor_cache=False)
    with torch.no_grad():
        first = model(torch.full((2, 3), 1.0))["logits"]
        model(torch.full((2, 3), 2.0))
    assert torch.equal(first, torch.full((2, 3), 1.0))
    assert model(torch.full((2, 3), 3.0))["logits"] is static  # with gradients: no copy, backward needs none


def test_reduce_overhead_compile_matches_eager_on_cpu():
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager, x = Tiny(), torch.randn(3, 4)
    graphed = CUDADevice().wrap_for_training(Tiny(), None)
    graphed.load_state_dict(eager.state_dict())
    for model in (eager, graphed):
        model(x).backward()
    torch.testing.assert_close(graphed(x), eager(x))
    torch.testing.assert_close(graphed.proj.weight.grad, eager.proj.weight.grad)
    torch._dynamo.reset()


def test_feature_table_gives_the_flags_their_cuda_meaning():
    for flag in ("use_hpu_graphs_for_training", "use_hpu_graphs_for_inference"):
        assert "CUDA graphs" in CUDADevice.behaviour[flag]
        assert CPUDevice.behaviour[flag].startswith("no-op")
    model = Tiny()
    assert CPUDevice().wrap_for_training(model, None) is model and "forward" not in model.__dict__

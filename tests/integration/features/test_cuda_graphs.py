"""HPU Graphs' CUDA counterpart, tested on CPU as far as it goes: no GPU here or in CI.

Training: torch.compile's reduce-overhead mode records CUDA graphs only for CUDA tensors; on CPU tensors it
runs the same compiled code without a graph, so the wrapping, the per-call iteration marker and the numerics
are checked here. Inference: each input signature is captured once (Device.capture_graph) and replayed; the
capture is modelled here by the CPU's re-execution with static tensors. The graph capture itself is checked
only on a machine with a GPU (tests/scripts/device_check.sh).
"""

import inspect
import logging

import pytest
import torch
import torch._dynamo
from torch import nn

from optimum_gaudi.devices import CPUDevice, CUDADevice, Device
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


def test_the_training_graph_flag_compiles_in_reduce_overhead_mode_once(compile_calls):
    device, model = CUDADevice(), Tiny()
    for _ in range(2):  # a second train() must not compile again
        wrapped = device.wrap_for_training(model, max_graphs=None)
    assert wrapped is model  # in place, like ModuleCacher(inplace=True): the trainer keeps its model
    assert compile_calls == [CUDA_GRAPH_COMPILE] and CUDA_GRAPH_COMPILE["mode"] == "reduce-overhead"
    assert list(inspect.signature(model.forward).parameters) == ["input_ids", "labels"]  # Trainer reads it
    del model.forward  # what the trainer does to unwrap: the next wrap compiles again
    device.wrap_for_training(model, max_graphs=None)
    assert len(compile_calls) == 2


def test_each_call_starts_a_new_graph_iteration_outside_the_compiled_code(compile_calls, monkeypatch):
    marks = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    model = CUDADevice().wrap_for_training(Tiny(), max_graphs=None)
    x = torch.randn(2, 4)
    for _ in range(3):
        model(x).backward()
    assert len(marks) == 3


@pytest.fixture
def captures(monkeypatch):
    """CUDADevice.capture_graph modelled by the CPU's (replay re-runs the function into the same output
    tensors), recording the shapes of each capture's inputs. Autocast's weight cache must be off while a graph
    records: the graph would read casts that the end of the autocast region frees."""
    shapes = []

    def capture(self, fn, static_inputs):
        assert not torch.is_autocast_cache_enabled()
        shapes.append([tuple(t.shape) for t in static_inputs])
        return Device.capture_graph(self, fn, static_inputs)

    monkeypatch.setattr(CUDADevice, "capture_graph", capture)
    return shapes


def test_inference_graphs_capture_each_shape_once_without_compiling(captures, compile_calls):
    device, model, eager = CUDADevice(), Tiny(), Tiny()
    eager.load_state_dict(model.state_dict())
    for _ in range(2):  # a second evaluate() wraps again: the same graphs serve it
        wrapped = device.wrap_for_inference(model, disable_tensor_cache=False)
    assert wrapped is model and compile_calls == []  # in place, and nothing compiles
    assert list(inspect.signature(model.forward).parameters) == ["input_ids", "labels"]  # Trainer reads it
    with torch.no_grad():
        for x in [torch.randn(8, 4), torch.randn(8, 4), torch.randn(3, 4), torch.randn(8, 4), torch.randn(3, 4)]:
            torch.testing.assert_close(model(x), eager(x))
    assert captures == [[(8, 4)], [(3, 4)]]  # one capture per shape, replayed for the others
    assert torch.is_autocast_cache_enabled()  # back on after each capture
    model(torch.randn(8, 4)).backward()  # with gradients (training): the plain forward, no capture
    assert len(captures) == 2 and model.proj.weight.grad is not None


def test_outputs_kept_across_evaluation_batches_survive_the_next_replay(captures):
    """A CUDA graph writes its outputs into the same memory at every replay; evaluation keeps each batch's
    logits (and its inputs, for compute_metrics) while the next batch runs."""
    model = CUDADevice().wrap_for_inference(Tiny(), disable_tensor_cache=False)
    with torch.no_grad():
        x = torch.randn(2, 4)
        first = model(x)
        expected, kept_input = first.clone(), x.clone()
        model(torch.randn(2, 4))
    assert torch.equal(first, expected) and torch.equal(x, kept_input)


def test_a_forward_that_cannot_be_captured_runs_without_graphs_said_once(monkeypatch, caplog):
    def capture(self, fn, static_inputs):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore")

    monkeypatch.setattr(CUDADevice, "capture_graph", capture)
    model, eager = Tiny(), Tiny()
    eager.load_state_dict(model.state_dict())
    CUDADevice().wrap_for_inference(model, disable_tensor_cache=False)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="optimum_gaudi"):
        for _ in range(3):
            x = torch.randn(2, 4)
            torch.testing.assert_close(model(x), eager(x))
    assert [r.getMessage() for r in caplog.records] == [
        "--use_hpu_graphs_for_inference: CUDA graphs cannot capture this model's forward (CUDA error: operation "
        "not permitted when stream is capturing); it runs without them."
    ]


def test_inference_graphs_stop_capturing_at_max_graphs(captures):
    model = CUDADevice().wrap_for_inference(Tiny(), disable_tensor_cache=False, max_graphs=1)
    with torch.no_grad():
        for rows in (2, 3, 2, 3):
            model(torch.randn(rows, 4))
    assert captures == [[(2, 4)]]


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

import pytest
import torch

from optimum_gaudi.devices import CPUDevice
from optimum_gaudi.features import graphs


def test_capture_then_replay_refreshes_static_outputs_on_cpu():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    static_in = torch.randn(2, 4)
    graph = graphs.Graph(CPUDevice())
    with torch.no_grad():
        static_out = graph.capture(model, static_in)
        first = static_out.clone()
        new = torch.randn(2, 4)
        static_in.copy_(new)
        assert graph.replay() is static_out
        assert torch.allclose(static_out, model(new)) and not torch.allclose(static_out, first)


def test_replay_before_capture_is_a_clear_error():
    with pytest.raises(RuntimeError, match="capture the region first"):
        graphs.Graph(CPUDevice()).replay()


def test_module_wrappers_are_identity_on_cpu():
    model = torch.nn.Linear(2, 2)
    assert graphs.cache_module(model, max_graphs=4, device=CPUDevice()) is model
    assert graphs.wrap_in_graph(model, device=CPUDevice()) is model
    fn = graphs.make_graphed_callables(model, (torch.randn(1, 2),), device=CPUDevice())
    assert fn is model


def test_capture_on_the_simulated_bridge_uses_hpu_graphs(bridge, monkeypatch):
    monkeypatch.setenv("PT_HPU_LAZY_MODE", "1")  # the bridge exports its graph API in lazy mode only
    from optimum_gaudi.devices import HPUDevice

    graph = graphs.Graph(HPUDevice())
    graph.capture(torch.nn.Linear(2, 2), torch.randn(1, 2))
    graph.replay()
    graphs.make_graphed_callables(torch.nn.Linear(2, 2), (torch.randn(1, 2),), device=HPUDevice())
    names = bridge().names()
    for expected in ("hpu.HPUGraph", "hpu.HPUGraph.capture_begin", "hpu.HPUGraph.replay", "hpu.make_graphed_callables"):
        assert expected in names


def test_a_captured_training_step_replays_on_cpu():
    def training_step(seed):
        torch.manual_seed(seed)
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def step(x, y):
            opt.zero_grad(set_to_none=False)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            return loss

        return model, step

    x, y = torch.randn(8, 4), torch.randn(8, 1)
    eager_model, eager_step = training_step(0)
    eager = [eager_step(x, y).item() for _ in range(4)]
    model, step = training_step(0)
    graph = graphs.Graph(CPUDevice())
    static_loss = graph.capture(step, x, y)
    replayed = [static_loss.item()] + [graph.replay().item() for _ in range(3)]
    assert replayed == pytest.approx(eager)
    assert torch.equal(model.weight, eager_model.weight)

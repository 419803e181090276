"""The simulated bridge (tests/fakes, a test double) behaves as the real bridge's source says it does.

Each test names the behaviour of HabanaAI/gaudi-pytorch-bridge it checks; the simulator's modules cite
the bridge file they follow. These tests keep the simulator honest, so tests of the HPU path mean something.

The autoload at `import torch`, in fresh processes: tests/integration/simulator/test_simulated_bridge_autoload.py."""

import json
import os
from pathlib import Path

import pytest
import torch
from conftest import FAKES, GAUDI_SOFTWARE

BOTH = pytest.mark.parametrize("gaudi_software", GAUDI_SOFTWARE, indirect=True)


@BOTH
def test_is_lazy_is_decided_once_with_the_generation_default(bridge, gaudi_software, monkeypatch):
    from habana_frameworks.torch.utils.internal import is_lazy

    assert is_lazy() is (gaudi_software == "1.19")
    monkeypatch.setenv("PT_HPU_LAZY_MODE", "0" if is_lazy() else "1")
    assert is_lazy() is (gaudi_software == "1.19")  # cached: the variable no longer matters


def test_eager_mode_mark_step_is_a_no_op_and_graphs_are_not_exported(bridge, monkeypatch):
    import habana_frameworks.torch as ht

    monkeypatch.setenv("PT_HPU_LAZY_MODE", "1")  # too late: the bridge loaded in eager mode
    ht.core.mark_step()
    assert "core.mark_step" not in bridge().names() and "core.mark_step.noop" in bridge().names()
    for name in ("HPUGraph", "graph", "make_graphed_callables", "ModuleCacher", "wrap_in_hpu_graph"):
        assert not hasattr(ht.hpu, name)


def lazy_bridge(monkeypatch):
    monkeypatch.setenv("PT_HPU_LAZY_MODE", "1")
    import habana_frameworks.torch as ht

    return ht


def test_wrap_in_hpu_graph_replays_static_outputs_without_gradient(bridge, monkeypatch):
    ht = lazy_bridge(monkeypatch)
    torch.manual_seed(0)
    model = ht.hpu.wrap_in_hpu_graph(torch.nn.Linear(3, 2))
    first_in, second_in = torch.randn(4, 3), torch.randn(4, 3)
    captured = model(first_in)
    assert captured.requires_grad  # the capture call is a plain forward
    replayed = model(second_in)
    assert not replayed.requires_grad and replayed.grad_fn is None
    assert torch.equal(first_in, second_in)  # the capture's input tensor received the new input
    again = model(torch.randn(4, 3))
    assert again is replayed  # the same static output tensor, refreshed in place
    forward = "hpu.wrap_in_hpu_graph.forward"
    assert len(bridge().calls_named(forward, mode="capture")) == 1
    assert len(bridge().calls_named(forward, mode="replay")) == 2


class TwoInputs(torch.nn.Module):
    def forward(self, a, b):
        a = sum(a) if isinstance(a, (list, tuple)) else a
        return a.float() * 2 + b.float()


def test_wrap_in_hpu_graph_keys_shapes_not_dtypes_and_checks_replayed_inputs(bridge, monkeypatch):
    """input_hash leaves dtypes out, so a new dtype of the same shape replays the old graph, and hashes a
    list as a tuple; copy_to asserts that a replay's inputs have the capture's types (hpu/graphs.py)."""
    ht = lazy_bridge(monkeypatch)
    model = ht.hpu.wrap_in_hpu_graph(TwoInputs())
    with torch.no_grad():
        model(a=[torch.ones(2)], b=torch.ones(2))
        model(a=torch.ones(2, dtype=torch.int64), b=torch.ones(2))
        out = model(a=torch.full((2,), 1.5, dtype=torch.float64), b=torch.ones(2))  # the same graph replays
        torch.testing.assert_close(out, torch.full((2,), 3.0))  # the int64 static input truncated 1.5 to 1
        forward = "hpu.wrap_in_hpu_graph.forward"
        assert [c.kwargs["mode"] for c in bridge().calls_named(forward)] == ["capture", "capture", "replay"]
        with pytest.raises(AssertionError):
            model(a=(torch.ones(2),), b=torch.ones(2))  # hashed as [tensor] was, but of another type
        view = torch.ones(4)[::2]  # a view: another graph, as its view hash differs
        model(a=view, b=torch.ones(2))
        assert [c.kwargs["mode"] for c in bridge().calls_named(forward)][-1] == "capture"


def test_make_graphed_callables_takes_tuples_and_replays_the_sample_shapes(bridge, monkeypatch):
    ht = lazy_bridge(monkeypatch)
    with pytest.raises(TypeError):
        ht.hpu.make_graphed_callables(torch.nn.Linear(3, 2), [torch.randn(4, 3)])  # a list: list + tuple fails
    graphed = ht.hpu.make_graphed_callables(torch.nn.Linear(3, 2), (torch.randn(4, 3),))
    assert graphed(torch.randn(4, 3)).shape == (4, 2)
    with pytest.raises(RuntimeError):
        graphed(torch.randn(5, 3))  # copied into the static input of the sample's shape


def test_memory_api_refuses_other_device_types(bridge, monkeypatch):
    ht = lazy_bridge(monkeypatch)
    assert ht.hpu.memory_stats("hpu")["Limit"] == ht.hpu.memory_stats(0)["Limit"] > 0
    with pytest.raises(ValueError, match="Expected a hpu device, but got: cpu"):
        ht.hpu.memory_stats("cpu")


def test_wrap_in_hpu_graph_bounds_graphs_only_when_asked(bridge, monkeypatch):
    ht = lazy_bridge(monkeypatch)
    unbounded = ht.hpu.wrap_in_hpu_graph(torch.nn.Linear(3, 2))
    bounded = ht.hpu.wrap_in_hpu_graph(torch.nn.Linear(3, 2), max_graphs=2)
    with torch.no_grad():
        for rows in range(1, 6):
            unbounded(torch.randn(rows, 3))
            bounded(torch.randn(rows, 3))
    captures = bridge().calls_named("hpu.wrap_in_hpu_graph.forward", mode="capture")
    assert [c.kwargs["graphs"] for c in captures] == [1, 1, 2, 2, 3, 4, 5]
    assert len(bridge().calls_named("hpu.wrap_in_hpu_graph.forward", mode="uncached")) == 3


def test_module_cacher_defaults_and_refuses_star_args(bridge, monkeypatch):
    ht = lazy_bridge(monkeypatch)
    assert ht.hpu.ModuleCacher().max_graphs == 10

    class StarArgs(torch.nn.Module):
        def forward(self, *args, **kwargs):
            return args

    with pytest.raises(AssertionError, match="Unsupported argument type"):
        ht.hpu.ModuleCacher()(model=StarArgs(), inplace=True)


def test_module_cacher_caches_at_most_max_graphs_training_shapes(bridge, monkeypatch):
    ht = lazy_bridge(monkeypatch)
    model = ht.hpu.ModuleCacher(max_graphs=2)(model=torch.nn.Linear(3, 2), inplace=True)
    for rows in (1, 2, 3, 1):
        model(torch.randn(rows, 3)).sum().backward()  # gradients flow through cached forwards
    with torch.no_grad():
        model(torch.randn(1, 3))
    cached = [c.kwargs["cached"] for c in bridge().calls_named("hpu.ModuleCacher.forward")]
    assert cached == [True, True, False, True, False]
    assert model.weight.grad is not None


def test_module_cacher_forward_fails_rebound_to_the_model(bridge, monkeypatch):
    """ModuleCacher patches ``model.forward`` with its own bound method, whose body starts with
    ``self.iteration_cnt += 1`` (hpu/graphs.py): rebound to the model, as accelerate's mixed precision rebinds
    ``model.forward.__func__``, it fails."""
    import types

    ht = lazy_bridge(monkeypatch)
    model = ht.hpu.ModuleCacher()(model=torch.nn.Linear(3, 2), inplace=True)
    assert model.forward.__self__ is not model
    model.forward = types.MethodType(model.forward.__func__, model)
    with pytest.raises(AttributeError, match="iteration_cnt"):
        model(torch.randn(1, 3))


def test_graph_keys_hold_the_hpu_autocast_state(bridge, monkeypatch):
    """input_hash hashes ``torch.hpu.is_autocast_hpu_enabled()`` with each input (hpu/graphs.py)."""
    ht = lazy_bridge(monkeypatch)
    model = ht.hpu.wrap_in_hpu_graph(torch.nn.Linear(3, 2))
    with torch.no_grad():
        model(torch.randn(1, 3))
        with torch.autocast("hpu", dtype=torch.bfloat16):
            model(torch.randn(1, 3))
    modes = [c.kwargs["mode"] for c in bridge().calls_named("hpu.wrap_in_hpu_graph.forward")]
    assert modes == ["capture", "capture"]


def test_module_cacher_capture_fails_on_an_unused_parameter_unless_allowed(bridge, monkeypatch):
    ht = lazy_bridge(monkeypatch)
    for allowed in (False, True):
        model = torch.nn.Linear(3, 2)
        model.unused = torch.nn.Parameter(torch.zeros(2))
        model = ht.hpu.ModuleCacher()(model=model, inplace=True, allow_unused_input=allowed)
        if not allowed:
            with pytest.raises(RuntimeError, match="not have been used in the graph"):
                model(torch.randn(1, 3))
            continue
        model(torch.randn(1, 3)).sum().backward()
        assert model.weight.grad is not None


@BOTH
def test_profiler_enum_is_replaced_and_foreign_values_record_nothing(bridge, tmp_path):
    original = torch.profiler.ProfilerActivity
    import habana_frameworks.torch  # noqa: F401

    assert torch.profiler.ProfilerActivity is not original
    for activities, expect_events in (([original.CPU], False), ([torch.profiler.ProfilerActivity.CPU], True)):
        with torch.profiler.profile(activities=activities) as prof:
            torch.ones(4).add(1)
        path = tmp_path / "trace.json"
        prof.export_chrome_trace(str(path))
        assert bool(json.loads(path.read_text())["traceEvents"]) is expect_events


def test_unloading_restores_the_profiler_enum(bridge):
    original = torch.profiler.ProfilerActivity
    import habana_frameworks.torch  # noqa: F401

    bridge().unload()
    assert torch.profiler.ProfilerActivity is original


def test_hccl_import_sets_the_distributed_environment(bridge, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "HABANA_VISIBLE_MODULES"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "3")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "1")
    import habana_frameworks.torch.distributed.hccl  # noqa: F401

    env = os.environ
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == ("3", "4", "1")
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("localhost", "12345")
    assert env["HLS_MODULE_ID"] == "1" and env["ID"] == "3"


def test_hccl_import_disallows_collectives_in_dynamo_graphs_until_unloaded(bridge):
    """``distributed/hccl/__init__.py`` ``_disallow_collectives_in_graph``: every torch.distributed function named
    after a collective, with dynamo's own helper; the simulator takes it back when it unloads."""
    import torch.distributed as dist
    from torch._dynamo import trace_rules

    collectives = (dist.all_reduce, dist.all_gather_into_tensor, dist.reduce_scatter_tensor, dist.broadcast)
    import habana_frameworks.torch.distributed.hccl  # noqa: F401

    assert all(id(f) in trace_rules._disallowed_callable_ids for f in collectives)
    assert id(dist.init_process_group) not in trace_rules._disallowed_callable_ids
    bridge().unload()
    assert not any(id(f) in trace_rules._disallowed_callable_ids for f in collectives)


def test_group_functions_are_the_bridges_until_unloaded(bridge, monkeypatch, tmp_path):
    """``core/torch_overwrites.py``: importing the bridge replaces ``torch.distributed.init_process_group`` (backend
    required, nothing after ``pg_options``) and ``new_group`` (four parameters, a missing timeout is torch's 30
    minutes); PT_ENABLE_COMM_GROUP_CACHE=0 leaves the cache out. The simulator takes them back when it unloads."""
    import torch.distributed as dist

    original = (dist.new_group, dist.init_process_group)
    import habana_frameworks.torch  # noqa: F401

    with pytest.raises(TypeError, match="backend"):
        dist.init_process_group()
    monkeypatch.setenv("PT_ENABLE_COMM_GROUP_CACHE", "0")
    dist.init_process_group("hccl", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        dist.new_group([0])
        with pytest.raises(TypeError, match="use_local_synchronization"):
            dist.new_group([0], use_local_synchronization=True)
    finally:
        dist.destroy_process_group()
    made = bridge().calls_named("core.new_group")
    assert [c.kwargs for c in made] == [{"ranks": [0], "backend": None, "timeout": 1800.0, "cached": None}]
    assert bridge().calls_named("core.init_process_group")[-1].kwargs == {"backend": "hccl", "timeout": 1800.0}
    bridge().unload()
    assert (dist.new_group, dist.init_process_group) == original


def test_hccl_groups_drop_the_timeout_they_are_given(bridge, tmp_path):
    """``distributed/hccl/__init__.py`` ``_create_process_group_hccl``: the group is made without the options'
    timeout (``ProcessGroupHCCL`` takes none); off the simulated device, the gloo alias never times out either.
    torch counts no collectives of it (a custom backend)."""
    from datetime import timedelta

    import habana_frameworks.torch.distributed.hccl  # noqa: F401
    import torch.distributed as dist

    dist.init_process_group("hccl", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1,
                            timeout=timedelta(seconds=5))  # fmt: skip
    try:
        timeout = dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout
        assert timeout > timedelta(days=300), timeout
        with pytest.raises(RuntimeError, match="does not yet support sequence numbers"):
            dist.group.WORLD._get_sequence_number_for_group()
    finally:
        dist.destroy_process_group()


def test_set_device_keeps_the_process_on_its_module(bridge, monkeypatch):
    """``hpu/__init__.py``: a process has one Gaudi; ``set_device`` checks the index and remaps it to the module the
    process opened (HLS_MODULE_ID, a position in HABANA_VISIBLE_MODULES), or exports it; without either, on a
    machine of fewer than 8 Gaudis, only index 0 is allowed. The current device stays 0."""
    for name in ("HLS_MODULE_ID", "HABANA_VISIBLE_MODULES"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("FAKE_HPU_DEVICE_COUNT", "2")
    import habana_frameworks.torch.hpu as hpu

    hpu.set_device(0)
    with pytest.raises(
        AssertionError, match="As HABANA_VISIBLE_MODULES is not provided, the only supported device idx is 0"
    ):
        hpu.set_device(1)
    monkeypatch.setenv("HABANA_VISIBLE_MODULES", "4,5")
    monkeypatch.setenv("HLS_MODULE_ID", "5")
    hpu.set_device(0)
    assert (os.environ["HLS_MODULE_ID"], hpu.set_device.current_device_idx, hpu.current_device()) == ("5", 1, 0)
    with pytest.raises(AssertionError, match=r"Trying to open device with idx=9 when only \[4, 5\] are avaliable"):
        hpu.set_device(9)


def test_torch_manual_seed_seeds_the_hpu_generator_until_unloaded(bridge):
    """``core/torch_overwrites.py``: the bridge's ``torch.manual_seed`` seeds the HPU generator as well."""
    original = torch.manual_seed
    import habana_frameworks.torch.hpu.random as hpu_random

    torch.manual_seed(5)
    first = hpu_random.draw()
    torch.manual_seed(5)
    assert hpu_random.draw() == first and bridge().calls_named("hpu.random.manual_seed")[-1].args == (5,)
    bridge().unload()
    assert torch.manual_seed is original


def test_rng_state_is_device_0s_only(bridge):
    """``hpu/random.py``: get/set_rng_state take the generator of device 0 only; no index names the current
    device (0), anything else is a RuntimeError, another device type a ValueError (``hpu/_utils.py``)."""
    import habana_frameworks.torch.hpu as hpu

    state = hpu.get_rng_state()
    hpu.set_rng_state(state, "hpu:0")
    assert torch.equal(hpu.get_rng_state(torch.device("hpu")), state)
    for device in (1, "hpu:1", torch.device("hpu", 2)):
        with pytest.raises(RuntimeError, match="^hpu get_rng_state supports only device 0$"):
            hpu.get_rng_state(device)
        with pytest.raises(RuntimeError, match="^hpu set_rng_state supports only device 0$"):
            hpu.set_rng_state(state, device)
    with pytest.raises(ValueError, match="Expected a hpu device, but got: cpu"):
        hpu.get_rng_state("cpu")


def test_torch_version_mismatch_is_an_assertion_at_import(bridge, monkeypatch):
    monkeypatch.setenv("FAKE_HPU_BUILT_FOR_TORCH", "2.5")
    with pytest.raises(AssertionError, match="differs from run-time"):
        import habana_frameworks.torch  # noqa: F401


@pytest.mark.parametrize(
    ("variable", "value", "error"),
    [("FAKE_HPU_STOCK_TORCH", "untagged", AttributeError), ("FAKE_HPU_PLUGIN_MISSING", "1", OSError)],
)
def test_an_untagged_torch_or_a_missing_plugin_fails_the_import(bridge, monkeypatch, variable, value, error):
    monkeypatch.setenv(variable, value)
    with pytest.raises(error):
        import habana_frameworks.torch  # noqa: F401


def test_fused_clip_norm_returns_a_shape_one_norm_in_the_parameters_dtype(bridge):
    from habana_frameworks.torch.hpex.normalization import FusedClipNorm

    params = [torch.nn.Parameter(torch.randn(5, dtype=torch.bfloat16)) for _ in range(2)]
    for p in params:
        p.grad = torch.full((5,), 4.0, dtype=torch.bfloat16)
    norm = FusedClipNorm(params, 1.0).clip_norm(params)
    assert norm.shape == (1,) and norm.dtype == torch.bfloat16
    assert float(norm) == pytest.approx(float(torch.full((10,), 4.0).norm()), rel=1e-2)


def test_dynamic_shapes_switch(bridge):
    import habana_frameworks.torch.hpu as hthpu

    hthpu.enable_dynamic_shape()
    assert hthpu.get_dynamic_shape_status()
    hthpu.disable_dynamic_shape()
    assert not hthpu.get_dynamic_shape_status()


def test_default_autocast_lists_are_read_once_at_load(bridge, monkeypatch, tmp_path):
    import habana_frameworks.torch  # noqa: F401

    first = dict(bridge().env_at_import)
    monkeypatch.setenv("PT_HPU_AUTOCAST_LOWER_PRECISION_OPS_LIST", str(tmp_path / "later.txt"))
    assert bridge().env_at_import == first  # what the bridge uses was fixed when it loaded


def test_hpu_backend_is_a_torch_compile_backend(bridge):
    import habana_frameworks.torch  # noqa: F401

    compiled = torch.compile(lambda x: (x * 2).sin(), backend="hpu_backend")
    assert torch.allclose(compiled(torch.ones(3)), torch.ones(3).mul(2).sin())
    assert "dynamo.hpu_backend" in bridge().names()


def test_fakes_readme_names_every_simulated_module():
    readme = (Path(FAKES) / "README.md").read_text()
    for module in ("autoload", "utils.internal", "activity_profiler", "dynamo", "distributed.hccl", "hpu.graphs"):
        assert module in readme, module


def test_autocast_lists_come_from_the_files_or_the_defaults(bridge, monkeypatch, tmp_path):
    bf16 = tmp_path / "bf16.txt"
    bf16.write_text("linear\nmatmul\n")
    monkeypatch.setenv("PT_HPU_AUTOCAST_LOWER_PRECISION_OPS_LIST", str(bf16))
    import habana_frameworks.torch  # noqa: F401

    lower, fp32 = bridge().autocast_lists
    assert lower == {"linear", "matmul"}
    assert "cross_entropy_loss" in fp32 and "nll_loss" in fp32  # fp32 list not set: Habana's default


# ---- hpex/kernels/FusedSDPA.py, hpex/normalization/FusedRMSNorm.py, hpex/kernels/RotaryPosEmbeddingHelper.py ----


def test_fused_sdpa_asserts_as_the_bridge_wrapper_does(bridge):
    from habana_frameworks.torch.hpex.kernels import FusedSDPA

    q = torch.randn(1, 4, 6, 8, requires_grad=True)
    k, v = torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)  # grouped heads, not repeated
    mask = torch.ones(1, 1, 6, 6, dtype=torch.bool)
    with pytest.raises(AssertionError, match="fast softmax"):
        FusedSDPA.apply(q, k, v, mask, 0.0, False, None, "FAST", True)  # training, recompute, not causal
    with pytest.raises(AssertionError, match="valid_seq_len"):
        FusedSDPA.apply(q, k, v, None, 0.0, True, None, "None", None, torch.tensor([6]))  # needs inference
    with pytest.raises(NotImplementedError):
        FusedSDPA.apply(q, k, v, mask, 0.0, True)  # a mask and the causal mode together
    with pytest.raises(TypeError):
        FusedSDPA.apply(q, k, v, attn_mask=mask)  # an autograd Function's apply takes arguments by position
    out = FusedSDPA.apply(q, k, v, None, 0.0, True, None, "fast", True)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, expected)
    call = bridge().calls_named("hpex.kernels.FusedSDPA")[-1].kwargs
    assert (call["q_heads"], call["kv_heads"], call["softmax_mode"], call["recompute"]) == (4, 2, "fast", True)


def test_fused_rms_norm_returns_float32_when_input_and_weight_dtypes_differ(bridge):
    from habana_frameworks.torch.hpex.normalization import FusedRMSNorm

    x, w = torch.randn(2, 8, dtype=torch.bfloat16), torch.ones(8)
    assert FusedRMSNorm.apply(x, w, 1e-6).dtype == torch.float32
    assert FusedRMSNorm.apply(x, w.bfloat16(), 1e-6).dtype == torch.bfloat16


def test_rotary_helpers_rotate_half_blockwise_and_gather_a_table(bridge):
    from habana_frameworks.torch.hpex.kernels import RotaryPosEmbeddingHelperV1, RotaryPosEmbeddingHelperV2

    p = torch.randn(1, 2, 4, 8)
    table_cos, table_sin = torch.randn(1, 1, 10, 8), torch.randn(1, 1, 10, 8)
    positions = torch.tensor([[3, 4, 5, 6]])
    cos, sin = table_cos[0, 0][positions].unsqueeze(1), table_sin[0, 0][positions].unsqueeze(1)
    rotated = torch.cat((-p[..., 4:], p[..., :4]), dim=-1)
    expected = p * cos + rotated * sin
    torch.testing.assert_close(RotaryPosEmbeddingHelperV1.apply(p, cos, sin, 0), expected)
    torch.testing.assert_close(RotaryPosEmbeddingHelperV2.apply(p, table_cos, table_sin, positions), expected)

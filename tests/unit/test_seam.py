"""Model preparation's seams (seam.py): each stage's contribution to a model's ``forward``, ``loss_function``,
attention implementation or checkpointing function goes through one writer, lands in the written order, and comes
back off in one call (issue 39, item 3; issue 47, item 1)."""

from __future__ import annotations

import ast
import contextlib
import copy
import io
from types import SimpleNamespace

import pytest
import torch
from support import REPO
from tiny import llama
from transformers.loss.loss_utils import ForCausalLMLoss

from optimum_gaudi.errors import UserError
from optimum_gaudi.features import attention, kernels
from optimum_gaudi.features import linear_cross_entropy as fused_loss
from optimum_gaudi.features.compilation import CompileOptions, compile_regions, pin_loss_function
from optimum_gaudi.precision.fp8 import Fp8Plan, _InFp8, recompute_in_fp8
from optimum_gaudi.seam import LAYERS, OrderError, Seam, undo

EAGER = CompileOptions(backend="eager", regional=True)


def rms_norm(hidden, weight, eps):
    variance = hidden.float().pow(2).mean(-1, keepdim=True)
    return weight * (hidden.float() * torch.rsqrt(variance + eps)).to(hidden.dtype)


def rotary(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def batch() -> dict:
    ids = torch.randint(1, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


def prepare_every_stage_a_cpu_has(model) -> None:
    kernels.use_device_kernels(model, rms_norm=rms_norm, rotary=rotary)
    pin_loss_function(model)
    compile_regions(model, EAGER)
    assert fused_loss.FusedLinearCrossEntropy.of(model) is not None


def test_the_fused_loss_sees_the_models_own_loss_under_compilations_wrapper():
    """The fused loss asks the seam for the model's own loss function, not compilation's wrapper of it."""
    model = llama()
    pin_loss_function(model)
    compile_regions(model, EAGER)
    seam = Seam.find(model, "loss_function")
    assert seam.stages == ("pinned", "compiled")
    assert model.loss_function is not ForCausalLMLoss and seam.original is ForCausalLMLoss
    assert fused_loss.FusedLinearCrossEntropy.of(model) is not None
    assert seam.stages == ("pinned", "compiled", "fused_loss")


def test_a_contribution_goes_under_the_ones_that_belong_over_it():
    """The fused loss laid first (an earlier trainer's), compilation second: the loss compiled is the model's own,
    and the fused loss is laid again over it."""
    model = llama()
    fused_loss.FusedLinearCrossEntropy.of(model)
    compile_regions(model, EAGER)
    seam = Seam.find(model, "loss_function")
    assert seam.stages == ("compiled", "fused_loss")
    assert model.loss_function.args[0]._torchdynamo_orig_callable is ForCausalLMLoss  # partial(_loss, compiled own)


def test_nothing_goes_under_what_another_library_wrote_in_place():
    model = llama()
    seam = Seam.of(model, "forward")
    own = model.forward
    seam.adopt("inference_graphs", lambda: setattr(model, "forward", lambda *a, **k: own(*a, **k)))
    with pytest.raises(OrderError, match="fused_rotary writes in place|cannot go under inference_graphs"):
        seam.put("fused_rotary", lambda inner: inner)
    assert seam.stages == ("inference_graphs",)


def test_a_loss_function_assigned_over_the_seam_is_the_models_own():
    """The user's own loss function, set after a pin: the fused loss sees it, and refuses as before the seam."""
    model = llama()
    pin_loss_function(model)

    def my_loss(*args, **kwargs):
        return ForCausalLMLoss(*args, **kwargs) * 10

    model.loss_function = my_loss
    seam = Seam.find(model, "loss_function")
    assert seam.original is my_loss and seam.stages == ()
    with pytest.raises(UserError, match="computes its loss otherwise"):
        fused_loss.FusedLinearCrossEntropy.of(model)


def test_only_the_outermost_contribution_comes_off_and_leaves_what_was_under_it():
    model = llama()
    pin_loss_function(model)
    seam = Seam.of(model, "loss_function")
    seam.put("static_batches", lambda own: lambda *args, **kwargs: own(*args, **kwargs) * 2)
    with pytest.raises(OrderError, match="pinned is under static_batches"):
        seam.remove("pinned")
    assert seam.remove("static_batches") and not seam.remove("static_batches")
    assert vars(model)["_loss_function"] is ForCausalLMLoss  # the pin stays
    seam.undo()
    assert "_loss_function" not in vars(model)  # as the model came: transformers' property resolves it


def test_an_in_place_write_is_kept_as_a_contribution_and_taken_back():
    """The bridge's graph wrappers write the forward themselves: the seam adopts what they wrote."""
    model = llama()
    seam = Seam.of(model, "forward")

    def bridge_wrap():
        own = model.forward
        model.forward = lambda *args, **kwargs: own(*args, **kwargs)
        return model

    assert seam.adopt("inference_graphs", lambda: model) is model and seam.stages == ()  # nothing written
    assert seam.adopt("inference_graphs", bridge_wrap) is model and seam.stages == ("inference_graphs",)
    with pytest.raises(OrderError):
        seam.adopt("training_graphs", bridge_wrap)  # training graphs go under the inference ones
    seam.remove("inference_graphs")
    assert "forward" not in vars(model)


def test_undo_gives_the_model_back_as_it_came():
    """Every stage a CPU can run, then undo: no instance forward or loss function left in any module, no hook,
    no compiled block, and the model computes what an unprepared copy computes."""
    model, untouched = llama(), llama()
    prepare_every_stage_a_cpu_has(model)
    assert {"forward"} & {key for module in model.modules() for key in vars(module)}
    undo(model)
    for module in model.modules():
        left = {"forward", "_loss_function", "_compiled_call_impl", "_gaudi_seams", "_gaudi_undo"} & set(vars(module))
        assert not left, (type(module).__name__, left)
        assert not module._forward_pre_hooks, type(module).__name__
    assert "_gaudi_fused_linear_cross_entropy" not in vars(model)
    with torch.no_grad():
        ours, theirs = model(**batch()), untouched(**batch())
    assert torch.equal(ours.logits, theirs.logits) and torch.equal(ours.loss, theirs.loss)


def test_a_prepared_copy_is_prepared_on_its_own():
    """copy.deepcopy (transformers' and users' way to keep a model) takes the seams along, bound to the copy."""
    model = llama()
    prepare_every_stage_a_cpu_has(model)
    copied = copy.deepcopy(model)
    seam = Seam.find(copied, "loss_function")
    assert seam.owner is copied and seam.stages == ("pinned", "compiled", "fused_loss")
    undo(copied)
    assert "_loss_function" not in vars(copied) and "_loss_function" in vars(model)


def _writes_to_a_seam(tree: ast.AST) -> list[int]:
    """Lines assigning an attribute named like a seam (``x.forward = ...``, ``setattr(x, "forward", ...)``) or setting
    a model's attention implementation."""
    names = set(LAYERS) | {"_loss_function"}
    lines = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            lines += [t.lineno for t in targets if isinstance(t, ast.Attribute) and t.attr in names]
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "set_attn_implementation":
            lines.append(node.lineno)  # the attention implementation's writer (transformers' own)
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr" and len(node.args) > 1:
            name = node.args[1]
            if isinstance(name, ast.Constant) and name.value in names:
                lines.append(node.lineno)
    return lines


# The devices' graph wrappers write the forward in place, as the bridge's own do (users call them by hand
# through features/graphs.py); the trainer runs them through Seam.adopt.
ADOPTED = {"devices/hpu.py", "devices/cuda.py"}


def test_only_the_seam_writes_what_preparation_changes_on_a_model():
    found = {}
    for path in sorted((REPO / "optimum_gaudi").rglob("*.py")):
        relative = path.relative_to(REPO / "optimum_gaudi").as_posix()
        if relative == "seam.py":
            continue
        lines = _writes_to_a_seam(ast.parse(path.read_text(encoding="utf-8")))
        if lines:
            found[relative] = lines
    assert set(found) == ADOPTED, found


# ---- the attention implementation and the checkpointing function (issue 47, item 1) ----------------------------


def test_the_attention_implementation_is_a_seam_with_the_split_over_the_request():
    """The request (--attn_implementation) and a sequence split around it (stood in for by a wrap that records what
    it goes around): the same request again changes nothing; a name the user sets over the seam is the model's own
    from then on; undo gives the model the implementation it had."""
    model = llama()
    around = []

    def split(current):
        around.append(current)
        return "eager"  # a registered name, standing for the split's own

    attention.use(model, SimpleNamespace(attn_implementation="sdpa"), device=None)
    torch.save(model, io.BytesIO())  # the request is a name: the model pickles as before
    seam = Seam.of(model, "attn_implementation")
    seam.put("sequence_parallel", split)
    assert seam.stages == ("requested", "sequence_parallel") and around == ["sdpa"]
    attention.use(model, SimpleNamespace(attn_implementation="sdpa"), device=None)
    assert seam.stages == ("requested", "sequence_parallel") and around == ["sdpa"]
    model.set_attn_implementation("sdpa")
    assert seam.stages == () and model.config._attn_implementation == "sdpa"
    seam.put("requested", lambda current: "eager")
    assert model.config._attn_implementation == "eager"
    undo(model)
    assert model.config._attn_implementation == "sdpa"


def test_fp8_wraps_a_checkpointed_layers_function_once_and_again_after_checkpointing_is_enabled_again():
    """Each checkpointed layer's function run in the fp8 context, once; gradient checkpointing enabled again writes
    the layers' own function, which fp8 wraps again; undo takes the wrapper off."""
    model = llama()
    model.gradient_checkpointing_enable()
    plan = Fp8Plan(name="stand-in", convert=lambda model, layers: None, autocast=contextlib.nullcontext)
    layers = [m for m in model.modules() if getattr(m, "_gradient_checkpointing_func", None) is not None]
    assert layers and recompute_in_fp8(model, plan) == len(layers)
    assert recompute_in_fp8(model, plan) == 0
    model.gradient_checkpointing_enable()
    assert recompute_in_fp8(model, plan) == len(layers)
    assert all(Seam.find(m, "_gradient_checkpointing_func").stages == ("fp8",) for m in layers)
    undo(model)
    assert not any(isinstance(m._gradient_checkpointing_func, _InFp8) for m in layers)

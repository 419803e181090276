"""The one writer of what model preparation's stages change on a model: its ``forward`` and ``loss_function``, the
attention implementation its config names, and a layer's activation-checkpointing function.

Several stages of a trainer's model preparation (optimum_gaudi/preparation/) change what those are (the model's own
or one of its modules'). Those writes all go through :class:`Seam`: it
lays each stage's contribution over what is already there, checks that it lands in the order of :data:`LAYERS`
(inner first), and takes any outermost contribution back, or all of them at once. So no stage depends on knowing
which stage wrapped the seam before it (the fused loss reads the model's own loss function from the seam, not
through compilation's wrapper), and :func:`undo` gives the model back as it came.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from torch import nn

T = TypeVar("T")

# What each seam's contributions are, inner first: a contribution goes over those before it in this order and
# never under one after it. static_batches is the only one that comes and goes (each short batch).
LAYERS: dict[str, tuple[str, ...]] = {
    "forward": ("fused_rms_norm", "fused_rotary", "training_graphs", "inference_graphs", "static_batches"),
    "loss_function": ("pinned", "compiled", "fused_loss", "static_batches"),
    # a checkpointed layer's function (transformers' GradientCheckpointingLayer): run in the device's fp8 context
    "_gradient_checkpointing_func": ("fp8",),
    # the name in the model's config: the one asked for (--attn_implementation), then a sequence split around it
    "attn_implementation": ("requested", "sequence_parallel"),
}

# Where an instance keeps each seam's value: transformers' loss_function property stores what it is given in
# ``_loss_function`` (modeling_utils.PreTrainedModel.loss_function's setter); the attention implementation is the
# config's, written with ``set_attn_implementation`` (its sub-configs too).
_STORED = {
    "forward": "forward",
    "loss_function": "_loss_function",
    "_gradient_checkpointing_func": "_gradient_checkpointing_func",
}
# Seams whose value, written over them by someone else, is the model's own from then on (the contributions under it
# are forgotten): a loss function assigned, gradient checkpointing enabled again, another implementation set. A
# forward written over the seam wraps what it found, as accelerate's mixed-precision forward does: it is kept.
_OWN_WHEN_OVERWRITTEN = {"loss_function", "_gradient_checkpointing_func", "attn_implementation"}
_SEAMS = "_gaudi_seams"
_UNDO = "_gaudi_undo"


class _Absent:
    """No instance value (the class's is used): one object, which copies of a model keep."""

    def __copy__(self) -> _Absent:
        return self

    def __deepcopy__(self, memo: dict) -> _Absent:
        return self

    def __reduce__(self) -> str:
        return "_MISSING"


_MISSING = _Absent()


class OrderError(RuntimeError):
    """A stage's contribution would land out of :data:`LAYERS`' order: a bug in the preparation, not the user's."""


@dataclass
class _Layer:
    stage: str
    previous: Any  # the instance's own value before it (``_MISSING``: none, the class's)
    value: Any  # what it wrote
    wrap: Callable[[Any], Any] | None  # how it was laid, to lay it again; None: adopted (another writer's)


class Seam:
    """The one writer of one of an object's seams (:data:`LAYERS`): the stages' contributions, laid over
    the object's own value in :data:`LAYERS`' order. A contribution that belongs under ones already there is laid
    under them (they are taken off and laid again over it); only what another library wrote in place (adopted)
    cannot be laid again, and stops that with an :class:`OrderError`."""

    def __init__(self, owner: Any, name: str) -> None:
        self.owner, self.name = owner, name
        self.order = LAYERS[name]
        self._key = _STORED.get(name)  # None: the config's attention implementation
        self._layers: list[_Layer] = []
        self._original: Any = None

    @classmethod
    def of(cls, owner: Any, name: str) -> Seam:
        """``owner``'s seam for ``name``, made on first use (kept in the instance, outside its state_dict)."""
        seams = vars(owner).setdefault(_SEAMS, {})
        if name not in seams:
            seams[name] = cls(owner, name)
        return seams[name]

    @staticmethod
    def find(owner: Any, name: str) -> Seam | None:
        return vars(owner).get(_SEAMS, {}).get(name)

    def __contains__(self, stage: str) -> bool:
        return stage in self.stages

    @property
    def stages(self) -> tuple[str, ...]:
        """The contributions present, inner first."""
        self._sync()
        return tuple(layer.stage for layer in self._layers)

    @property
    def original(self) -> Any:
        """The value under every contribution: the model's own forward or loss function."""
        self._sync()
        return self._original if self._layers else self._effective()

    def value(self, stage: str) -> Any:
        """What ``stage`` laid on the seam (it must be there)."""
        self._sync()
        return next(layer.value for layer in self._layers if layer.stage == stage)

    def put(self, stage: str, wrap: Callable[[Any], Any]) -> Any:
        """Lay ``wrap(value under it)`` on the seam as ``stage``'s contribution, in its place in the order;
        returns what ``wrap`` made."""
        peeled = self._peel(stage)
        value = self._lay(stage, wrap)
        for layer in peeled:
            self._lay(layer.stage, layer.wrap)
        return value

    def adopt(self, stage: str, write: Callable[[], T]) -> T:
        """Run ``write()``, which changes the seam in place itself (the Habana bridge's graph wrappers do), and
        keep what it wrote as ``stage``'s contribution; returns what ``write`` returns. Nothing is recorded when
        it writes nothing (a device without graphs). It must go over every contribution there."""
        if self._over(stage):
            raise OrderError(f"{self._where()}: {stage} writes in place and cannot go under {self.stages[-1]}.")
        current, before = self._effective(), self._own()
        result = write()
        after = self._own()
        if after is not before:
            self._push(_Layer(stage, before, after, None), current)
        return result

    def remove(self, stage: str) -> bool:
        """Take ``stage``'s contribution back (it must be the outermost); False when it is not there."""
        if stage not in self:
            return False
        if self._layers[-1].stage != stage:
            raise OrderError(f"{self._where()}: {stage} is under {self._layers[-1].stage}; take that off first.")
        self._restore(self._layers.pop().previous)
        return True

    def undo(self) -> None:
        """Every contribution taken back: the seam as it was before the first."""
        self._sync()
        if self._layers:
            self._restore(self._layers[0].previous)
            self._layers.clear()

    def _lay(self, stage: str, wrap: Callable[[Any], Any]) -> Any:
        current, before = self._effective(), self._own()
        value = wrap(current)
        self._push(_Layer(stage, before, value, wrap), current)
        self._write(value)
        return value

    def _push(self, layer: _Layer, current: Any) -> None:
        if not self._layers:
            self._original = current
        self._layers.append(layer)

    def _over(self, stage: str) -> list[_Layer]:
        """The contributions that go over ``stage``, inner first (``stage`` itself must not be there yet)."""
        if stage in self:
            raise OrderError(f"{self._where()}: {stage} is there already.")
        rank = self.order.index(stage)
        return [layer for layer in self._layers if self.order.index(layer.stage) > rank]

    def _peel(self, stage: str) -> list[_Layer]:
        """Take off the contributions that go over ``stage`` and return them, inner first. Only those the seam
        laid itself, with nothing written over them since, can be laid again."""
        over = self._over(stage)
        if not over:
            return over
        adopted = [layer.stage for layer in over if layer.wrap is None]
        if adopted or self._overwritten():
            above = adopted[0] if adopted else "what another library wrote over the seam"
            raise OrderError(f"{self._where()}: {stage} cannot go under {above} (order, inner first: "
                             f"{', '.join(self.order)}).")  # fmt: skip
        self._restore(over[0].previous)
        del self._layers[-len(over) :]
        return over

    def _sync(self) -> None:
        """A value written over the seam by someone else is the model's own from then on, where
        :data:`_OWN_WHEN_OVERWRITTEN` says so (as transformers' loss_function property makes it): the contributions
        under it are forgotten."""
        if self.name in _OWN_WHEN_OVERWRITTEN and self._layers and self._overwritten():
            self._layers.clear()

    def _overwritten(self) -> bool:
        """Something other than the outermost contribution is there now."""
        own, top = self._own(), self._layers[-1].value
        return own != top if self._key is None else own is not top

    def _own(self) -> Any:
        """The instance's own value (``_MISSING``: none, the class's is used)."""
        if self._key is None:
            return getattr(self.owner.config, "_attn_implementation", None)
        return vars(self.owner).get(self._key, _MISSING)

    def _effective(self) -> Any:
        return self._own() if self._key is None else getattr(self.owner, self.name)

    def _write(self, value: Any) -> None:
        if self._key is None:
            if value is None:  # set_attn_implementation(None) would choose transformers' default instead
                self.owner.config._attn_implementation = None
            elif self._own() != value:  # set_attn_implementation checks the kernel's availability again
                self.owner.set_attn_implementation(value)
        else:
            setattr(self.owner, self.name, value)

    def _restore(self, previous: Any) -> None:
        if self._key is None:
            self._write(previous)
        elif previous is _MISSING:
            vars(self.owner).pop(self._key, None)
        else:
            vars(self.owner)[self._key] = previous

    def _where(self) -> str:
        return f"{type(self.owner).__name__}.{self.name}"


class Named:
    """A contribution that is a registered name (an attention implementation): what it is laid over goes to
    ``around(name, current)`` when given. A small picklable object, not a closure, so a prepared model still pickles
    and copies (``torch.save(model)``, ``copy.deepcopy``) where only a name of ours is left on it."""

    def __init__(self, name: str, around: Callable[[str, Any], None] | None = None) -> None:
        self.name, self.around = name, around

    def __call__(self, current: Any) -> str:
        if self.around is not None:
            self.around(self.name, current)
        return self.name


def on_undo(owner: Any, callback: Callable[[Any], None]) -> None:
    """Something a stage did to ``owner`` besides its seams, taken back by :func:`undo` as ``callback(owner)``.
    The callback reaches what it takes back from the owner it is given (no closure over the model), so a copy of
    a prepared model (``copy.deepcopy``) takes back its own."""
    vars(owner).setdefault(_UNDO, []).append(callback)


def undo_hook(owner: nn.Module, handle: Any) -> None:
    """A hook a stage registered on ``owner``, removed by :func:`undo` (a copied handle is the copy's)."""
    on_undo(owner, functools.partial(_remove_hook, handle))


def undo_attribute(owner: Any, name: str) -> None:
    """An attribute a stage set on ``owner`` (a marker, a compiled call), removed by :func:`undo`."""
    on_undo(owner, functools.partial(_pop_attribute, name))


def undo(model: nn.Module) -> None:
    """What the preparation's stages laid on the model, taken back in one call: every seam of it and its modules
    (fused kernels, compiled and fused losses, graphs, fp8's checkpointing function, the attention implementation
    the model came with), and the hooks, markers and compiled blocks they left. Not undone: fp8's converted layers
    (other modules, holding the same weights), gaudi_fused_sdpa's binding, and what accelerate's own wrap did (its
    mixed-precision forward with --bf16, which ``accelerator.unwrap_model(model, keep_fp32_wrapper=False)`` takes
    off; DDP, FSDP2's shards)."""
    for module in reversed(list(model.modules())):
        for callback in reversed(vars(module).pop(_UNDO, [])):
            callback(module)
        for seam in vars(module).pop(_SEAMS, {}).values():
            seam.undo()


def _remove_hook(handle: Any, owner: Any) -> None:
    handle.remove()


def _pop_attribute(name: str, owner: Any) -> None:
    vars(owner).pop(name, None)

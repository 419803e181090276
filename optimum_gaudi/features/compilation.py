"""torch.compile controls Gaudi users know from Optimum Habana, doing the same job on every device.

``--use_regional_compilation`` compiles the model's repeated block (a decoder layer) once and reuses it
for every layer, as Optimum Habana does, and compiles the model's loss function: the cross-entropy over the
whole vocabulary is the one large piece of work outside the blocks, and eagerly it takes several passes
over the logits that a compiled loss fuses. The embeddings and the output layer run eagerly. Compile time
no longer grows with the depth, and nothing graph-wide (the model's own forward, its masks) is compiled.
``--compile_dynamic`` and ``--cache_size_limit`` are torch.compile's ``dynamic`` and dynamo's cache limit;
``--compile_from_sec_iteration`` runs the first step eagerly. Every graph torch.compile builds during
training is counted, and a new input shape that causes one is named once in the log, so a user sees why
a step was slow. The backend is the device's (``hpu_backend`` on a Gaudi, inductor elsewhere).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..seam import Seam, undo_attribute, undo_hook

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CompileOptions:
    """What the training arguments ask of torch.compile."""

    backend: str
    mode: str | None = None
    dynamic: bool | None = None
    regional: bool = False
    from_second_iteration: bool = False
    cache_size_limit: int | None = None
    inductor_options: tuple[tuple[str, Any], ...] = ()  # the device's, when the backend is inductor

    @classmethod
    def from_args(cls, args: Any) -> CompileOptions | None:
        if not args.torch_compile:
            return None
        return cls(
            backend=args.torch_compile_backend,
            mode=args.torch_compile_mode,
            dynamic=args.compile_dynamic,
            regional=args.use_regional_compilation,
            from_second_iteration=args.compile_from_sec_iteration,
            cache_size_limit=args.cache_size_limit,
            inductor_options=tuple(args.gaudi_device.inductor_options.items())
            if args.torch_compile_backend == "inductor"
            else (),
        )

    def compile_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"backend": self.backend, "dynamic": self.dynamic}
        if self.mode is not None:
            kwargs["mode"] = self.mode
        return kwargs

    def dynamo_plugin(self):
        """accelerate's compile settings: the whole model, or nothing when we compile the blocks ourselves."""
        from accelerate.utils import TorchDynamoPlugin

        if self.regional:
            return TorchDynamoPlugin(backend="no")
        return TorchDynamoPlugin(backend=self.backend, mode=self.mode, dynamic=self.dynamic)

    def apply_limits(self) -> None:
        """The process-wide settings a compiling run needs: dynamo's cache limit, what an older torch lacks."""
        if self.cache_size_limit is not None:
            set_cache_size_limit(self.cache_size_limit)
        prepare_older_torch()

    def compiler_context(self) -> contextlib.AbstractContextManager:
        """Around each call that may compile: the device's inductor options (read when a graph compiles)."""
        if not self.inductor_options:
            return contextlib.nullcontext()
        import torch._inductor.config as inductor_config

        return inductor_config.patch(dict(self.inductor_options))

    def step_context(self, first_iteration: bool) -> contextlib.ExitStack:
        """The compiler context; eager for the first training iteration when asked to compile from the
        second one."""
        stack = contextlib.ExitStack()
        stack.enter_context(self.compiler_context())
        if self.from_second_iteration and first_iteration:
            stack.enter_context(torch.compiler.set_stance("force_eager"))
        return stack


def check_compile_flags(args: Any) -> None:
    """Warn about compile flags that cannot act, and about compilation counted in the throughput."""
    flags = ("use_regional_compilation", "compile_dynamic", "compile_from_sec_iteration", "cache_size_limit")
    given = [f"--{f}" for f in flags if getattr(args, f) not in (None, False)]
    if given and not (args.torch_compile or args.torch_compile_backend or args.torch_compile_mode):
        logger.warning("%s only act with --torch_compile; they are ignored.", ", ".join(given))
        return
    if getattr(args, "use_compiled_autograd", False) and args.torch_compile:
        # Turning torch._dynamo.config.compiled_autograd on process-wide left later torch.compile calls in the
        # process failing ("compiled_autograd does not exist") with torch 2.13: not applied until that is solved.
        logger.warning("--use_compiled_autograd is not applied by this release: the backward runs uncompiled.")
    compiling_steps = 2 if args.compile_from_sec_iteration else 1
    if args.torch_compile and args.throughput_warmup_steps < compiling_steps:
        logger.warning(
            "--torch_compile compiles during the first %d step(s), which --throughput_warmup_steps %d counts "
            "in the throughput: pass --throughput_warmup_steps %d to leave them out.",
            compiling_steps,
            args.throughput_warmup_steps,
            compiling_steps,
        )


def compile_choice_problem(backend: str | None, mode: str | None) -> str | None:
    """Why torch.compile cannot take this backend or mode, in one line; None when it can. Checked with the
    arguments: otherwise a wrong backend fails when the trainer is built and a wrong mode in the first step."""
    from accelerate.utils import DynamoBackend  # the backends the Trainer can hand to torch.compile
    from torch._inductor import list_mode_options

    backends = sorted(b.value.lower() for b in DynamoBackend if b.value.lower() != "no")
    if backend is not None and backend not in backends:
        return f"--torch_compile_backend {backend} is not a torch.compile backend; choose one of {', '.join(backends)}."
    modes = sorted(list_mode_options())
    if mode is not None and mode not in modes:
        return f"--torch_compile_mode {mode} is not a torch.compile mode; choose one of {', '.join(modes)}."
    return None


# optimum-habana's training arguments that set a torch._dynamo.config value of the same name when given
_DYNAMO_CONFIG_FLAGS = ("inline_inbuilt_nn_modules", "allow_unspec_int_on_nn_module")


def apply_dynamo_options(args: Any) -> None:
    """The process-wide dynamo settings the arguments ask for (optimum-habana sets them with the arguments, this
    package where the run starts): ``--inline_inbuilt_nn_modules`` / ``--allow_unspec_int_on_nn_module`` when given
    (unset keeps torch's value)."""
    config = torch._dynamo.config
    for name in _DYNAMO_CONFIG_FLAGS:
        value = getattr(args, name, None)
        if value is None:
            continue
        if not hasattr(config, name):  # allow_unspec_int_on_nn_module came with torch 2.7
            logger.warning(
                "--%s %s does nothing with torch %s, which has no torch._dynamo.config.%s.",
                name,
                value,
                torch.__version__,
                name,
            )
            continue
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            setattr(config, name, value)
        if any("does not do anything" in str(w.message) for w in caught):  # retired by this torch release
            logger.warning(
                "--%s %s does nothing with torch %s, which retired torch._dynamo.config.%s.",
                name,
                value,
                torch.__version__,
                name,
            )


def _not_exporting() -> bool:
    """torch 2.6's answer: a training run is never under ``torch.export``."""
    return False


def _torch_release() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def prepare_older_torch() -> None:
    """What compiling transformers 5's models needs from a torch older than 2.7 (2.6: Gaudi 1.20 and 1.21).

    - ``torch.compiler.is_exporting`` (came with 2.7): transformers asks it while building attention masks;
      outside a compile the missing attribute is caught, but dynamo tracing the call fails the compile.
    - torch 2.6's dynamo resumes a function after a graph break with code that reads ``torch`` from the function's
      module globals: transformers modules that import torch for type checking only (``utils/output_capturing.py``,
      around every model's forward) then fail with "NameError: name 'torch' is not defined". Such modules get the
      name; nothing else reads it.
    """
    if not hasattr(torch.compiler, "is_exporting"):
        torch.compiler.is_exporting = _not_exporting
    if _torch_release() < (2, 7):
        for name, module in list(sys.modules.items()):
            if name.startswith("transformers.") and module is not None and not hasattr(module, "torch"):
                module.torch = torch


def set_cache_size_limit(limit: int) -> None:
    """Most graphs dynamo keeps per function before it falls back to eager (process-wide)."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, limit)


def repeated_blocks(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """The model's largest list of same-class blocks (e.g. ``transformer.h``), by parameter count."""
    best, best_size = None, 0
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) < 2:
            continue
        if len({type(block) for block in module}) != 1:
            continue
        size = sum(p.numel() for p in module.parameters())
        if size > best_size:
            best, best_size = (name, module), size
    return best


def compile_regions(model: nn.Module, options: CompileOptions) -> str | None:
    """Compile the model's repeated blocks once for all of them, and its loss function; same parameters,
    same state_dict keys.

    Each block is compiled in place (``nn.Module.compile``): the blocks share their code, so torch.compile
    builds one graph and reuses it for every block. Returns the name of the blocks' list, or None when the
    model has no repeated blocks (nothing done).
    """
    found = repeated_blocks(model)
    if found is None:
        return None
    name, blocks = found
    for block in blocks:
        block.compile(**options.compile_kwargs())
        undo_attribute(block, "_compiled_call_impl")
    _no_cache_unless_asked(model)
    _compile_loss_function(model, options)
    return name


def _compile_loss_function(model: nn.Module, options: CompileOptions) -> None:
    """A transformers model's ``loss_function``, compiled (one more small graph): models that compute their
    loss another way keep it eager."""
    if _resolved_loss_function(model) is not None:
        Seam.of(model, "loss_function").put("compiled", lambda own: torch.compile(own, **options.compile_kwargs()))


def _no_cache_unless_asked(model: nn.Module) -> None:
    """Forward calls that do not ask for a KV cache get ``use_cache=False``: a cache passed through separately
    compiled blocks makes each block's guards differ (one graph per layer), and training never reads it.
    generate() asks for its cache itself, and ``model.config`` (saved with the model) is left as it is."""
    if "use_cache" not in inspect.signature(model.forward).parameters:
        return

    def no_cache(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if kwargs.get("use_cache") is None:
            kwargs["use_cache"] = False
        return args, kwargs

    undo_hook(model, model.register_forward_pre_hook(no_cache, with_kwargs=True))


def pin_loss_function(model: nn.Module) -> None:
    """Resolve transformers' ``loss_function`` once, eagerly: its one-time warning, when it runs inside a
    compiled forward, is a graph break on every step."""
    if not hasattr(model, "_loss_function") and _resolved_loss_function(model) is not None:
        Seam.of(model, "loss_function").put("pinned", lambda own: own)


def _resolved_loss_function(model: nn.Module) -> Any:
    """What transformers' ``loss_function`` property resolves to for ``model``; None for a model without it."""
    if not isinstance(getattr(type(model), "loss_function", None), property):
        return None
    try:
        return model.loss_function
    except (AttributeError, KeyError):
        return None


def _graphs_built() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def _shapes(inputs: Any) -> str:
    if not isinstance(inputs, dict):
        return "?"
    shapes = [f"{k}={tuple(v.shape)}" for k, v in inputs.items() if isinstance(v, torch.Tensor)]
    return ", ".join(shapes) or "?"


class CompilationLog:
    """Counts the graphs torch.compile builds during training and names, once, each new input shape that
    made it build one."""

    def __init__(self) -> None:
        self.graphs = 0
        self._reported: set[str] = set()

    @contextlib.contextmanager
    def watch(self, inputs: Any, step: int) -> Iterator[None]:
        before = _graphs_built()
        yield
        new = _graphs_built() - before
        if new <= 0:
            return
        self.graphs += new
        shapes = _shapes(inputs)
        if shapes not in self._reported:
            self._reported.add(shapes)
            logger.warning(
                "torch.compile built %d graph(s) at step %d for input shapes %s (%d so far); each new shape "
                "compiles again: pad to fixed shapes or pass --compile_dynamic.",
                new,
                step,
                shapes,
                self.graphs,
            )

"""The run's plan checked against its card (issue 48): a run whose memory plan does not fit says so in one line,
instead of an out-of-memory error after the first compile. ``--ignore_plan`` goes on anyway.

Two entry points, one check: :func:`check_plan_before_loading`, which a script calls with its arguments and the
model's config before it loads any weight (run_clm.py, run_lora_clm.py, demo.py and TRL's sft.py do), and
:func:`check_the_plan`, which the trainer calls before step 1 for a script that did not (a run checked before
loading is not checked again).

Only on a card (a Gaudi, a GPU): a CPU's memory is shared with the OS and the other ranks of the machine, where
`optimum-gaudi plan --card cpu` answers instead. The sequence length is the script's (its block or its longest row)
or, at step 1, the first training example's (exact for run_clm.py's blocks; a padded dataset's longer rows are not
seen). Counted: full fine-tuning, in the dtype the weights load in (a bf16 checkpoint's bf16 on transformers 5:
its gradients and AdamW's moments bf16 too), and LoRA adapters on a frozen model (one rank, on linear layers the
planner knows); other frozen-weight runs (AdaLoRA, IA3, prompt tuning, modules_to_save) are not checked, nor a
dataset it cannot index, nor a model family the planner does not know: run_mlm.py, run_glue.py and
run_summarization.py go unchecked, because the arithmetic is for decoder-only causal LMs and an encoder (BERT) or
encoder-decoder (T5) would need its own formula and measured rows. Every rank computes the same numbers, so all
refuse together.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import transformers

from ..errors import UserError
from ..planning import Adapters, Card, ModelShape, PlanDoesNotFit, adapter_parameters, check_run, load_model_shape

GB = 1e9
TRANSFORMERS_5 = int(transformers.__version__.split(".")[0]) >= 5


def card_of(device: Any) -> Card | None:
    """This run's card as the planner sees it: its kind and the memory the device reports; None on a CPU."""
    if not device.has_own_memory:
        return None
    _, total = device.memory_info()
    return Card(f"this {device.type}", total / GB, None, None, 0.0, "the device's own total", device.type)


def _config_dtype(config: Any) -> str:
    """The dtype a config names (``dtype``, transformers 4's ``torch_dtype`` before it), float32 where none."""
    if isinstance(config, dict):
        return str(config.get("dtype") or config.get("torch_dtype") or "float32")
    # the instance's own torch_dtype only: transformers 5's is a property that warns it is deprecated when read
    return str(getattr(config, "dtype", None) or vars(config).get("torch_dtype") or "float32")


def weight_bytes_as_loaded(config: Any, torch_dtype: str | None, pretrained: bool) -> int:
    """Bytes of a weight as the examples load it, 2 (bf16, fp16) or 4 (float32): ``--torch_dtype`` where given
    (``auto``: the checkpoint's, as its config names it); else the checkpoint's own dtype on transformers 5
    (from_pretrained's default is ``dtype="auto"``) and float32 on transformers 4 (its default is torch's, float32).
    A model built from its config (``from_config``, ``pretrained=False``) takes the config's dtype on both
    releases, float32 where the config names none."""
    if pretrained and torch_dtype not in (None, "auto"):
        dtype = torch_dtype
    elif pretrained and torch_dtype is None and not TRANSFORMERS_5:
        dtype = "float32"
    else:
        dtype = _config_dtype(config)
    return 2 if "16" in str(dtype) else 4


def trained_weight_bytes(model: Any) -> int:
    """Bytes of a trained weight of a loaded model, 2 or 4: the dtype most of its trained parameters are in (a
    model loaded in bf16 may keep a few modules in float32)."""
    elements = size = 0
    for parameter in model.parameters():
        if parameter.requires_grad and parameter.is_floating_point():
            elements += parameter.numel()
            size += parameter.numel() * parameter.element_size()
    return 2 if elements and size < 3 * elements else 4


def adapters_of(model: Any, shape: ModelShape) -> Adapters | None:
    """The LoRA adapters a loaded model trains, as the planner counts them, or None where it cannot: something
    besides LoRA matrices trains, the ranks differ, or the planner's count of the adapters is not the model's."""
    trained, targets, ranks = 0, set(), set()
    for name, parameter in model.named_parameters():
        if not parameter.requires_grad:
            continue
        trained += parameter.numel()
        parts = name.split(".")
        if "lora_A" in parts and parts.index("lora_A") > 0:
            targets.add(parts[parts.index("lora_A") - 1])
            ranks.add(parameter.shape[0])
        elif "lora_B" not in parts:
            return None  # a bias, a module saved whole, another PEFT method's parameters: not counted
    frozen = next((p for p in model.parameters() if not p.requires_grad and p.is_floating_point()), None)
    if len(ranks) != 1 or frozen is None:
        return None
    dropout = any(
        "lora_dropout" in name and getattr(module, "p", 0) > 0 for name, module in model.named_modules()
    )  # fmt: skip
    adapters = Adapters(ranks.pop(), tuple(sorted(targets)), dropout, frozen.element_size())
    try:
        counted = adapter_parameters(shape, adapters)
    except UserError:
        return None
    return adapters if counted == trained else None


def _first_sequence_length(dataset: Any) -> int | None:
    try:
        return len(dataset[0]["input_ids"])
    except Exception:  # an iterable dataset, a transform, other columns: the check is advice, never a crash
        return None


def _shape_of(config: Any) -> ModelShape | None:
    """The planner's shape of ``config`` without its name (a path here, a copy's name there), or None for a family
    the planner does not know or a config lacking a width."""
    try:
        return dataclasses.replace(load_model_shape(config), name="")
    except (UserError, TypeError, ValueError):
        return None


def _check(
    shape: ModelShape, args: Any, sequence: int, device: Any, adapters: Adapters | None, weight_bytes: int
) -> None:
    """The one check both entry points run: raise :class:`PlanDoesNotFit` where the plan exceeds the card."""
    card = card_of(device)
    if card is None:
        return
    message = check_run(
        shape, args, sequence, card, world=args.world_size, adapters=adapters, weight_bytes=weight_bytes
    )
    if message is not None:
        raise PlanDoesNotFit(message)


def check_plan_before_loading(
    config: Any,
    args: Any,
    sequence: int | None,
    adapters: Adapters | None = None,
    weight_bytes: int | None = None,
) -> None:
    """The run's plan checked from its model config and arguments alone, before any weight is read: what a script
    calls once it has parsed its arguments and loaded the config (run_clm.py with its block size, run_lora_clm.py
    and TRL's sft.py with their longest row and, training LoRA, its ``adapters``). ``weight_bytes``: training every
    weight, the bytes of one as the script will load it (:func:`weight_bytes_as_loaded`: 2 for a bf16 checkpoint
    on transformers 5, which then trains in bf16); None: as ``from_pretrained`` loads the config's checkpoint with
    no dtype given. Raises :class:`PlanDoesNotFit` (one line) where it does not fit; where it does, the trainer
    does not check it again (unless the weights it finds are of another dtype)."""
    shape = _shape_of(config)
    if args.ignore_plan or not sequence or shape is None:
        return
    if adapters is not None:
        try:  # the adapted modules as PEFT will find them, to compare with the loaded model's
            adapters = dataclasses.replace(adapters, targets=shape.lora_targets(adapters.targets))
        except UserError:
            return  # modules the planner does not know: the trainer checks what the loaded model trains, if it can
        if getattr(args, "fp8", False):
            return
    if weight_bytes is None:
        weight_bytes = weight_bytes_as_loaded(config, None, pretrained=True)
    if adapters is not None:
        weight_bytes = 4  # LoRA: the frozen weights' dtype is the adapters' frozen_bytes, the trained ones float32
    _check(shape, args, sequence, args.gaudi_device, adapters, weight_bytes)
    args._gaudi_plan_checked = (shape, adapters, weight_bytes, sequence)  # noqa: SLF001 (read by check_the_plan)


def check_the_plan(trainer: Any) -> None:
    """Raise :class:`PlanDoesNotFit` (one line) when the run's plan needs more memory than its card holds; for a
    script that built its own model (no :func:`check_plan_before_loading`), once the weights are loaded, in the
    dtype they are in (:func:`trained_weight_bytes`). A model with frozen weights is checked where it trains LoRA
    adapters the planner can count (:func:`adapters_of`)."""
    args = trainer.args
    if args.ignore_plan or trainer.train_dataset is None or getattr(trainer.model, "config", None) is None:
        return
    sequence = _first_sequence_length(trainer.train_dataset)
    shape = _shape_of(trainer.model.config) if sequence else None
    if shape is None:
        return
    adapters, weight_bytes = None, 4
    if not all(parameter.requires_grad for parameter in trainer.model.parameters()):
        adapters = adapters_of(trainer.model, shape)
        if adapters is None or getattr(args, "fp8", False):
            return  # frozen weights the planner cannot count: its full fine-tuning plan would stop runs that fit
    else:
        weight_bytes = trained_weight_bytes(trainer.model)
    checked = getattr(args, "_gaudi_plan_checked", None)
    if checked is not None and checked[:3] == (shape, adapters, weight_bytes) and checked[3] >= sequence:
        return  # checked before loading, as it loaded
    _check(shape, args, sequence, trainer.gaudi_device, adapters, weight_bytes)

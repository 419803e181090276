"""transformers 4's training arguments that transformers 5 removed, still on optimum-habana command lines
(``--warmup_ratio 0.03``, ``--logging_dir``, ...): each parses again, and a given value becomes its
transformers-5 equivalent with one deprecation line, or, where there is none, one line saying what to do.

Only the names the installed TrainingArguments lacks become fields, so on transformers 4.57 its own fields
stay untouched. Values equal to transformers 4's defaults are left alone and said nothing about.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from typing import Any

from transformers import TrainingArguments

from ..errors import UserError

logger = logging.getLogger(__name__)


class RemovedArgumentError(UserError, ValueError):
    """A transformers 4 argument whose value transformers 5 cannot honour; the message names what to use."""


def _say(old: str, new: str) -> None:
    logger.warning("--%s (removed in transformers 5) is read as %s; pass that instead.", old, new)


def _warmup_ratio(args: Any, ratio: float) -> None:
    if args.warmup_steps:
        raise RemovedArgumentError(
            f"--warmup_ratio {ratio} and --warmup_steps {args.warmup_steps} both set the warm-up; keep --warmup_steps."
        )
    if not 0 <= ratio < 1:
        raise RemovedArgumentError(
            f"--warmup_ratio {ratio}: transformers 5 takes a ratio in [0, 1) as --warmup_steps; for a warm-up over "
            "the whole run pass --warmup_steps equal to --max_steps."
        )
    args.warmup_steps = ratio
    _say("warmup_ratio", f"--warmup_steps {ratio} (a float below 1 is a ratio of the total steps)")


def _logging_dir(args: Any, path: str) -> None:
    # the variable itself is set with the run's other process-wide settings (removed_environment)
    _say("logging_dir", f"TENSORBOARD_LOGGING_DIR={path}, the variable transformers 5's TensorBoard callback reads")


def _tokens_per_second(args: Any, _: bool) -> None:
    if args.include_num_input_tokens_seen in ("no", False):
        args.include_num_input_tokens_seen = "all"
    _say("include_tokens_per_second", "--include_num_input_tokens_seen all (it logs train_tokens_per_second)")


def _group_by_length(args: Any, _: bool) -> None:
    args.train_sampling_strategy = "group_by_length"
    _say("group_by_length", "--train_sampling_strategy group_by_length")


def _adafactor(args: Any, _: bool) -> None:
    args.optim = "adafactor"
    _say("adafactor", "--optim adafactor")


def _hub_model_id(args: Any, name: str) -> None:
    organization = getattr(args, "push_to_hub_organization", None)
    args.hub_model_id = f"{organization}/{name}" if organization else name
    _say("push_to_hub_model_id", f"--hub_model_id {args.hub_model_id}")


def _hub_organization(args: Any, organization: str) -> None:
    if getattr(args, "push_to_hub_model_id", None):
        return  # folded into --hub_model_id by _hub_model_id
    name = os.path.basename(os.path.abspath(args.output_dir))
    args.hub_model_id = f"{organization}/{name}"
    _say("push_to_hub_organization", f"--hub_model_id {args.hub_model_id}")


def _hub_token(args: Any, token: str) -> None:
    args.hub_token = token
    _say("push_to_hub_token", "--hub_token")


def _per_gpu(split: str) -> Callable[[Any, int], None]:
    def move(args: Any, size: int) -> None:
        setattr(args, f"per_device_{split}_batch_size", size)
        _say(f"per_gpu_{split}_batch_size", f"--per_device_{split}_batch_size {size}")

    return move


def _no_cuda(args: Any, _: bool) -> None:
    args.use_cpu = True
    _say("no_cuda", "--use_cpu")


def _inputs_for_metrics(args: Any, _: bool) -> None:
    args.include_for_metrics = [*(args.include_for_metrics or []), "inputs"]
    _say("include_inputs_for_metrics", "--include_for_metrics inputs")


def _torchdynamo(args: Any, backend: str) -> None:
    args.torch_compile_backend = backend
    _say("torchdynamo", f"--torch_compile_backend {backend}")


def _refuse(message: str) -> Callable[[Any, Any], None]:
    def refuse(args: Any, value: Any) -> None:
        raise RemovedArgumentError(message.format(value=value))

    return refuse


# name: (type, transformers 4's default, what a value other than the default does)
REMOVED: dict[str, tuple[Any, Any, Callable[[Any, Any], None]]] = {
    "warmup_ratio": (float, 0.0, _warmup_ratio),
    "logging_dir": (str | None, None, _logging_dir),
    "include_tokens_per_second": (bool, False, _tokens_per_second),
    "group_by_length": (bool, False, _group_by_length),
    "adafactor": (bool, False, _adafactor),
    "push_to_hub_model_id": (str | None, None, _hub_model_id),
    "push_to_hub_organization": (str | None, None, _hub_organization),
    "push_to_hub_token": (str | None, None, _hub_token),
    "per_gpu_train_batch_size": (int | None, None, _per_gpu("train")),
    "per_gpu_eval_batch_size": (int | None, None, _per_gpu("eval")),
    "no_cuda": (bool, False, _no_cuda),
    "include_inputs_for_metrics": (bool, False, _inputs_for_metrics),
    "torchdynamo": (str | None, None, _torchdynamo),
    "save_safetensors": (
        bool,
        True,
        _refuse("--save_safetensors {value}: transformers 5 always saves safetensors; drop the flag."),
    ),
    "jit_mode_eval": (bool, False, _refuse("--jit_mode_eval was removed in transformers 5; use --torch_compile.")),
    "use_mps_device": (
        bool,
        False,
        _refuse("--use_mps_device was removed in transformers 5, which uses an Apple GPU by itself; drop it."),
    ),
    "use_legacy_prediction_loop": (
        bool,
        False,
        _refuse("--use_legacy_prediction_loop was removed in transformers 5; drop it (evaluation_loop is the loop)."),
    ),
    "past_index": (
        int,
        -1,
        _refuse("--past_index {value} was removed in transformers 5 (no model uses it any more); drop it."),
    ),
    "fsdp_min_num_params": (
        int,
        0,
        _refuse(
            "--fsdp_min_num_params was removed in transformers 5; pass --fsdp_config '{{\"min_num_params\": {value}}}'."
        ),
    ),
    "fsdp_transformer_layer_cls_to_wrap": (
        str | None,
        None,
        _refuse(
            "--fsdp_transformer_layer_cls_to_wrap was removed in transformers 5; pass "
            '--fsdp_config \'{{"transformer_layer_cls_to_wrap": ["{value}"]}}\'.'
        ),
    ),
    "fp16_opt_level": (str, "O1", _refuse("--fp16_opt_level (apex) was removed in transformers 5; drop it.")),
    "fp16_backend": (str, "auto", _refuse("--fp16_backend was removed in transformers 5; drop it.")),
    "tpu_num_cores": (int | None, None, _refuse("--tpu_num_cores was removed in transformers 5; drop it.")),
    "tpu_metrics_debug": (bool, False, _refuse("--tpu_metrics_debug was removed in transformers 5; drop it.")),
    "mp_parameters": (str, "", _refuse("--mp_parameters (SageMaker) was removed in transformers 5; drop it.")),
    "ray_scope": (
        str,
        "last",
        _refuse("--ray_scope was removed in transformers 5; pass scope= to trainer.hyperparameter_search."),
    ),
}

_MISSING = [name for name in REMOVED if name not in TrainingArguments.__dataclass_fields__]

RemovedTrainingArguments = dataclasses.make_dataclass(
    "RemovedTrainingArguments",
    [
        (
            name,
            REMOVED[name][0],
            dataclasses.field(
                default=REMOVED[name][1], metadata={"help": "Removed in transformers 5; mapped or refused in one line."}
            ),
        )
        for name in _MISSING
    ],
)
RemovedTrainingArguments.__module__ = __name__
RemovedTrainingArguments.__doc__ = "The transformers 4 arguments this transformers release lacks, as fields."


def apply_removed_arguments(args: Any) -> None:
    """Each removed argument given a value other than transformers 4's default: its transformers 5 equivalent
    with one line, or one error naming what to pass. Runs before any other check sees the arguments."""
    for name in _MISSING:
        _, default, handle = REMOVED[name]
        value = getattr(args, name, default)
        if value != default:
            handle(args, value)


def removed_environment(args: Any) -> dict[str, str]:
    """The environment variables that removed arguments given here stand for: transformers 5's TensorBoard
    callback reads --logging_dir's directory from TENSORBOARD_LOGGING_DIR. Set where the run's process is
    prepared (``GaudiTrainingArgumentsMixin.prepare_process``), not while the arguments parse."""
    path = getattr(args, "logging_dir", None) if "logging_dir" in _MISSING else None
    return {"TENSORBOARD_LOGGING_DIR": path} if path else {}

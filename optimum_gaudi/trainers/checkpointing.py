"""Checkpointing as one object: the checkpoint a run resumes from, every save (staged and published whole, shards
written in the background with --async_save), the side files beside the trainer state (the fp8 scaling state,
the run totals, the finite marker), the check that keeps non-finite weights out, and the final model's files.

The trainer's save and resume hooks hand their parent's implementation to it and do nothing else.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers.trainer import SCHEDULER_NAME, TRAINING_ARGS_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..checkpoints import (
    FINITE_MARKER,
    BackgroundWrites,
    check_sharded_resume,
    check_weights_fit,
    first_nonfinite,
    remove_previous_checkpoints,
    resolve_resume,
    save_sharded_async,
    staged_checkpoint,
    tidy_before_resuming,
    warn_if_pickles_are_unsafe_here,
)
from ..distributed import full_weights
from ..distributed.layout import ParallelLayout
from ..precision.plan import PrecisionPlan
from ..supervision.nonfinite import IGNORE
from ..supervision.preemption import Preemption, exit_after_checkpoint
from .checkpoint_size import check_room_for_a_checkpoint
from .compat import nested_gather

logger = logging.getLogger(__name__)

# The run's totals so far (loss sum, throughput clock), saved beside the trainer state in every checkpoint, so a
# resumed run reports train_loss and throughput over the whole run, as the uninterrupted run would. They are
# not trainer state: seconds and a float sum would make a resumed run's state differ from the uninterrupted one's.
RUN_TOTALS_FILE = "gaudi_run_totals.json"
# Where older checkpoints keep them: an entry of TrainerState.stateful_callbacks (still read when resuming).
RUN_TOTALS_KEY = "GaudiRunTotals"


class Checkpointing:
    """One trainer's checkpoints. ``trainer`` is the Gaudi trainer (its state, arguments, accelerator, model and
    optimizer); the precision plan writes and reads the fp8 scaling state, the layout gives the host groups."""

    def __init__(self, trainer: Any, precision: PrecisionPlan, layout: ParallelLayout) -> None:
        self.trainer, self.precision, self.layout = trainer, precision, layout
        self.writes = BackgroundWrites()  # --async_save: shards still being written, then the publish
        self.resumed_from: str | None = None
        self._staging_root: str | None = None
        self._totals: dict[str, Any] | None = None
        self._first_step = 0

    # ---- resume --------------------------------------------------------------------------------------

    def before_training(self, resume_from_checkpoint: str | bool | None) -> str | None:
        """The checkpoint this run resumes from, only a complete one that fits the model (``True``: the newest
        complete one); with ``overwrite_output_dir`` and no resume, the previous run's checkpoints deleted; room
        for one checkpoint checked. Every rank chooses before any checkpoint is deleted."""
        trainer = self.trainer
        args = trainer.args
        checkpoint = resolve_resume(resume_from_checkpoint, args.output_dir)
        self.resumed_from = checkpoint
        if checkpoint is not None:
            check_weights_fit(trainer.model, checkpoint)
            check_sharded_resume(checkpoint, trainer.accelerator.state.fsdp_plugin if trainer.is_fsdp_enabled else None)
            warn_if_pickles_are_unsafe_here(checkpoint)
        elif args.overwrite_output_dir and args.should_save:
            remove_previous_checkpoints(args.output_dir)
        trainer.accelerator.wait_for_everyone()
        if args.should_save:
            tidy_before_resuming(args.output_dir, args.save_total_limit, checkpoint)
        check_room_for_a_checkpoint(trainer)  # a disk too small for one checkpoint: one line before step 1
        return checkpoint

    def load_fp8_scaling(self, checkpoint: str, model: nn.Module | None) -> None:
        """The fp8 scaling state once the model's fp8 modules exist (they are made when the model is wrapped,
        usually after the weights load)."""
        trainer = self.trainer
        unwrapped = trainer.accelerator.unwrap_model(model if model is not None else trainer.model)
        self.precision.resume_scaling_from(checkpoint, unwrapped)

    # ---- checkpoints during the run ---------------------------------------------------------------------

    def output_dir(self, trial: Any, parent: Callable[[Any], str]) -> str:
        """Where transformers writes a checkpoint: the staging directory while one is being saved."""
        return self._staging_root or parent(trial)

    def save(self, model: nn.Module, trial: Any, parent: Callable[[nn.Module, Any], None]) -> None:
        """Written into a staging directory and renamed into place: complete or absent whenever a process dies.
        With --async_save the shards are written in the background while training goes on; the checkpoint is
        published at the first step end that finds them written, the previous one before a new save starts,
        and the last step's before this returns (no training is left to overlap)."""
        trainer = self.trainer
        state, args = trainer.state, trainer.args
        run_dir = trainer._get_output_dir(trial)  # not staging yet: the run's own
        self.writes.wait()
        if self._weights_not_finite(model):
            return
        with (
            trainer._throughput.left_out(args.adjust_throughput and trainer.is_in_train),
            trainer._supervision.paused("a save"),
            staged_checkpoint(run_dir, state, args, trainer.accelerator.wait_for_everyone, self.writes) as staging,
        ):
            self._staging_root = str(staging)
            try:
                parent(model, trial)
            finally:
                self._staging_root = None
            saved = staging / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
            if saved.is_dir():  # with fp8: the scaling state, by every rank
                self.precision.save_scaling_state(trainer.accelerator.unwrap_model(model), str(saved))
            if args.should_save and self._totals is not None and saved.is_dir():
                (saved / RUN_TOTALS_FILE).write_text(json.dumps(self._totals, indent=1), encoding="utf-8")
            if args.should_save and saved.is_dir() and args.on_nonfinite != IGNORE:
                (saved / FINITE_MARKER).write_text('{"checked": true}', encoding="utf-8")  # checked above
        if state.global_step >= state.max_steps:
            self.writes.wait()

    def save_optimizer_and_scheduler(self, output_dir: str, parent: Callable[[str], None]) -> None:
        """--async_save: FSDP's model and optimizer shards as accelerate writes them, in the background; the
        scheduler as transformers saves it."""
        trainer = self.trainer
        if not (trainer.args.async_save and trainer.is_fsdp_enabled):
            return parent(output_dir)
        groups = [self.layout.host_group("async_save_model"), self.layout.host_group("async_save_optimizer")]
        self.writes.add(save_sharded_async(trainer.model, trainer.optimizer, output_dir, groups))  # one a thread
        if trainer.args.should_save:
            torch.save(trainer.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _weights_not_finite(self, model: nn.Module) -> bool:
        """A checkpoint whose weights hold a NaN or inf is not written: it would rotate out the last finite one, and
        resuming would train on from garbage. Every rank checks its own weights; where they are sharded (FSDP,
        DeepSpeed) the ranks agree (a save is collective, every rank is here); one line says which checkpoint was
        left out. ``--on_nonfinite ignore``: written unchecked, as transformers writes it."""
        trainer = self.trainer
        if trainer.args.on_nonfinite == IGNORE:
            return False
        bad = first_nonfinite(trainer.accelerator.unwrap_model(model).named_parameters())
        flag = torch.tensor([0.0 if bad is None else 1.0])
        sharded = trainer.is_fsdp_enabled or trainer.is_deepspeed_enabled  # else every rank holds the same weights
        if sharded and trainer.args.world_size > 1 and torch.distributed.is_initialized():
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=self.layout.host_group())
        if not flag.item():
            return False
        if bad is not None or trainer.is_world_process_zero():
            logger.warning(
                "%s-%d not written: the weights hold a NaN or inf (%s); the checkpoints already written are kept.",
                PREFIX_CHECKPOINT_DIR,
                trainer.state.global_step,
                f"{bad}, rank {trainer.args.process_index}" if bad is not None else "on another rank",
            )
        return True

    def after_training(self) -> None:
        """--async_save: a run stopped early publishes its last checkpoint."""
        self.writes.wait()

    def save_before_exit(self, preemption: Preemption) -> None:
        """After SIGTERM: the checkpoint of the last step is published; the process ends (143) at once rather than
        go on with the script's evaluation and final save, which the grace period was not meant to cover."""
        trainer = self.trainer
        where = os.path.join(trainer.args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{preemption.stop_step}")
        self.writes.wait()
        trainer.accelerator.wait_for_everyone()
        if not os.path.isdir(where):  # --save_strategy best with an evaluation at that step kept only a better one
            started = time.monotonic()
            trainer._save_checkpoint(trainer.model_wrapped, trial=None)
            self.writes.wait()
            preemption.save_seconds = time.monotonic() - started
        if trainer.is_world_process_zero():
            logger.warning(
                "SIGTERM: %s written in %.1f s; exiting. Resume with --resume_from_checkpoint true.",
                where,
                preemption.save_seconds or 0.0,
            )
        exit_after_checkpoint(preemption.output)

    # ---- a resumed run reports the whole run ------------------------------------------------------------

    def totals_begin(self) -> None:
        """At train begin (after the loop reset its counters): pick up the totals a resumed checkpoint holds."""
        trainer = self.trainer
        self._totals = None
        carried = trainer.state.stateful_callbacks.pop(RUN_TOTALS_KEY, None) or {}  # an older checkpoint's
        resumed = self.resumed_from
        if resumed is not None and os.path.isfile(os.path.join(resumed, RUN_TOTALS_FILE)):
            with open(os.path.join(resumed, RUN_TOTALS_FILE), encoding="utf-8") as f:
                carried = json.load(f)
        trainer._throughput.train_begin(trainer.state.global_step, carried.get("throughput"))
        self._first_step = carried.get("first_step", trainer.state.global_step)
        if carried:  # transformers' train_loss = _total_loss_scalar / (global_step - _initial_global_step)
            trainer._total_loss_scalar = carried["loss_sum"]
            trainer._initial_global_step = self._first_step

    def load_callback_state(self, parent: Callable[[], None]) -> None:
        """--restore_callback_states_from_checkpoint: the totals an older checkpoint keeps among the callback states
        are no callback's state; kept out of transformers' matching, which would warn that a checkpoint callback
        is missing."""
        callbacks = self.trainer.state.stateful_callbacks
        carried = callbacks.pop(RUN_TOTALS_KEY, None)
        try:
            parent()
        finally:
            if carried is not None:
                callbacks[RUN_TOTALS_KEY] = carried

    def totals_snapshot(self, control: Any, logged: bool = False) -> None:
        """Before a possible checkpoint: note the totals so far, which :meth:`save` writes beside the state.

        Called at each step end and again from log(), which runs before the save of a logging step. The loss
        not yet logged lives in ``_tr_loss`` from transformers 5 on; older releases keep it in a local, so
        there the totals are exact when checkpoints fall on logging steps (as transformers' own resumed loss
        logs need too).
        """
        if not (control.should_save or control.should_evaluate):
            return
        trainer = self.trainer
        tr_loss = getattr(trainer, "_tr_loss", None)
        if tr_loss is None and not logged:
            return
        pending = 0.0 if tr_loss is None else nested_gather(tr_loss, trainer.args.parallel_mode).mean().item()
        self._totals = {
            "first_step": self._first_step,
            "loss_sum": trainer._total_loss_scalar + pending,
            "throughput": trainer._throughput.totals(trainer.state.global_step),
        }

    # ---- the model's own files ----------------------------------------------------------------------------

    def save_model(self, output_dir: str | None, internal_call: bool, parent: Callable[[str | None, bool], None]):
        """Under FSDP2 the same files as without it, streamed (distributed/full_weights.py): transformers gathers
        the whole model on rank 0 first (FULL_STATE_DICT, which then dies on rank 0's lone collective over gloo)
        or saves no weights at all (SHARDED_STATE_DICT). Checkpoints come here too; those of SHARDED_STATE_DICT
        keep only their sharded weights, as transformers writes them."""
        trainer = self.trainer
        args = trainer.args
        model = trainer.accelerator.unwrap_model(trainer.model, keep_torch_compile=False)
        streamed = trainer.is_fsdp_enabled and full_weights.is_sharded(model) and full_weights.saves(model)
        if not streamed or (internal_call and "SHARDED" in str(trainer.accelerator.state.fsdp_plugin.state_dict_type)):
            return parent(output_dir, internal_call)
        output_dir = output_dir if output_dir is not None else args.output_dir
        if full_weights.is_peft(model):  # its adapters, saved by peft as transformers saves them
            trainer._save(output_dir, state_dict=full_weights.adapter_state_dict(model))
        else:
            full_weights.save_pretrained(
                model,
                output_dir,
                is_main_process=args.should_save,
                host_group=self.layout.host_group(),
                state_filter=self.precision.without_scaling_state,
            )
            if args.should_save:
                self._save_beside_the_weights(output_dir)
        if args.push_to_hub and not internal_call:
            trainer.push_to_hub(commit_message="Model save", revision=args.hub_revision)

    def save_weights(self, output_dir: str | None, state_dict: dict | None, parent: Callable[..., None]) -> None:
        """transformers' ``_save`` without the fp8 scaling state, and the Gaudi config beside the weights."""
        trainer = self.trainer
        parent(output_dir, state_dict=self.precision.weights_to_save(trainer.model, state_dict))
        if trainer.args.should_save:
            trainer.gaudi_config.save_pretrained(output_dir if output_dir is not None else trainer.args.output_dir)

    def _save_beside_the_weights(self, output_dir: str) -> None:
        """What ``_save`` writes besides the model: the tokenizer (or processor), the arguments, the Gaudi config."""
        trainer = self.trainer
        processor = trainer.processing_class or getattr(trainer.data_collator, "tokenizer", None)
        if processor is not None:
            processor.save_pretrained(output_dir)
        torch.save(trainer.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
        trainer.gaudi_config.save_pretrained(output_dir)

"""Non-finite steps: a NaN or inf loss or gradient norm stops the run at once with one line (step, rank, which),
or with ``--on_nonfinite skip`` the step is skipped, optimizer, scheduler and gradient scaler untouched, at most
``--max_nonfinite_skips`` times in a row. ``--loss_spike_factor K`` treats a loss above K times the running median
the same way.

The verdict is taken before the optimizer step and must be the same on every rank (a rank that skipped while
another stepped would train other weights). It rests on the gradient norm, which is the whole model's on every
rank: after DDP's all-reduce every rank holds the same gradients, and FSDP's clipping reduces the norm over the
shards; a NaN loss on one rank makes the summed gradients NaN everywhere. Only the loss spike, opt-in, needs the
ranks' losses: one all-reduce of a scalar per step. Naming the ranks whose loss was not finite costs a gather, on
the bad step only.

Transformers' own ``logging_nan_inf_filter`` only hides such steps from the logged loss: without this, a
diverged run logged a loss of 0, exited 0 and its checkpoints held NaN weights. ``--on_nonfinite ignore`` gives
that behaviour back (the guard does nothing, checkpoints are written whatever their weights).

A step whose gradients overflowed under fp16's dynamic loss scaling is the gradient scaler's: it skips that
optimizer step and lowers its scale, by design in the first steps. The guard leaves such a step alone (the loss
finite on every rank, the scaler's ``found_inf`` set): it neither stops the run nor counts as skipped.
"""

from __future__ import annotations

import collections
import logging
import math
import statistics
from typing import Any

import torch
from transformers import TrainerCallback

from ..errors import UserError

logger = logging.getLogger(__name__)

ON_NONFINITE = ("stop", "skip", "ignore")
IGNORE = "ignore"  # transformers' own behaviour: a NaN is logged (or filtered from the log), training goes on
_SCALERS = "the gradient scaler's overflow"  # a step the scaler skips itself


class NonFiniteStepError(UserError):
    """A non-finite (or spiking) step under ``--on_nonfinite stop``, or too many skipped in a row."""


class NonFiniteGuard(TrainerCallback):
    """Installed by GaudiTrainer around each ``train()``; the trainer hands it each micro-batch's loss and the
    gradient norm it clipped by."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        args = trainer.args
        self.skip = args.on_nonfinite == "skip"
        self.active = args.on_nonfinite != IGNORE
        self.scaler_overflows = 0  # steps the gradient scaler skipped (fp16 overflow), left to it
        self.max_skips = args.max_nonfinite_skips
        self.spike_factor = args.loss_spike_factor
        self.skipped_in_a_row = 0
        self.skipped = 0
        self._losses: collections.deque[float] = collections.deque(maxlen=args.loss_spike_window)
        self._step_loss: torch.Tensor | None = None
        self._grad_norm: Any = None
        self._skipping = False

    # ---- from the trainer -------------------------------------------------------------------------------------

    def note_loss(self, loss: torch.Tensor) -> None:
        """A micro-batch's loss (no device sync here: the sum stays a tensor until the step's verdict)."""
        if not self.active:
            return
        loss = loss.detach().float()
        self._step_loss = loss if self._step_loss is None else self._step_loss + loss

    def note_grad_norm(self, norm: Any) -> None:
        self._grad_norm = norm

    # ---- loop events ------------------------------------------------------------------------------------------

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        loss, norm = self._step_loss, self._grad_norm
        self._step_loss, self._grad_norm = None, None
        if not self.active:
            return
        if norm is None:
            norm = self._gradient_norm()
        step = state.global_step + 1
        problem = self._problem(loss, norm, args.world_size)
        if problem is _SCALERS:
            self.scaler_overflows += 1
            logger.debug("step %d: the gradients overflowed under loss scaling; the gradient scaler skips it.", step)
            return
        if problem is None:
            self.skipped_in_a_row = 0
            return
        if self.skip and self.skipped_in_a_row < self.max_skips:
            self.skipped_in_a_row += 1
            self.skipped += 1
            self._skip_this_step()
            if self.trainer.is_world_process_zero():
                logger.warning(
                    "step %d: %s; step skipped (optimizer, scheduler and gradient scaler untouched; %d in a row, "
                    "at most %d).",
                    step,
                    problem,
                    self.skipped_in_a_row,
                    self.max_skips,
                )
            return
        if self.skip:
            raise NonFiniteStepError(
                f"step {step}: {problem}: {self.skipped_in_a_row + 1} such steps in a row; stopped before its optimizer "
                f"step (--max_nonfinite_skips {self.max_skips} skips at most that many in a row)."
            )
        raise NonFiniteStepError(
            f"step {step}: {problem}; stopped before the optimizer step (the weights and checkpoints are those "
            "before it). --on_nonfinite skip skips such steps instead."
        )

    def on_step_end(self, args, state, control, **kwargs):
        if self._skipping:  # the scheduler has been left alone by now
            optimizer = self.trainer.optimizer
            vars(optimizer).pop("step", None)
            optimizer._is_overflow = False
            self._skipping = False

    def log_keys(self) -> dict[str, int]:
        """For the trainer's log at a logging step: the steps skipped so far, where skipping is on."""
        return {"nonfinite_skipped_steps": self.skipped} if self.skip else {}

    # ---- the verdict ------------------------------------------------------------------------------------------

    def _gradient_norm(self) -> Any:
        """The whole model's gradient norm where the step computed none of ours (``--max_grad_norm 0``): through
        accelerate, which reduces it over FSDP's shards; None under DeepSpeed (its engine steps the optimizer)."""
        if self.trainer.is_deepspeed_enabled:
            return None
        model = self.trainer.model_wrapped if self.trainer.model_wrapped is not None else self.trainer.model
        return self.trainer.accelerator.clip_grad_norm_(model.parameters(), float("inf"))

    def _problem(self, loss: torch.Tensor | None, norm: Any, world_size: int) -> str | None:
        norm_value = None if norm is None else float(norm)  # the step's one device sync
        several = world_size > 1 and torch.distributed.is_initialized()
        loss_value = None if loss is None else loss
        if norm_value is not None and not math.isfinite(norm_value):
            bad_ranks, local = self._ranks_with_a_nonfinite_loss(loss_value, several)
            if bad_ranks:
                return f"the loss is {local}{_on(bad_ranks, several)} (gradient norm {norm_value})"
            if self._scaler_found_inf():  # the same on every rank: the gradients were reduced before unscaling
                return _SCALERS
            return f"the gradient norm is {norm_value} (the loss is finite{' on every rank' if several else ''})"
        if norm_value is None and loss_value is not None:  # DeepSpeed: the loss alone, agreed over the ranks
            bad = (~torch.isfinite(loss_value)).float().reshape(1)
            if several:
                torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)
            if bad.item():
                bad_ranks, local = self._ranks_with_a_nonfinite_loss(loss_value, several)
                return f"the loss is {local}{_on(bad_ranks, several)}"
        if self.spike_factor > 0 and loss_value is not None:
            return self._spike(loss_value, several, world_size)
        return None

    def _scaler_found_inf(self) -> bool:
        """Whether the gradient scaler found an inf or NaN when it unscaled this step's gradients (it then skips
        the optimizer step and lowers its scale)."""
        scaler = getattr(self.trainer.accelerator, "scaler", None)
        states = getattr(scaler, "_per_optimizer_states", None) or {}
        for state in states.values():
            for found in (state.get("found_inf_per_device") or {}).values():
                if float(found.sum()) > 0:
                    return True
        return False

    def _spike(self, loss: torch.Tensor, several: bool, world_size: int) -> str | None:
        total = loss.reshape(1).clone()
        if several:
            torch.distributed.all_reduce(total)
            total /= world_size
        value = float(total.item())
        if not math.isfinite(value):
            return f"the loss is {value}"
        enough = len(self._losses) >= min(10, self._losses.maxlen or 10)
        median = statistics.median(self._losses) if self._losses else None
        if enough and median is not None and median > 0 and value > self.spike_factor * median:
            return f"the loss {value:.4g} is over {self.spike_factor:g} x the running median {median:.4g}"
        self._losses.append(value)
        return None

    def _ranks_with_a_nonfinite_loss(self, loss: torch.Tensor | None, several: bool) -> tuple[list[int], str]:
        """On a bad step only (every rank is here, the verdict being the same everywhere): which ranks' losses
        were not finite, and what this rank's (or the first bad rank's) was."""
        value = float("nan") if loss is None else float(loss)
        mine = torch.tensor([0.0 if math.isfinite(value) else 1.0, value], dtype=torch.float64)
        if not several:
            return ([0] if mine[0] else []), str(value)
        gathered = [torch.zeros(2, dtype=torch.float64) for _ in range(torch.distributed.get_world_size())]
        torch.distributed.all_gather(gathered, mine, group=self.trainer.args.parallel_layout.host_group())
        bad = [rank for rank, row in enumerate(gathered) if row[0]]
        return bad, (str(float(gathered[bad[0]][1])) if bad else str(value))

    def _skip_this_step(self) -> None:
        """The optimizer's step is a no-op this once and reads as skipped, so transformers leaves the scheduler
        alone (accelerate's ``optimizer_step_was_skipped``, as after a gradient scaler's overflow); a gradient
        scaler forgets this step's unscaling without changing its scale."""
        optimizer = self.trainer.optimizer
        optimizer.step = _no_step
        optimizer._is_overflow = True
        scaler = getattr(self.trainer.accelerator, "scaler", None)
        if scaler is not None and hasattr(scaler, "_per_optimizer_states"):
            from torch.amp.grad_scaler import _refresh_per_optimizer_state

            scaler._per_optimizer_states = collections.defaultdict(_refresh_per_optimizer_state)
        self._skipping = True


def _on(ranks: list[int], several: bool) -> str:
    if not several or not ranks:
        return ""
    return f" on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def _no_step(*args: Any, **kwargs: Any) -> None:
    return None

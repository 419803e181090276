"""Training-loop events for the trainer's own machinery, kept out of the user's callback list.

The Gaudi trainer reacts to loop events (mark_step after the optimizer step, the throughput clock, totals
saved in checkpoints). As ordinary callbacks they would show up in ``trainer.callback_handler.callbacks``,
and code written for transformers.Trainer that inspects, pops or removes callbacks would see them or
silently break the metrics. Here they hang off the handler instead: invisible to ``callbacks``,
``pop_callback`` and ``remove_callback``, and called after every user callback, so they see the control
flags (``should_save``, ...) the flow callback set.
"""

from __future__ import annotations

from transformers import TrainerCallback
from transformers.trainer_callback import CallbackHandler


class InternalCallbackHandler(CallbackHandler):
    """A CallbackHandler that also calls `internal` callbacks, which are not part of `callbacks`."""

    internal: list[TrainerCallback]

    @classmethod
    def adopt(cls, handler: CallbackHandler, internal: list[TrainerCallback]) -> InternalCallbackHandler:
        """The same handler (callbacks, model, optimizer references), with `internal` callbacks added."""
        adopted = cls.__new__(cls)
        adopted.__dict__.update(handler.__dict__)
        adopted.internal = list(internal)
        return adopted

    def call_event(self, event, args, state, control, **kwargs):
        control = super().call_event(event, args, state, control, **kwargs)
        for callback in self.internal:
            result = getattr(callback, event)(args, state, control, **kwargs)
            if result is not None:
                control = result
        return control

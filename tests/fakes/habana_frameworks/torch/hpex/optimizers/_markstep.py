"""TEST DOUBLE of the step of ``hpex/optimizers/MarkstepAdam.py`` and ``MarkstepAdamW.py``, which the bridge puts
in place of torch's Adam and AdamW steps when PT_HPU_REPLACE_ADAM_ADAMW is 1/true/yes (``torch/__init__.py``,
``overwrite_torch_optimizers``).

The bridge's files are copies of torch 2.1's optimizers with ``htcore.mark_step()`` twice per parameter group:
before the group's state is gathered and before its update, so in lazy mode each group's update is a graph of
its own. Here torch's own step runs one group at a time between the same two mark_steps (the update is then
the running torch's, not torch 2.1's: equal in value).
"""

import torch


def markstep_step(torch_step):
    """The running torch's ``step`` cut per parameter group as the bridge's copy is. Torch's step hooks wrap the
    whole step once (``Optimizer._patch_step_function`` wraps whatever the class's step is), so an inner step
    that a torch optimizer already hooked is unwrapped to the update itself."""
    if getattr(torch_step, "hooked", False):
        torch_step = torch_step.__wrapped__

    def step(self, closure=None):
        from habana_frameworks.torch import core as htcore  # imported inside step, as MarkstepAdam.py does

        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        groups = self.param_groups
        try:
            for group in groups:
                htcore.mark_step()  # before _init_group
                self.param_groups = [group]
                htcore.mark_step()  # before adam()/adamw()
                torch_step(self)
        finally:
            self.param_groups = groups
        return loss

    step.__qualname__ = getattr(torch_step, "__qualname__", "step")
    step.bridge_markstep = True  # lets a test see that the swap happened
    return step

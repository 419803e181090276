"""Trainable parameters the forward does not use keep no gradient under training graphs, as in eager training.

A Gaudi's training graphs (``ModuleCacher`` with ``allow_unused_input=True``, without which a model with an
unused parameter, a LayerDrop layer or an unused pooler, fails its first step) give such parameters a zero
gradient at every step: the captured backward materializes them (``hpu/graphs.py``). An optimizer then acts on
them where eager training leaves them alone (AdamW's weight decay shrinks them). The trainer finds them once,
from the autograd graph of one eager forward of the first batch (generators and buffers put back after), and
drops their gradients after each backward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def reached_parameters(outputs: Any) -> set[int]:
    """ids of the tensors the autograd graph of `outputs` (nested dicts, lists, tuples) accumulates gradients in."""
    seen, reached = set(), set()
    stack = [t.grad_fn for t in _tensors(outputs) if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if hasattr(node, "variable"):  # AccumulateGrad: a leaf
            reached.add(id(node.variable))
        stack.extend(next_node for next_node, _ in node.next_functions)
    return reached


def unused_parameters(model: nn.Module, outputs: Any) -> list[nn.Parameter]:
    """The trainable parameters of `model` that `outputs`, from its forward, do not depend on."""
    reached = reached_parameters(outputs)
    return [p for p in model.parameters() if p.requires_grad and id(p) not in reached]


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []

"""Gradient synchronisation under ``DistributedDataParallel`` with gradient accumulation.

DDP all-reduces the gradients in every ``backward()``. With ``accumulate=N`` only the last
micro-batch's all-reduce is needed: :class:`GradSync` runs the others as DDP's ``no_sync()``
does (gradients accumulate locally; DDP decides in the forward whether the backward reduces, so
it is set before each micro-batch's forward), and a step costs one all-reduce per bucket
instead of N. When a step ends before its planned last micro-batch (the data ran out, a
``batch`` or ``loss`` hook skipped the last ones), the gradients accumulated without a reduction
are averaged across ranks by hand before the optimizer step, as DDP would have.

Without DDP (one process, FSDP, a model that is not wrapped) it does nothing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

__all__ = ["GradSync"]


class GradSync:
    """Decides which micro-batch's backward all-reduces (see the module docstring).

    ``no_sync()`` is a context manager that flips DDP's public ``require_backward_grad_sync``
    for the forward and backward inside it; the step's micro-batch body has several exits
    (hook skips), so :meth:`begin` sets that flag for each micro-batch instead, and
    :meth:`finish` (and building a :class:`GradSync`: a run that failed mid-step left it
    off) sets it back on.

    Attributes:
        deferred: Backwards run without a reduction since the last reduced one (their
            gradients are not averaged yet).

    Args:
        model: The model the loop trains (a ``DistributedDataParallel`` or not).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self._ddp = model if isinstance(model, DistributedDataParallel) else None
        self._deferring = False
        self.deferred = 0
        if self._ddp is not None:
            self._ddp.require_backward_grad_sync = True

    def begin(self, micro: int, accumulation_steps: int) -> None:
        """Micro-batch ``micro`` of ``accumulation_steps`` starts (before its forward): under
        DDP, its backward reduces only when it is the last."""
        ddp = self._ddp
        if ddp is None:
            return
        self._deferring = micro < accumulation_steps - 1
        ddp.require_backward_grad_sync = not self._deferring

    def backward_done(self) -> None:
        """A micro-batch's backward ran: its gradients are averaged (the last micro-batch's
        all-reduce covers what accumulated before it) or deferred."""
        self.deferred = self.deferred + 1 if self._deferring else 0

    def finish(self) -> None:
        """Before the optimizer step: DDP reduces again from the next backward, and the
        gradients left unreduced when the step ended before its last micro-batch are
        averaged (one all-reduce per parameter with a gradient; every rank gets here with the
        same count, as their steps have the same length)."""
        ddp = self._ddp
        if ddp is None:
            return
        ddp.require_backward_grad_sync = True
        self._deferring = False
        if not self.deferred:
            return
        self.deferred = 0
        world = dist.get_world_size()
        for p in ddp.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad.div_(world)

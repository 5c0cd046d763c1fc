"""Gradient synchronisation under ``DistributedDataParallel`` with gradient accumulation.

With ``accumulate=N`` only the last micro-batch's backward all-reduces (as DDP's ``no_sync()``),
so a step costs one all-reduce per bucket instead of N; a step cut short before its last
micro-batch has its gradients averaged by hand before the update (docs/distributed.md).
Without DDP it does nothing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

__all__ = ["GradSync"]


class GradSync:
    """Decides which micro-batch's backward all-reduces, by DDP's public
    ``require_backward_grad_sync`` (what ``no_sync()`` flips): :meth:`begin` sets it per
    micro-batch, :meth:`finish` and the constructor (after a run that failed mid-step) set it
    back on.

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
        """Before the optimizer step: DDP reduces again from the next backward, and gradients
        left unreduced by a step cut short are averaged (one all-reduce per parameter)."""
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

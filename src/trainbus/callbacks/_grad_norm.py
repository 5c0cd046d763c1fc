"""Gradient norm: the total norm of the gradients, measured every ``every`` steps."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .. import events as ev
from .._exceptions import ConfigError
from .._tensors import is_dtensor, is_sharded_model, plain_value
from .._validate import check_int
from ._base import Callback

if TYPE_CHECKING:
    from .._bus import EventBus
    from .._hookpoints import StepContext

__all__ = ["GradientNormMonitor"]


def total_grad_norm(parameters: object, norm_type: float = 2.0) -> torch.Tensor | None:
    """The total ``norm_type`` norm of the gradients of ``parameters`` (as clipping computes
    it), a detached 0-dim tensor on their device (no host read); None without gradients. For
    sharded (DTensor) gradients it is a collective: every rank must call it at the same step.
    """
    grads = [p.grad.detach() for p in parameters if p.grad is not None]  # type: ignore[attr-defined]
    if not grads:
        return None
    if any(is_dtensor(g) for g in grads):
        # torch's own total norm (what clipping computes) reduces the DTensor shards' norms.
        return plain_value(torch.nn.utils.get_total_norm(grads, norm_type))
    norms = torch.stack([torch.linalg.vector_norm(g, norm_type) for g in grads])
    total: torch.Tensor = torch.linalg.vector_norm(norms, norm_type)
    return total


class GradientNormMonitor(Callback):
    """Publishes ``GradientNormMeasured`` with the total gradient norm every ``every`` steps.

    Measured in ``hook_before_optimizer_step`` (gradients final and unscaled, before clipping), on
    the sampled steps only and only while some subscriber wants the event. The norm stays a
    device tensor (no sync on the training thread): read it with ``float(e.grad_norm)``. With
    ``clip_grad_norm`` set, ``StepEnded.grad_norm`` already carries it on every step. A sharded
    (FSDP2) model's norm is a collective, so every rank measures on the sampled steps.

    Args:
        every: Measure the steps ``every``, ``2 * every``, ... (>= 1).
        norm_type: The norm's order (> 0, ``math.inf`` for the max norm).

    Raises:
        ConfigError: ``every`` is not an int >= 1, or ``norm_type`` not a positive number.
    """

    def __init__(self, every: int = 50, *, norm_type: float = 2.0) -> None:
        self.every = check_int("every", every, 1)
        if (
            isinstance(norm_type, bool)
            or not isinstance(norm_type, int | float)
            or not norm_type > 0
        ):
            raise ConfigError.invalid("norm_type", norm_type, "a number > 0 or math.inf")
        self.norm_type = float(norm_type)
        self._bus: EventBus | None = None

    def setup(self, bus: EventBus) -> None:
        """Keep the bus the hook publishes on."""
        self._bus = bus

    def hook_before_optimizer_step(self, ctx: StepContext) -> None:
        """On sampled steps, measure the gradients and publish ``GradientNormMeasured``."""
        bus = self._bus
        # ctx.step counts completed steps: this update ends step ctx.step + 1.
        if bus is None or (ctx.step + 1) % self.every:
            return
        wanted = bus.wants(ev.GradientNormMeasured)
        # The same on every rank (the model's sharding), so the collective runs on all or none.
        if not wanted and not is_sharded_model(ctx.model):
            return
        norm = total_grad_norm(ctx.model.parameters(), self.norm_type)
        if norm is not None and wanted:
            bus.publish(ev.GradientNormMeasured(step=ctx.step, epoch=ctx.epoch, grad_norm=norm,
                                                norm_type=self.norm_type))  # fmt: skip

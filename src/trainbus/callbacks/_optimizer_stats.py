"""Optimizer statistics: learning rate, momentum / betas and weight decay of every group."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .. import events as ev
from .._validate import check_int
from ._base import Callback

if TYPE_CHECKING:
    from .._bus import EventBus
    from .._hookpoints import StepContext

__all__ = ["OptimizerMonitor", "optimizer_stats"]


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    try:
        # A tensor hyper-parameter (capturable optimizers) is a 1-element tensor; on CUDA this
        # read waits for the device, which is why the monitor samples every n steps only.
        return float(value)
    except (TypeError, ValueError, RuntimeError):
        return None


def optimizer_stats(
    param_groups: list[dict[str, Any]], *, step: int, epoch: int
) -> ev.OptimizerStatsMeasured:
    """Build ``OptimizerStatsMeasured`` from an optimizer's ``param_groups``, keyed
    ``"group<i>"``: momentum is SGD's ``momentum`` or Adam's ``betas[0]``, beta2 Adam's
    ``betas[1]``; a group lacking a value has no entry.
    """
    stats: dict[str, dict[str, float]] = {"lr": {}, "momentum": {}, "beta2": {}, "weight_decay": {}}
    for i, group in enumerate(param_groups):
        key = f"group{i}"
        values: Mapping[str, Any] = {
            "lr": group.get("lr"),
            "momentum": group["betas"][0] if "betas" in group else group.get("momentum"),
            "beta2": group["betas"][1] if "betas" in group else None,
            "weight_decay": group.get("weight_decay"),
        }
        for name, raw in values.items():
            number = _number(raw)
            if number is not None:
                stats[name][key] = number
    return ev.OptimizerStatsMeasured(
        step=step, epoch=epoch, lr_by_group=stats["lr"], momentum_by_group=stats["momentum"],
        beta2_by_group=stats["beta2"], weight_decay_by_group=stats["weight_decay"],
    )  # fmt: skip


class OptimizerMonitor(Callback):
    """Publishes ``OptimizerStatsMeasured`` (per-group LR, momentum/betas, weight decay) every
    ``every`` steps, from ``hook_after_optimizer_step`` and only while some subscriber wants it.

    Args:
        every: Sample the steps ``every``, ``2 * every``, ... (>= 1).

    Raises:
        ConfigError: ``every`` is not an int >= 1.
    """

    def __init__(self, every: int = 50) -> None:
        self.every = check_int("every", every, 1)
        self._bus: EventBus | None = None

    def setup(self, bus: EventBus) -> None:
        """Keep the bus the hook publishes on."""
        self._bus = bus

    def hook_after_optimizer_step(self, ctx: StepContext) -> None:
        """On sampled steps, publish the optimizer's hyper-parameters."""
        bus = self._bus
        if bus is None or ctx.step % self.every or not bus.wants(ev.OptimizerStatsMeasured):
            return
        bus.publish(optimizer_stats(ctx.optimizer.param_groups, step=ctx.step, epoch=ctx.epoch))

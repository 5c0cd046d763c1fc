"""What ``fit()`` returns: :class:`FitResult`, built from how the loop ended and the bus'
statistics."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .. import events as ev
from .._bus.statistics import BusStatistics, LostWork
from .._log import get_logger
from .._loop import Outcome

__all__ = ["FitResult", "fit_result"]

log = get_logger("trainbus._trainer.trainer")


@dataclass(frozen=True, slots=True, kw_only=True)
class FitResult:
    """What ``fit()`` returns (also kept as ``trainer.result``, failed runs included)."""

    reason: ev.EndReason
    stop_reason: str | None
    steps: int
    epochs: int
    """Epochs completed."""
    metrics: Mapping[str, float]
    """Last evaluation metrics."""
    train_metrics: Mapping[str, float]
    """Last aggregated training metrics (loss, lr, steps_per_s, ...). ``loss`` is the mean over
    the last ``log_every`` steps, or over the steps after the last log step when the run ended
    between two (a run shorter than ``log_every`` included)."""
    checkpoint: str | None
    """Path of the last checkpoint written in this run."""
    subscriber_failures: Mapping[str, int]
    """Failures per subscription name (only those that failed)."""
    statistics: BusStatistics
    error: BaseException | None = None
    skipped_nonfinite: int = 0
    """Optimizer steps skipped for a non-finite loss (``on_nonfinite="skip"``)."""
    resumed_from: str | None = None
    """The checkpoint file this run loaded (``fit(resume=...)``), None for a fresh start,
    ``resume="latest"`` finding no valid checkpoint included."""
    failed_saves: int = 0
    """Checkpoint writes the disk refused (full, read-only): each logged as
    ``checkpoint_save_failed`` naming the file; the earlier checkpoints stay valid."""
    waited_s: Mapping[str, float] = dataclasses.field(default_factory=dict)
    """Seconds training waited on each subscription that held it (an ``overflow="block"``
    buffer that was full, a barrier or decision step it decides at); absent: never waited."""
    lost: Mapping[str, LostWork] = dataclasses.field(default_factory=dict)
    """Work each subscription lost (dropped by its overflow policy, cancelled at close or by
    ``cancel_pending()``, failed); only subscriptions that lost something."""
    metric_failures: Mapping[str, int] = dataclasses.field(default_factory=dict)
    """Evaluations in which each ``set_metrics`` metric raised (in ``update`` or
    ``compute``, here or on another rank), logged as ``set_metric_failed``; it was left out of
    those evaluations' metrics and the run went on. Only metrics that failed."""

    @property
    def ending(self) -> ev.Ending:
        """How the run ended, typed: ``reason`` with a stop's cause told apart
        (``Ending.PRUNED``, ``Ending.SIGNAL``, ``Ending.STOPPED``;
        :class:`~trainbus.events.Ending`)."""
        return ev.Ending.of(self.reason, self.stop_reason)

    @property
    def lost_work(self) -> int:
        """Items lost by all subscriptions together (0: every item was handled)."""
        return sum(x.total for x in self.lost.values())


def fit_result(outcome: Outcome, stats: BusStatistics) -> FitResult:
    """The :class:`FitResult` of a run of the loop that ended with ``outcome``.

    Args:
        outcome: How the loop ended.
        stats: The bus' statistics after it delivered the run's events.
    """
    log.debug("fit_ended", reason=outcome.reason, step=outcome.state.step,
             epoch=outcome.state.epoch, stop_reason=outcome.stop_reason)  # fmt: skip
    return FitResult(
        reason=outcome.reason, stop_reason=outcome.stop_reason, steps=outcome.state.step,
        epochs=outcome.state.epoch, metrics=outcome.eval_metrics,
        train_metrics=outcome.train_metrics, checkpoint=outcome.last_checkpoint,
        subscriber_failures={x.name: x.failed for x in stats.subscriptions if x.failed},
        statistics=stats, error=outcome.error, skipped_nonfinite=outcome.skipped_nonfinite,
        resumed_from=outcome.resumed_from, failed_saves=outcome.failed_saves,
        waited_s=_by_name((x.name, x.waited_s) for x in stats.subscriptions if x.waited_s),
        lost=_by_name((x.name, x.lost) for x in stats.subscriptions if x.lost),
        metric_failures=outcome.metric_failures,
    )  # fmt: skip


def _by_name(pairs: Iterable[tuple[str, Any]]) -> dict[str, Any]:
    """``{name: value}``; two subscriptions with one name are summed (waits, lost work)."""
    out: dict[str, Any] = {}
    for name, value in pairs:
        out[name] = value if name not in out else out[name] + value
    return out

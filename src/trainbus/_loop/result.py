"""How a run of the loop ends: :class:`FitResult`, and :class:`Cancelled`, which ends it when its
:class:`CancelFlag` is raised."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from .. import events as ev

if TYPE_CHECKING:
    from .._bus.commands import Doorbell
    from .._bus.subscriptions import BusStatistics, LostWork

__all__ = ["CancelFlag", "Cancelled", "FitResult"]

# Attributes of earlier versions -> the one that replaced each.
_RENAMED = {"metrics": "eval_metrics", "checkpoint": "last_checkpoint", "lost": "lost_work"}


class Cancelled(BaseException):
    """Raised inside the loop when fit() was cancelled or a second SIGINT arrived."""


@dataclass(frozen=True, slots=True, kw_only=True)
class FitResult:
    """What ``fit()`` returns (also kept as ``trainer.result``, failed runs included)."""

    reason: Literal["completed", "stopped", "failed", "cancelled"]
    """How the run ended, coarsely (:attr:`ending` tells a stop's cause apart)."""
    stop_reason: str | None
    """The ``StopTraining.reason`` when ``reason == "stopped"``."""
    steps: int
    epochs: int
    """Epochs completed."""
    eval_metrics: Mapping[str, float]
    """Last evaluation metrics."""
    train_metrics: Mapping[str, float]
    """Last aggregated training metrics (loss, lr, steps_per_s, ...). ``loss`` is the mean over
    the last ``log_every`` steps, or over the steps after the last log step when the run ended
    between two (a run shorter than ``log_every`` included)."""
    last_checkpoint: str | None
    """Path of the last checkpoint written in this run."""
    statistics: BusStatistics
    """The bus' statistics once it delivered the run's events."""
    error: BaseException | None = None
    skipped_nonfinite: int = 0
    """Optimizer steps skipped for a non-finite loss (``on_nonfinite="skip"``)."""
    resumed_from: str | None = None
    """The checkpoint file this run loaded (``fit(resume=...)``), None for a fresh start,
    ``resume="latest"`` finding no valid checkpoint included."""
    failed_saves: int = 0
    """Checkpoint writes the disk refused (docs/reliability.md)."""
    metric_failures: Mapping[str, int] = dataclasses.field(default_factory=dict)
    """Evaluations in which each ``set_metrics`` metric raised (logged as
    ``set_metric_failed``, left out of those evaluations' metrics). Only metrics that failed."""
    subscriber_failures: Mapping[str, int] = dataclasses.field(default_factory=dict)
    """Failures per subscription name (only those that failed)."""
    waited_s: Mapping[str, float] = dataclasses.field(default_factory=dict)
    """Seconds training waited on each subscription that held it (docs/bus.md)."""
    end_waited_s: Mapping[str, float] = dataclasses.field(default_factory=dict)
    """Seconds the call's end waited for each async subscription to finish (docs/bus.md)."""
    lost_work: Mapping[str, LostWork] = dataclasses.field(default_factory=dict)
    """Work each subscription lost (dropped, cancelled, failed); empty when none did."""

    def __getattr__(self, name: str) -> Any:
        """An attribute of an earlier version (``metrics``, ``checkpoint``, ``lost``): an
        ``AttributeError`` naming the one that replaced it."""
        new = _RENAMED.get(name)
        if new is None:
            raise AttributeError(f"'FitResult' object has no attribute {name!r}")
        raise AttributeError(f"FitResult.{name} is FitResult.{new} now")

    @property
    def ending(self) -> ev.Ending:
        """How the run ended, typed: ``reason`` with a stop's cause told apart
        (``Ending.PRUNED``, ``Ending.SIGNAL``, ``Ending.STOPPED``; :class:`~ev.Ending`)."""
        return ev.Ending.of(self.reason, self.stop_reason)

    def with_bus(self, statistics: BusStatistics) -> FitResult:
        """This result with the bus' figures of the run: ``statistics`` and, from it,
        ``subscriber_failures``, ``waited_s``, ``end_waited_s`` and ``lost_work``."""
        subs = statistics.subscriptions
        return dataclasses.replace(
            self,
            statistics=statistics,
            subscriber_failures={x.name: x.failed for x in subs if x.failed},
            waited_s=_by_name((x.name, x.waited_s) for x in subs if x.waited_s),
            end_waited_s=_by_name((x.name, x.end_waited_s) for x in subs if x.end_waited_s),
            lost_work=_by_name((x.name, x.lost_work) for x in subs if x.lost_work),
        )


def _by_name(pairs: Iterable[tuple[str, Any]]) -> dict[str, Any]:
    """``{name: value}``; two subscriptions with one name are summed (waits, lost work)."""
    out: dict[str, Any] = {}
    for name, value in pairs:
        out[name] = value if name not in out else out[name] + value
    return out


class CancelFlag:
    """A run's cancel request: asked from any thread, checked by the loop's parts."""

    __slots__ = ("_doorbell", "requested")

    def __init__(self, doorbell: Doorbell) -> None:
        self._doorbell = doorbell
        self.requested = False

    def request(self) -> None:
        """Ask the run to stop at its next check. Safe from any thread."""
        self.requested = True
        self._doorbell.ring()

    def check(self) -> None:
        """Raise :class:`Cancelled` when a cancel was asked."""
        if self.requested:
            raise Cancelled

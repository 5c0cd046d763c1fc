"""How a run of the loop ends: :class:`Outcome`, and :class:`Cancelled` raised to end it."""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import events as ev
from ..checkpoint import TrainState

__all__ = ["Cancelled", "Outcome"]


class Cancelled(BaseException):
    """Raised inside the loop when fit() was cancelled or a second SIGINT arrived."""


@dataclass(slots=True, kw_only=True)
class Outcome:
    """How a run ended, as the Trainer turns it into a ``FitResult``."""

    reason: ev.EndReason
    error: BaseException | None
    stop_reason: str | None
    state: TrainState
    eval_metrics: dict[str, float]
    train_metrics: dict[str, float]
    last_checkpoint: str | None
    skipped_nonfinite: int = 0
    resumed_from: str | None = None
    """The checkpoint file the run loaded, None for a fresh start."""
    failed_saves: int = 0
    """Checkpoint writes the disk refused."""
    metric_failures: dict[str, int] = field(default_factory=dict)
    """Failures of each ``set_metrics`` metric that raised."""

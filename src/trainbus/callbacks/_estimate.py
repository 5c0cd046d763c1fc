"""Run length and step rate, shared by :class:`Progress` and :class:`RuntimeEstimator`, computed
from the events' own ``time`` stamps (not from when they were delivered).
"""

from __future__ import annotations

from collections import deque

from .. import events as ev

__all__ = ["RunLength", "StepRate"]


class RunLength:
    """The total optimizer steps of a run, as soon as it is known: ``max_steps`` or
    ``max_epochs x steps_per_epoch`` (the smaller), else from the first complete epoch.
    """

    def __init__(self) -> None:
        self.total: int | None = None
        self._max_steps: int | None = None
        self._max_epochs: int | None = None
        self._first_epoch: int | None = None
        self._resumed = False
        self._epoch_start: int | None = None

    def started(self, e: ev.FitStarted) -> None:
        """Read the limits of the run."""
        self._max_steps, self._max_epochs = e.max_steps, e.max_epochs
        self._first_epoch, self._resumed = e.epoch, e.resumed_from is not None
        self.total = e.max_steps
        if e.max_epochs is not None and e.steps_per_epoch is not None:
            by_epochs = e.max_epochs * e.steps_per_epoch
            self.total = by_epochs if self.total is None else min(self.total, by_epochs)

    def epoch_started(self, e: ev.EpochStarted) -> None:
        """Remember where the epoch began."""
        self._epoch_start = e.step

    def epoch_ended(self, e: ev.EpochEnded) -> None:
        """Estimate the total from the first complete epoch when nothing else gave it."""
        if (
            self.total is not None
            or self._max_epochs is None
            or e.error is not None
            or self._epoch_start is None
            or (self._resumed and e.epoch == self._first_epoch)  # resumed mid-epoch: partial
            or e.step <= self._epoch_start
        ):
            return
        per_epoch = e.step - self._epoch_start
        self.total = e.step + per_epoch * max(0, self._max_epochs - e.epoch - 1)


class StepRate:
    """Optimizer steps per second over the last ``window`` ``StepEnded`` events (the first
    step by its own ``duration_s``).
    """

    def __init__(self, window: int = 50) -> None:
        self._points: deque[tuple[int, float]] = deque(maxlen=max(2, window))
        self._first_duration: float | None = None

    def add(self, e: ev.StepEnded) -> None:
        """Record one step's end."""
        if not self._points:
            self._first_duration = e.duration_s
        self._points.append((e.step, e.time))

    @property
    def steps_per_s(self) -> float | None:
        """The measured rate; None before the first step."""
        if len(self._points) >= 2:
            (s0, t0), (s1, t1) = self._points[0], self._points[-1]
            if t1 > t0 and s1 > s0:
                return (s1 - s0) / (t1 - t0)
        if self._first_duration:
            return 1.0 / self._first_duration
        return None

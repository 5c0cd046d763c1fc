"""Runtime estimate: elapsed time, time left and the expected end, from the measured rate."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from reactivex import operators as ops

from .. import events as ev
from .._validate import check_int, check_seconds
from ._base import Callback
from ._estimate import RunLength, StepRate

if TYPE_CHECKING:
    from .._bus import EventBus

__all__ = ["RuntimeEstimator"]


class _Estimator:
    """One run's estimate. Fed on the event-loop thread only."""

    def __init__(self, window: int) -> None:
        self.length = RunLength()
        self.rate = StepRate(window)
        self.start: float | None = None
        self.start_step = 0

    def started(self, e: ev.FitStarted) -> None:
        self.length.started(e)
        self.start, self.start_step = e.time, e.step

    def estimate(self, e: ev.StepEnded) -> ev.RuntimeEstimated | None:
        rate = self.rate.steps_per_s
        if rate is None or self.start is None:
            return None
        total = self.length.total
        remaining = max(0.0, (total - e.step) / rate) if total is not None else None
        # The event's own monotonic time, mapped onto the wall clock for a readable ETA.
        eta = (
            time.time() - (time.monotonic() - e.time) + remaining if remaining is not None else None
        )
        return ev.RuntimeEstimated(step=e.step, epoch=e.epoch, elapsed_s=e.time - self.start,
                                   remaining_s=remaining, eta=eta, steps_per_s=rate,
                                   total_steps=total)  # fmt: skip


class RuntimeEstimator(Callback):
    """Publishes ``RuntimeEstimated(elapsed_s, remaining_s, eta, steps_per_s)`` at most once per
    ``every_s`` seconds, from the step rate over the last ``window`` steps and the run's length.

    ``remaining_s`` and ``eta`` (a Unix timestamp) stay None while the run's length is unknown
    (only ``max_epochs`` and data without a length: until the first epoch ends).

    Args:
        every_s: At most one estimate per ``every_s`` seconds (> 0).
        window: Steps the rate is measured over (>= 2).

    Attributes:
        last: The last ``RuntimeEstimated`` published (None before the first).

    Raises:
        ConfigError: ``every_s`` not a positive number, ``window`` not an int >= 2.
    """

    def __init__(self, every_s: float = 10.0, *, window: int = 50) -> None:
        self.every_s = check_seconds("every_s", every_s)
        self.window = check_int("window", window, 2)
        self.last: ev.RuntimeEstimated | None = None

    def setup(self, bus: EventBus) -> None:
        """Subscribe the measuring and publishing pipelines."""
        est = _Estimator(self.window)

        def publish(e: ev.StepEnded) -> None:
            out = est.estimate(e)
            if out is not None:
                self.last = out
                bus.publish(out)

        name = "RuntimeEstimator"
        bus.stream(ev.FitStarted).subscribe(est.started, name=f"{name}.fit_started")
        bus.stream(ev.EpochStarted).subscribe(est.length.epoch_started, name=f"{name}.epoch")
        bus.stream(ev.EpochEnded).subscribe(est.length.epoch_ended, name=f"{name}.epoch_ended")
        # The rate sees every step (a deque append); the estimate is throttled.
        bus.stream(ev.StepEnded).subscribe(est.rate.add, name=f"{name}.rate")
        bus.stream(ev.StepEnded).pipe(ops.throttle_first(self.every_s)).subscribe(
            publish, name=name
        )

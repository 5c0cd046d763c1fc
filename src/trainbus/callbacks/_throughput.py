"""Throughput: steps/s, samples/s and data-loader wait, measured per time window."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog
from reactivex import operators as ops

from .. import events as ev
from .._exceptions import ConfigError
from .._validate import check_seconds
from ._base import Callback

if TYPE_CHECKING:
    from .._bus import EventBus

__all__ = ["Throughput", "ThroughputMonitor"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Throughput:
    """The figures of one window."""

    step: int
    """Step of the window's last ``StepEnded``."""
    epoch: int
    steps: int
    """Optimizer steps that ended in the window."""
    samples: int
    elapsed_s: float
    """Wall time those steps took: from the previous window's last step end (for the first
    window, from the start of its first step) to this window's last step end."""
    steps_per_s: float
    samples_per_s: float
    data_wait_s: float
    """Mean seconds a step waited for the data iterable (``StepEnded.data_wait_s``)."""
    data_wait_fraction: float
    """Share of the steps' own time spent waiting for data: above a few percent, the loader
    is the bottleneck."""


class _Meter:
    """Turns a window of events into :class:`Throughput`; remembers where the last one ended."""

    def __init__(self) -> None:
        self.last_end: float | None = None

    def __call__(self, window: list[Any]) -> Throughput | None:
        steps: list[ev.StepEnded] = window
        if not steps:
            return None  # nothing trained (an evaluation, or the run is over): no figures
        first, last = steps[0], steps[-1]
        start = self.last_end if self.last_end is not None else first.time - first.duration_s
        self.last_end = last.time
        elapsed = last.time - start
        if elapsed <= 0:  # coarse clock: fall back on the steps' own durations
            elapsed = sum(e.duration_s for e in steps)
        elapsed = max(elapsed, 1e-9)
        samples = sum(e.samples for e in steps)
        wait = sum(e.data_wait_s for e in steps)
        busy = sum(e.duration_s for e in steps)
        return Throughput(
            step=last.step, epoch=last.epoch, steps=len(steps), samples=samples,
            elapsed_s=elapsed, steps_per_s=len(steps) / elapsed, samples_per_s=samples / elapsed,
            data_wait_s=wait / len(steps), data_wait_fraction=wait / busy if busy > 0 else 0.0,
        )  # fmt: skip


class ThroughputMonitor(Callback):
    """Logs training throughput once per ``window_s`` seconds (a ``"throughput"`` line: step,
    epoch, steps, samples, elapsed_s, steps_per_s, samples_per_s, data_wait_s,
    data_wait_fraction), from ``StepEnded`` only and the events' own timestamps.

    Args:
        window_s: Seconds per window (> 0).
        log: Log a ``"throughput"`` line per window with the ``"trainbus"`` structlog logger.

    Attributes:
        last: The :class:`Throughput` of the last window (None before the first).

    Raises:
        ConfigError: ``window_s`` is not a positive number, or ``log`` not a bool.
    """

    def __init__(self, window_s: float = 5.0, *, log: bool = True) -> None:
        self.window_s = check_seconds("window_s", window_s)
        if not isinstance(log, bool):
            raise ConfigError.invalid("log", log, "True or False")
        self.log = log
        self.last: Throughput | None = None

    def setup(self, bus: EventBus) -> None:
        """Subscribe the windowed measuring pipeline."""
        logger = structlog.get_logger("trainbus")

        def report(t: Throughput) -> None:
            self.last = t
            if self.log:
                logger.info("throughput", step=t.step, epoch=t.epoch, steps=t.steps,
                            samples=t.samples, elapsed_s=t.elapsed_s, steps_per_s=t.steps_per_s,
                            samples_per_s=t.samples_per_s, data_wait_s=t.data_wait_s,
                            data_wait_fraction=t.data_wait_fraction)  # fmt: skip

        bus.stream(ev.StepEnded).pipe(
            ops.buffer_with_time(self.window_s),
            ops.map(_Meter()),  # one meter per setup (per run)
            ops.filter(lambda t: t is not None),
        ).subscribe(report, name="ThroughputMonitor")

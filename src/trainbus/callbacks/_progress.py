"""Training progress: a tqdm bar (else a structlog line per refresh), and runtime estimates, both
from the run's length and step rate measured on the events' own ``time`` stamps."""

from __future__ import annotations

import os
import sys
import time
from collections import deque
from typing import TYPE_CHECKING, Any

import structlog
from reactivex import operators as ops

from .. import events as ev
from .._exceptions import ConfigError
from .._validate import check_int, check_seconds
from ._base import Callback

if TYPE_CHECKING:
    from .._bus import EventBus

__all__ = ["FALLBACK_COLUMNS", "Progress", "RuntimeEstimator", "progress_by_default"]

log = structlog.get_logger("trainbus")


def progress_by_default() -> bool:
    """Whether ``Trainer(progress=None)`` shows a :class:`Progress`: stderr is a terminal, on
    rank 0 (``RANK`` absent or ``"0"``)."""
    if os.environ.get("RANK", "0").strip() not in ("", "0"):
        return False
    try:
        return bool(sys.stderr.isatty())
    except (AttributeError, ValueError):  # stderr replaced by an object without isatty, or closed
        return False


FALLBACK_COLUMNS = 100
"""The bar's width on a terminal that reports zero columns."""


def terminal_columns(stream: Any) -> int | None:
    """The columns of ``stream``'s terminal (0 on some pseudo-terminals), None if not one."""
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, ValueError, OSError):  # no fileno, closed, or not a terminal
        return None


class _Pace:
    """One run's length (known, else estimated from the first complete epoch) and its step
    rate over the last ``window`` steps."""

    def __init__(self, window: int = 50) -> None:
        self.total: int | None = None
        self.start: ev.FitStarted | None = None
        self._epoch_start: int | None = None
        self._points: deque[tuple[int, float]] = deque(maxlen=window)
        self._first_duration: float | None = None

    def subscribe(self, bus: EventBus, name: str) -> None:
        bus.stream(ev.FitStarted).subscribe(self.started, name=f"{name}.fit_started")
        bus.stream(ev.EpochStarted).subscribe(self.epoch_started, name=f"{name}.epoch_started")
        bus.stream(ev.EpochEnded).subscribe(self.epoch_ended, name=f"{name}.epoch_ended")
        # Every step is counted (a deque append); what is shown or published is sampled.
        bus.stream(ev.StepEnded).subscribe(self.stepped, name=f"{name}.rate")

    def started(self, e: ev.FitStarted) -> None:
        self.start, self.total = e, e.max_steps
        if e.max_epochs is not None and e.steps_per_epoch is not None:
            by_epochs = e.max_epochs * e.steps_per_epoch
            self.total = by_epochs if self.total is None else min(self.total, by_epochs)

    def epoch_started(self, e: ev.EpochStarted) -> None:
        self._epoch_start = e.step

    def epoch_ended(self, e: ev.EpochEnded) -> None:
        start, first = self._epoch_start, self.start
        if (
            self.total is not None
            or first is None
            or first.max_epochs is None
            or e.error is not None
            or start is None
            or (first.resumed_from is not None and e.epoch == first.epoch)  # a partial epoch
            or e.step <= start
        ):
            return
        self.total = e.step + (e.step - start) * max(0, first.max_epochs - e.epoch - 1)

    def stepped(self, e: ev.StepEnded) -> None:
        if not self._points:
            self._first_duration = e.duration_s
        self._points.append((e.step, e.time))

    @property
    def steps_per_s(self) -> float | None:
        if len(self._points) >= 2:
            (s0, t0), (s1, t1) = self._points[0], self._points[-1]
            if t1 > t0 and s1 > s0:
                return (s1 - s0) / (t1 - t0)
        return 1.0 / self._first_duration if self._first_duration else None

    def remaining_s(self, step: int) -> float | None:
        rate, total = self.steps_per_s, self.total
        return None if rate is None or total is None else max(0.0, (total - step) / rate)


class Progress(Callback):
    """Shows training progress (step / total, epoch, loss, learning rate). See
    docs/callbacks/progress.md.

    Args:
        refresh_s: Minimum seconds between two refreshes (> 0).
        bar: ``None``: a tqdm bar on stderr when tqdm is importable, else log lines;
            ``True``: require tqdm; ``False``: log lines (``"progress"`` events from the
            ``"trainbus"`` structlog logger, keys ``step``, ``epoch``, ``loss``, ``lr``,
            ``total_steps``, ``steps_per_s``, ``remaining_s``).
        desc: Label of the bar.

    Attributes:
        bar: The current tqdm bar (None in log mode or before ``FitStarted``).
        step: The last step shown (None before the first).
        total_steps: The total shown (None while unknown).

    Raises:
        ConfigError: ``refresh_s`` is not a positive number, ``bar`` is not None/True/False,
            ``desc`` is not a string; at setup, ``bar=True`` without tqdm installed.
    """

    def __init__(self, refresh_s: float = 0.2, *, bar: bool | None = None, desc: str = "train"):
        self.refresh_s = check_seconds("refresh_s", refresh_s)
        if bar is not None and not isinstance(bar, bool):
            raise ConfigError.invalid("bar", bar, "None (tqdm when importable), True or False")
        if not isinstance(desc, str):
            raise ConfigError.invalid("desc", desc, "a string")
        self.use_bar = bar
        self.desc = desc
        self._start_run(None)

    def _start_run(self, tqdm_cls: Any) -> None:
        # The display of one run, touched only on the event-loop thread: no lock.
        self._tqdm = tqdm_cls
        self._pace = _Pace()
        self.bar: Any = None
        self.step: int | None = None
        self._epoch: int | None = None
        self._last: ev.StepEnded | None = None
        self._shown: ev.StepEnded | None = None  # the step whose loss was read
        self._loss: float | None = None
        self._logged: tuple[int, int, ev.StepEnded | None] | None = None

    @property
    def total_steps(self) -> int | None:
        """The total shown, None while unknown."""
        return self._pace.total

    def setup(self, bus: EventBus) -> None:
        """Build the display pipelines.

        Raises:
            ConfigError: ``bar=True`` and tqdm is not installed.
        """
        tqdm_cls: Any = None
        if self.use_bar is not False:
            try:  # optional dependency, imported only when a Progress is added
                import tqdm

                tqdm_cls = tqdm.tqdm
            except ImportError:
                if self.use_bar:
                    raise ConfigError.invalid(
                        "bar", True, "False or None: tqdm is not installed (pip install tqdm)"
                    ) from None
        self._start_run(tqdm_cls)
        self._pace.subscribe(bus, "Progress")
        bus.stream(ev.FitStarted).subscribe(self._started, name="Progress.fit_started")
        bus.stream(ev.StepEnded).subscribe(self._latest, name="Progress.latest")
        bus.stream(ev.StepEnded).pipe(ops.sample(self.refresh_s)).subscribe(
            lambda e: self._show(e.step, e.epoch), name="Progress.step_ended"
        )
        bus.stream(ev.EpochEnded).subscribe(
            lambda e: self._show(e.step, e.epoch), name="Progress.epoch_ended"
        )
        bus.stream(ev.FitEnded).subscribe(self._ended, name="Progress.fit_ended")

    def _started(self, e: ev.FitStarted) -> None:
        self.step = e.step
        self._open(e.step)

    def _latest(self, e: ev.StepEnded) -> None:
        self._last = e

    def _ended(self, e: ev.FitEnded) -> None:
        # FitEnded.epoch counts the epoch after the last one; show the last one trained.
        epoch = self._epoch if self._epoch is not None else e.epoch
        if self.bar is None:
            self._show(e.step, epoch)
            return
        # Bring the bar up to date without drawing: close() draws the last line, once.
        self._update(e.step, epoch, draw=False)
        self.bar.close()

    def _open(self, initial: int) -> None:
        if self._tqdm is None or self.bar is not None:
            return
        # mininterval=0: the sampling upstream decides when to draw. A terminal that reports
        # zero columns (some CI pseudo-terminals) gets a fixed width, not a bar of none.
        width = terminal_columns(sys.stderr)
        fixed = width is not None and width <= 0
        self.bar = self._tqdm(
            total=self._pace.total,
            initial=initial,
            desc=self.desc,
            unit="step",
            file=sys.stderr,
            mininterval=0,
            dynamic_ncols=not fixed,
            ncols=FALLBACK_COLUMNS if fixed else None,
        )

    def _values(self) -> dict[str, Any]:
        """Loss and LR of the latest step (the loss read once per new step shown)."""
        last = self._last
        if last is None:
            return {}
        if last is not self._shown:
            self._shown, self._loss = last, float(last.loss)  # a device read, once per refresh
        return {"loss": self._loss, "lr": last.lr}

    def _show(self, step: int, epoch: int) -> None:
        if self._tqdm is not None:
            self._update(step, epoch, draw=True)
            return
        self.step, self._epoch = step, epoch
        state = (step, epoch, self._last)
        if state == self._logged:
            return  # nothing new since the last line (e.g. the epoch's last step)
        self._logged = state
        pace = self._pace
        log.info(
            "progress",
            step=step,
            epoch=epoch,
            total_steps=pace.total,
            steps_per_s=pace.steps_per_s,
            remaining_s=pace.remaining_s(step),
            **{"loss": None, "lr": None, **self._values()},
        )

    def _update(self, step: int, epoch: int, *, draw: bool) -> None:
        self.step, self._epoch = step, epoch
        if self.bar is None:  # added after FitStarted
            self._open(step)
        bar = self.bar
        if bar.total != self._pace.total:
            bar.total = self._pace.total
        postfix: dict[str, Any] = {"epoch": epoch}
        values = self._values()
        if values:
            postfix["loss"] = f"{values['loss']:.4g}"
            postfix["lr"] = f"{values['lr']:.3g}"
        bar.set_postfix(postfix, refresh=False)
        if not draw:
            bar.n = max(bar.n, step)
        elif step > bar.n:
            bar.update(step - bar.n)  # to the event's step: many steps may pass per refresh
        else:
            bar.refresh()


class RuntimeEstimator(Callback):
    """Publishes ``RuntimeEstimated`` at most once per ``every_s`` seconds. See
    docs/callbacks/runtime-estimator.md.

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
        pace = _Pace(self.window)
        pace.subscribe(bus, "RuntimeEstimator")

        def publish(e: ev.StepEnded) -> None:
            rate, start = pace.steps_per_s, pace.start
            if rate is None or start is None:
                return
            remaining = pace.remaining_s(e.step)
            # The event's own monotonic time, mapped onto the wall clock for a readable ETA.
            eta = (
                None if remaining is None else time.time() - (time.monotonic() - e.time) + remaining
            )
            self.last = ev.RuntimeEstimated(
                step=e.step,
                epoch=e.epoch,
                elapsed_s=e.time - start.time,
                remaining_s=remaining,
                eta=eta,
                steps_per_s=rate,
                total_steps=pace.total,
            )
            bus.publish(self.last)

        bus.stream(ev.StepEnded).pipe(ops.throttle_first(self.every_s)).subscribe(
            publish, name="RuntimeEstimator"
        )

"""Stoppers: end the run when a metric stops improving or crosses a value, or before a time
limit."""

from __future__ import annotations

import datetime as dt
import math
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

import reactivex as rx
from reactivex import operators as ops

from .. import commands as cmd
from .. import events as ev
from .. import operators as tbops
from .._exceptions import ConfigError
from .._validate import (
    check_bool,
    check_int,
    check_metric,
    check_mode,
    check_number,
    check_seconds,
)
from ._base import Callback
from ._monitored import check_monitored, evaluations, lightning_names

if TYPE_CHECKING:
    from .._bus import EventBus
    from .._bus.commands import CommandSink
    from ._base import RunPlan

__all__ = ["EarlyStopping", "ThresholdStopping", "TimeLimit"]

# Lightning's EarlyStopping arguments that trainbus spells otherwise (monitor, mode, patience
# and min_delta are the same).
_LIGHTNING = {
    "stopping_threshold": "ThresholdStopping(monitor, below=...) (above= for mode='max')",
    "divergence_threshold": "ThresholdStopping(monitor, above=...) (below= for mode='max')",
}


class EarlyStopping(Callback):
    """Sends ``StopTraining`` once ``monitor`` has not improved for ``patience`` evaluations.
    See docs/callbacks/early-stopping.md.

    Args:
        monitor: Evaluation metric to watch (``"val_loss"``, ``"val_acc"``...).
        patience: Evaluations without improvement before stopping (>= 1).
        mode: ``"min"`` if lower is better, ``"max"`` if higher is; ``"auto"``: from the
            name (see docs/callbacks/index.md).
        min_delta: Smallest change that counts as an improvement (>= 0).
        state_key: Name of its state in checkpoints (None: ``"EarlyStopping"``).

    Raises:
        ConfigError: for an argument out of range, naming it.
        TypeError: an unknown keyword; one of Lightning's ``EarlyStopping`` names its
            trainbus equivalent (``stopping_threshold``: :class:`ThresholdStopping`).
    """

    @lightning_names("EarlyStopping", "EarlyStopping", _LIGHTNING)
    def __init__(
        self,
        monitor: str = "val_loss",
        patience: int = 3,
        mode: Literal["min", "max", "auto"] = "auto",
        min_delta: float = 0.0,
        *,
        state_key: str | None = None,
    ) -> None:
        monitor = check_metric("monitor", monitor)
        mode = check_mode(mode, monitor)
        tbops.patience(monitor, mode=mode, patience=patience, min_delta=min_delta)  # validates
        self.monitor, self.patience, self.mode, self.min_delta = monitor, patience, mode, min_delta
        self.state_key = state_key
        self.tracker = tbops.Tracker()
        """Its best value and evaluations without improvement (a fresh one each run)."""
        # The bus' back-channel, not the bus (a cycle would keep a dropped Trainer until gc).
        self._commands: CommandSink | None = None
        self._stop: cmd.StopTraining | None = None  # the stop this run decided

    def check(self, plan: RunPlan) -> None:
        """Refuse a ``monitor`` no evaluation of the run produces.

        Raises:
            ConfigError: naming ``monitor`` and the metrics the run has.
        """
        check_monitored(plan, "EarlyStopping.monitor", self.monitor, external=True)

    def setup(self, bus: EventBus) -> None:
        """Subscribe the decision pipeline to ``bus.commands``."""
        # One run, one tracker: an instance added to a second trainer starts afresh.
        tracker = self.tracker = tbops.Tracker()
        self._commands, self._stop = bus.commands, None
        evaluations(bus, self.monitor, ev.EvaluationEnded, ev.ExternalEvaluationEnded).pipe(
            tbops.patience(
                self.monitor,
                mode=self.mode,
                patience=self.patience,
                min_delta=self.min_delta,
                tracker=tracker,
            ),
            ops.do_action(self._decided),
        ).subscribe(bus.commands, name="EarlyStopping")

    def _decided(self, stop: cmd.StopTraining) -> None:
        self._stop = stop

    def state_dict(self) -> dict[str, Any]:
        """The tracker's state and the reason of the stop it decided (None: none yet)."""
        return {
            **self.tracker.state_dict(),
            "stop_reason": None if self._stop is None else self._stop.reason,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; a stop already decided is sent again unless
        ``patience`` now allows more.

        Raises:
            ConfigError: ``state`` is not a tracker state.
        """
        self.tracker.load_state_dict(state)
        reason = state.get("stop_reason")
        self._stop = None
        if isinstance(reason, str) and self.tracker.bad >= self.patience:
            self._stop = cmd.StopTraining(reason=reason)
            if self._commands is not None:  # added: the resumed run applies it first
                self._commands.send(self._stop)


Source = Literal["auto", "train", "eval"]


class ThresholdStopping(Callback):
    """Sends ``StopTraining`` the first time ``monitor`` goes above ``above`` or below ``below``.
    See docs/callbacks/stoppers.md.

    Args:
        monitor: The metric to watch.
        above: Stop when the value is greater than this.
        below: Stop when the value is less than this (give either or both; ``below < above``).
        source: ``"eval"`` (``EvaluationEnded``), ``"train"`` (``MetricsLogged``) or
            ``"auto"``: ``"eval"`` for names starting with ``val_`` or naming a set
            (``"test/acc"``), else ``"train"``.

    Raises:
        ConfigError: an invalid metric name, bound or source.
    """

    def __init__(
        self,
        monitor: str,
        *,
        above: float | None = None,
        below: float | None = None,
        source: Source = "auto",
    ) -> None:
        monitor = check_metric("monitor", monitor)
        self._decide = tbops.threshold(monitor, above=above, below=below)
        if source not in ("auto", "train", "eval"):
            raise ConfigError.invalid("source", source, "'auto', 'train' or 'eval'")
        self.monitor, self.above, self.below = monitor, above, below
        self.source: Literal["train", "eval"] = (
            source
            if source != "auto"
            else ("eval" if monitor.startswith("val_") or "/" in monitor else "train")
        )

    def check(self, plan: RunPlan) -> None:
        """Refuse a ``monitor`` its ``source`` never carries.

        Raises:
            ConfigError: naming ``monitor`` and the metrics the source has.
        """
        check_monitored(
            plan, "ThresholdStopping.monitor", self.monitor, train=self.source == "train"
        )

    def setup(self, bus: EventBus) -> None:
        """Subscribe the decision pipeline to ``bus.commands``."""
        events = (
            evaluations(bus, self.monitor, ev.EvaluationEnded)
            if self.source == "eval"
            else bus.stream(ev.MetricsLogged)
        )
        events.pipe(self._decide).subscribe(bus.commands, name="ThresholdStopping")


def _deadline_unix(deadline: object) -> float:
    if isinstance(deadline, dt.datetime):
        return deadline.timestamp()  # a naive datetime is local time, as datetime.now()
    if isinstance(deadline, int | float) and not isinstance(deadline, bool):
        if math.isfinite(deadline):
            return float(deadline)
    raise ConfigError.invalid(
        "deadline", deadline, "a datetime or a Unix timestamp (time.time() scale)"
    )


class _Clock:
    """Per event: the stop reason when the next poll point would be too close to the deadline."""

    def __init__(self, limit: TimeLimit) -> None:
        self.limit = limit
        self.deadline: float | None = None  # on the time.monotonic() scale of the events
        self.last_step_end: float | None = None
        self.longest = 0.0

    def see(self, e: ev.BaseEvent) -> str | None:
        lim = self.limit
        if isinstance(e, ev.FitStarted):
            if lim.seconds is not None:
                self.deadline = e.time + lim.seconds
            else:
                assert lim.deadline is not None
                self.deadline = lim.deadline - (time.time() - time.monotonic())
            return None
        if self.deadline is None:
            return None
        if isinstance(e, ev.StepEnded):
            gap = e.time - self.last_step_end if self.last_step_end is not None else e.duration_s
            self.last_step_end = e.time
            self.longest = max(self.longest, gap)
        # A command lands at the next poll point: the longest step gap so far bounds it.
        needed = lim.margin_s + lim.steps_margin * self.longest
        left = self.deadline - e.time
        if left > needed:
            return None
        return (
            f"time limit: {left:.1f} s left at step {e.step}, {needed:.1f} s needed to stop "
            f"cleanly (margin {lim.margin_s:g} s + {lim.steps_margin} x {self.longest:.3g} s)"
        )


class TimeLimit(Callback):
    """Saves a checkpoint and stops the run before a time limit (a cluster job's wall time).
    See docs/callbacks/stoppers.md.

    Args:
        seconds: Run time allowed, from ``FitStarted`` (> 0).
        deadline: Or: the absolute end, a ``datetime`` (naive: local time) or a Unix
            timestamp. Give exactly one of the two.
        margin_s: Seconds kept free before the limit (>= 0, below ``seconds``).
        steps_margin: Longest step gaps kept free on top (int >= 1).
        save: Send ``SaveCheckpoint(tag="time_limit")`` before ``StopTraining``.

    Raises:
        ConfigError: neither or both of ``seconds`` / ``deadline``, or an invalid value.
    """

    def __init__(
        self,
        seconds: float | None = None,
        *,
        deadline: dt.datetime | float | None = None,
        margin_s: float = 60.0,
        steps_margin: int = 2,
        save: bool = True,
    ) -> None:
        if (seconds is None) == (deadline is None):
            raise ConfigError.invalid(
                "seconds", seconds, "a number of seconds, or None with deadline= (exactly one)"
            )
        self.seconds = check_seconds("seconds", seconds) if seconds is not None else None
        self.deadline = _deadline_unix(deadline) if deadline is not None else None
        self.margin_s = check_number("margin_s", margin_s)
        self.steps_margin = check_int("steps_margin", steps_margin, 1)
        self.save = check_bool("save", save)
        if self.seconds is not None and self.margin_s >= self.seconds:
            raise ConfigError.invalid(
                "margin_s",
                margin_s,
                f"seconds kept free below seconds={seconds:g} (the default 60 is for a job's "
                f"hours; this limit would stop at once), e.g. TimeLimit({seconds:g}, "
                f"margin_s={self.seconds / 10:g})",
            )

    def setup(self, bus: EventBus) -> None:
        """Subscribe the decision pipeline to ``bus.commands``."""
        clock = _Clock(self)
        save = [cmd.SaveCheckpoint(tag="time_limit")] if self.save else []
        bus.stream(ev.FitStarted, ev.StepEnded, ev.EvaluationEnded, ev.EpochEnded).pipe(
            ops.map(clock.see),
            ops.filter(lambda reason: reason is not None),
            ops.take(1),
            ops.flat_map(lambda reason: rx.from_iterable([*save, cmd.StopTraining(reason=reason)])),
        ).subscribe(bus.commands, name="TimeLimit")

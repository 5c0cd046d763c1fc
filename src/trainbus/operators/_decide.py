"""Operators that decide: patience, plateau and threshold, each emitting a command; the first
two keep their state in a :class:`Tracker`."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, Literal

import reactivex as rx
from reactivex import Observable, abc
from reactivex import operators as ops

from .. import commands as cmd
from .. import events as ev
from .._exceptions import ConfigError
from .._validate import check_int, check_metric, check_mode, check_number

__all__ = ["Tracker", "patience", "plateau", "threshold"]

Mode = Literal["min", "max", "auto"]


class Tracker:
    """The state of a metric decision (:func:`patience`, :func:`plateau`). Pass one to the
    operator (``tracker=``) to own it: a callback saves it with :meth:`state_dict` and restores it
    on resume; without one, each subscription starts afresh.

    Attributes:
        best: The best value seen (None before any).
        best_step: The step of the event that gave ``best`` (None when unknown).
        bad: Evaluations since ``best`` last improved.
        cooling: Evaluations of cooldown left (:func:`plateau`).
        reductions: Reductions made (:func:`plateau`).
    """

    def __init__(self) -> None:
        self.best: float | None = None
        self.best_step: int | None = None
        self.bad = 0
        self.cooling = 0
        self.reductions = 0

    def update(
        self, value: float, *, mode: Mode, min_delta: float, step: int | None = None
    ) -> bool:
        """Record ``value`` (of the event at ``step``); return True when it improves on the
        best (NaN never does), which then remembers ``step`` as :attr:`best_step`."""
        if math.isnan(value):
            improved = False
        elif self.best is None:
            improved = True
        elif mode == "min":
            improved = value < self.best - min_delta
        else:
            improved = value > self.best + min_delta
        if improved:
            self.best, self.best_step, self.bad = value, step, 0
        else:
            self.bad += 1
        return improved

    def state_dict(self) -> dict[str, Any]:
        """The state as plain values (``weights_only``-safe)."""
        return {
            "best": self.best,
            "best_step": self.best_step,
            "bad": self.bad,
            "cooling": self.cooling,
            "reductions": self.reductions,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict`.

        Raises:
            ConfigError: ``state`` is not a tracker state.
        """
        try:
            best = state["best"]
            # A state saved before best_step was kept has none: the step stays unknown.
            best_step = state.get("best_step")
            values = (
                None if best is None else float(best),
                None if best_step is None else int(best_step),
                int(state["bad"]),
                int(state["cooling"]),
                int(state["reductions"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError.invalid(
                "tracker state",
                dict(state),
                "a Tracker.state_dict(): best, bad, cooling, reductions",
            ) from exc
        self.best, self.best_step, self.bad, self.cooling, self.reductions = values


def _read_metric(event: Any, name: str) -> float:
    metrics: Mapping[str, float] | None = getattr(event, "metrics", None)
    if metrics is None:
        raise ConfigError.invalid(
            "event", type(event).__name__, "an event with metrics (EvaluationEnded, MetricsLogged)"
        )
    if name not in metrics:
        raise ConfigError.invalid("metric", name, f"one of the event's metrics {sorted(metrics)}")
    return float(metrics[name])


def reads_metric(metric: str) -> Callable[[Any], bool]:
    """A predicate: False only for an ``EvaluationEnded`` of a named set other than the one
    ``metric`` (``"test/acc"``) names."""
    dataset = metric.split("/", 1)[0] if "/" in metric else None
    return lambda e: (
        dataset is None or not isinstance(e, ev.EvaluationEnded) or e.dataset == dataset
    )


def _decide(
    tracker: Tracker | None,
    name: str,
    step: Callable[[Tracker, float, Any], Any | None],
    done: Callable[[Tracker], bool],
) -> Callable[[Observable[Any]], Observable[Any]]:
    """Per subscription, emit what ``step(tracker, value of name, event)`` returns (not None)
    and complete once ``done(tracker)`` after an emission (read then: a tracker restored after
    subscribing counts). ``tracker`` None: a fresh one per subscription."""
    if tracker is not None and not isinstance(tracker, Tracker):
        raise ConfigError.invalid("tracker", tracker, "a trainbus.operators.Tracker or None")

    def _operator(source: Observable[Any]) -> Observable[Any]:
        def subscribed(_: abc.SchedulerBase) -> Observable[Any]:
            state = tracker if tracker is not None else Tracker()
            return source.pipe(
                ops.filter(reads_metric(name)),  # a named set's metric: that set's evaluations
                ops.map(lambda event: step(state, _read_metric(event, name), event)),
                ops.filter(lambda out: out is not None),
                ops.take_while(lambda _: not done(state), inclusive=True),
            )

        return rx.defer(subscribed)

    return _operator


def patience(
    metric: str,
    *,
    mode: Mode = "auto",
    patience: int = 3,
    min_delta: float = 0.0,
    tracker: Tracker | None = None,
) -> Callable[[Observable[Any]], Observable[cmd.StopTraining]]:
    """Early stopping: emit ``StopTraining`` once ``metric`` has not improved for ``patience``
    evaluations in a row, then complete. NaN never counts as an improvement.

    ::

        val_loss:           -3-2-2-2-2---
        patience(p=3):      ---------S|      S = StopTraining(reason="early stopping: ...")

    Args:
        metric: Key in the events' ``metrics`` (``"val_loss"``); a named set's (``"test/acc"``)
            reads only that set's evaluations.
        mode: ``"min"`` if lower is better, ``"max"`` otherwise, ``"auto"``: from the metric's
            name, as the callbacks (docs/callbacks/index.md).
        patience: Evaluations without improvement before stopping (>= 1).
        min_delta: Smallest change that counts as an improvement (>= 0).
        tracker: Keep the best value and the patience counter in this :class:`Tracker` (so
            its owner can save and restore them); None: a fresh one per subscription.

    Raises:
        ConfigError: for an argument out of range (eagerly); the stream errors with a
            ``ConfigError`` when an event lacks the metric.
    """
    metric = check_metric("metric", metric)
    mode = check_mode(mode, metric)
    patience = check_int("patience", patience, 1)
    min_delta = check_number("min_delta", min_delta)

    def step(tracker: Tracker, value: float, event: Any) -> cmd.StopTraining | None:
        now = getattr(event, "step", None)
        tracker.update(value, mode=mode, min_delta=min_delta, step=now)
        if tracker.bad < patience:
            return None
        at = "" if tracker.best_step is None else f" at step {tracker.best_step}"
        # With min_delta a value better than the best may still not count: say by how much.
        by = f" by more than min_delta={min_delta!r}" if min_delta else ""
        return cmd.StopTraining(
            reason=(
                f"early stopping: {metric} did not improve{by} for {patience} evaluation"
                f"{'s' if patience > 1 else ''} "
                f"(best {tracker.best!r}{at}; {value!r} at step {now})"
            )
        )

    return _decide(tracker, metric, step, lambda _: True)


def plateau(
    metric: str,
    *,
    mode: Mode = "auto",
    patience: int = 2,
    factor: float = 0.1,
    min_delta: float = 0.0,
    cooldown: int = 0,
    max_reductions: int | None = None,
    tracker: Tracker | None = None,
) -> Callable[[Observable[Any]], Observable[cmd.ScaleLearningRate]]:
    """Reduce the LR on a plateau: emit ``ScaleLearningRate(factor)`` each time ``metric`` has
    not improved for ``patience`` evaluations; then wait ``cooldown`` evaluations before
    counting again (like ``torch.optim.lr_scheduler.ReduceLROnPlateau``).

    ::

        val_loss:           -3-2-2-2-2-2-
        plateau(p=2):       -------R---R-       R = ScaleLearningRate(factor)

    Args:
        metric: Key in the events' ``metrics``.
        mode: ``"min"``, ``"max"`` or ``"auto"`` (from the metric's name).
        patience: Evaluations without improvement before a reduction (>= 1).
        factor: Multiplier applied to the LR, in (0, 1).
        min_delta: Smallest change that counts as an improvement.
        cooldown: Evaluations ignored after a reduction.
        max_reductions: Stop (complete) after this many reductions; None for no limit.
        tracker: Keep the best value and the counters (reductions included) in this
            :class:`Tracker`; None: a fresh one per subscription.

    Raises:
        ConfigError: for an argument out of range.
    """
    metric = check_metric("metric", metric)
    mode = check_mode(mode, metric)
    patience = check_int("patience", patience, 1)
    cooldown = check_int("cooldown", cooldown, 0)
    min_delta = check_number("min_delta", min_delta)
    if not isinstance(factor, int | float) or not 0 < factor < 1:
        raise ConfigError.invalid("factor", factor, "a number in (0, 1)")
    if max_reductions is not None:
        max_reductions = check_int("max_reductions", max_reductions, 1)

    def step(tracker: Tracker, value: float, event: Any) -> cmd.ScaleLearningRate | None:
        if done(tracker):  # a restored tracker that already made every reduction
            return None
        improved = tracker.update(
            value, mode=mode, min_delta=min_delta, step=getattr(event, "step", None)
        )
        if tracker.cooling > 0:
            tracker.cooling -= 1
            tracker.bad = 0
            return None
        if improved or tracker.bad < patience:
            return None
        tracker.bad = 0
        tracker.cooling = cooldown
        tracker.reductions += 1
        return cmd.ScaleLearningRate(factor=float(factor))

    def done(tracker: Tracker) -> bool:
        return max_reductions is not None and tracker.reductions >= max_reductions

    return _decide(tracker, metric, step, done)


def threshold(
    metric: str, *, above: float | None = None, below: float | None = None
) -> Callable[[Observable[Any]], Observable[cmd.StopTraining]]:
    """Emit ``StopTraining`` the first time ``metric`` goes above ``above`` or below ``below``,
    then complete. NaN crosses nothing.

    ::

        val_acc:                  -0.5-0.8-0.96-0.97-
        threshold(above=0.95):    ----------S|         S = StopTraining(reason="threshold: ...")

    Args:
        metric: Key in the events' ``metrics`` (``"val_acc"``, ``"loss"``).
        above: Stop once the value is strictly greater than this.
        below: Stop once the value is strictly less than this. Give either or both.

    Raises:
        ConfigError: no bound, a bound that is not a finite number, or ``below >= above``
            (eagerly); the stream errors with a ``ConfigError`` naming the metric and the
            metrics available when an event lacks it.
    """
    metric = check_metric("metric", metric)
    if above is None and below is None:
        raise ConfigError.invalid("above", None, "a number (or give below=)")
    for name, value in (("above", above), ("below", below)):
        finite = isinstance(value, int | float) and not isinstance(value, bool)
        if value is not None and not (finite and math.isfinite(value)):
            raise ConfigError.invalid(name, value, "a finite number")
    hi = None if above is None else float(above)
    lo = None if below is None else float(below)
    if hi is not None and lo is not None and lo >= hi:
        raise ConfigError.invalid("below", lo, f"a number less than above={hi!r}")

    def step(_: Tracker, value: float, event: Any) -> cmd.StopTraining | None:
        if hi is not None and value > hi:
            side, bound = "above", hi
        elif lo is not None and value < lo:
            side, bound = "below", lo
        else:
            return None
        at = getattr(event, "step", "?")
        return cmd.StopTraining(
            reason=f"threshold: {metric}={value:.6g} went {side} {bound:g} at step {at}"
        )

    return _decide(None, metric, step, lambda _: True)

"""Learning-rate built-ins: reduce it on a plateau, and log every change."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

import structlog
from reactivex import operators as ops

from .. import commands as cmd
from .. import events as ev
from .. import operators as tbops
from .._validate import check_metric, check_mode
from ._base import Callback
from ._monitored import check_monitored, evaluations

if TYPE_CHECKING:
    from .._bus import EventBus
    from ._base import RunPlan

__all__ = ["LearningRateMonitor", "ReduceLROnPlateau"]


class ReduceLROnPlateau(Callback):
    """Multiplies the learning rate by ``factor`` when ``monitor`` stops improving. See
    docs/callbacks/reduce-lr-on-plateau.md.

    Args:
        monitor: Evaluation metric to watch.
        patience: Evaluations without improvement before a reduction (>= 1).
        factor: Multiplier in (0, 1).
        mode: ``"min"`` if lower is better, ``"max"`` if higher is; ``"auto"``: from the
            name (see docs/callbacks/index.md).
        min_delta: Smallest change that counts as an improvement (>= 0).
        cooldown: Evaluations ignored after a reduction (>= 0).
        max_reductions: Reduce at most this many times (None: no limit).
        state_key: Name of its state in checkpoints (None: ``"ReduceLROnPlateau"``).

    Raises:
        ConfigError: for an argument out of range, naming it.
    """

    def __init__(
        self,
        monitor: str = "val_loss",
        patience: int = 2,
        factor: float = 0.5,
        mode: Literal["min", "max", "auto"] = "auto",
        min_delta: float = 0.0,
        cooldown: int = 0,
        max_reductions: int | None = None,
        *,
        state_key: str | None = None,
    ) -> None:
        monitor = check_metric("monitor", monitor)
        mode = check_mode(mode, monitor)
        self._options: dict[str, Any] = dict(
            mode=mode,
            patience=patience,
            factor=factor,
            min_delta=min_delta,
            cooldown=cooldown,
            max_reductions=max_reductions,
        )
        tbops.plateau(monitor, **self._options)  # validates now
        self.monitor, self.patience, self.factor, self.mode = monitor, patience, factor, mode
        self.state_key = state_key
        self.tracker = tbops.Tracker()
        """Its best value, counters and reductions made (a fresh one each run)."""

    def check(self, plan: RunPlan) -> None:
        """Refuse a ``monitor`` no evaluation of the run produces.

        Raises:
            ConfigError: no ``eval_data``, or ``monitor`` is not among its metrics.
        """
        check_monitored(plan, "ReduceLROnPlateau.monitor", self.monitor)

    def setup(self, bus: EventBus) -> None:
        """Subscribe the decision pipeline to ``bus.commands``."""
        tracker = self.tracker = tbops.Tracker()
        evaluations(bus, self.monitor, ev.EvaluationEnded).pipe(
            tbops.plateau(self.monitor, tracker=tracker, **self._options),
        ).subscribe(bus.commands, name="ReduceLROnPlateau")

    def state_dict(self) -> dict[str, Any]:
        """The tracker's state (best value, counters, reductions made)."""
        return self.tracker.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (before the resumed run's first evaluation).

        Raises:
            ConfigError: ``state`` is not a tracker state.
        """
        self.tracker.load_state_dict(state)


_LR_COMMANDS = (cmd.SetLearningRate, cmd.ScaleLearningRate)


class LearningRateMonitor(Callback):
    """Logs learning-rate changes (``lr_changed``, ``lr_command_applied``) with the
    ``"trainbus"`` structlog logger. See docs/callbacks/learning-rate-monitor.md.

    Attributes:
        history: ``(step, lr)`` of every change seen, in order (the last run's).
    """

    def __init__(self) -> None:
        self.history: list[tuple[int, float]] = []

    def setup(self, bus: EventBus) -> None:
        """Subscribe the two logging pipelines."""
        log = structlog.get_logger("trainbus")
        history = self.history = []

        def changed(e: ev.SchedulerStepped | ev.StepEnded) -> None:
            previous = history[-1][1] if history else None
            history.append((e.step, e.lr))
            log.info("lr_changed", step=e.step, epoch=e.epoch, lr=e.lr, previous=previous)

        def applied(e: ev.CommandApplied) -> None:
            c = e.command
            fields = {"lr": c.lr} if isinstance(c, cmd.SetLearningRate) else {"factor": c.factor}  # type: ignore[union-attr]
            level = log.warning if e.error is not None else log.info
            level(
                "lr_command_applied",
                step=e.step,
                epoch=e.epoch,
                command=type(c).__name__,
                **fields,
                param_group=c.param_group,  # type: ignore[union-attr]
                error=None if e.error is None else repr(e.error),
            )

        bus.stream(ev.SchedulerStepped, ev.StepEnded).pipe(
            ops.distinct_until_changed(lambda e: e.lr),
        ).subscribe(changed, name="LearningRateMonitor.lr_changed")
        bus.stream(ev.CommandApplied).pipe(
            ops.filter(lambda e: isinstance(e.command, _LR_COMMANDS)),
        ).subscribe(applied, name="LearningRateMonitor.lr_command_applied")

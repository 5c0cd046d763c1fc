"""Optuna pruning from the bus: :class:`OptunaPruning` (``pip install 'trainbus[optuna]'``).
See docs/sweeps.md."""

from __future__ import annotations

import math
import weakref
from typing import TYPE_CHECKING, Any, ClassVar

from reactivex.abc import DisposableBase

from .. import commands as cmd
from .. import events as ev
from .._bus.subscriptions import RankFilter, env_rank
from .._exceptions import ConfigError, MissingExtraError, TrainbusError
from .._log import get_logger
from .._validate import check_metric
from ..callbacks._base import Callback, RunPlan, SubscribeOptions
from ..callbacks._monitored import reads_metric

if TYPE_CHECKING:
    from .._bus import EventBus
    from .._loop.result import FitResult

__all__ = ["OptunaPruning", "PrunerError"]

log = get_logger(__name__)

PRUNED = "pruned"
"""The ``StopTraining.reason`` of a pruned trial (``Ending.PRUNED``)."""


class PrunerError(TrainbusError, RuntimeError):
    """The study's pruner (``trial.should_prune()``) or ``trial.report()`` raised; the original
    exception is the ``__cause__``."""


class OptunaPruning(Callback):
    """Reports ``monitor`` to an Optuna trial, prunes it through the bus, ends it PRUNED (under
    torchrun, see docs/sweeps.md).

    Args:
        trial: The objective's ``optuna.Trial`` (any ``optuna.trial.BaseTrial``); ``None`` on
            the ranks other than 0 under torchrun (``RANK`` set and not 0).
        monitor: The metric to report: a key of ``EvaluationEnded.metrics`` (``"val_loss"``,
            ``"test/acc"``) or of ``MetricsLogged.metrics`` (``"loss"``, or a value logged
            from anywhere).

    Raises:
        MissingExtraError: optuna is not installed (names ``pip install 'trainbus[optuna]'``).
        ConfigError: ``trial`` is not an Optuna trial (nor None on a rank other than 0), or
            ``monitor`` is not a non-empty str. During the run (which fails with it): a
            ``monitor`` no evaluation or log window carries.
        PrunerError: during the run, the pruner or ``trial.report`` raised.
        optuna.TrialPruned: from ``fit()`` after a pruned run (:meth:`after_fit`).
    """

    subscribe_options: ClassVar[SubscribeOptions] = SubscribeOptions(on_error="raise")

    def __init__(self, trial: Any, monitor: str = "val_loss") -> None:
        try:  # imported here: trainbus never needs optuna unless this callback is used
            import optuna
        except ImportError as exc:
            raise MissingExtraError("OptunaPruning", "optuna", "optuna") from exc
        if trial is None and env_rank() != 0:
            pass  # under torchrun the trial lives on rank 0, where this callback decides
        elif not isinstance(trial, optuna.trial.BaseTrial):
            raise ConfigError.invalid(
                "trial",
                type(trial).__name__,
                "an optuna.Trial (the argument Optuna passes to the "
                "objective); None only on the ranks other than 0 "
                "under torchrun",
            )
        self.trial = trial
        self.monitor = check_metric("monitor", monitor)
        self._pruned_exc: type[BaseException] = optuna.TrialPruned
        self._reads = reads_metric(monitor)
        self._bus: weakref.ref[EventBus] | None = None
        self._decides: DisposableBase | None = None
        self._known: set[str] = set()  # metric names seen in this run's events
        self._train_names: frozenset[str] = frozenset()
        self._found = False
        self._checked = False
        self._evaluated = False  # a training evaluation round ended
        self._logged = False  # a MetricsLogged came
        self._reported: set[int] = set()
        self.pruned_at: int | None = None
        """The step at which the pruner said prune (None: not pruned)."""

    def setup(self, bus: EventBus) -> None:
        """Keep the bus, weakly (it holds this callback: no cycle)."""
        self._bus = weakref.ref(bus)

    def check(self, plan: RunPlan) -> None:
        """Declare the log steps as decision steps when ``monitor`` may come in
        ``MetricsLogged``."""
        self._known, self._found, self._checked, self.pruned_at = set(), False, False, None
        self._evaluated = self._logged = False
        self._train_names = plan.train_metrics
        if self._decides is not None:
            self._decides.dispose()
            self._decides = None
        log_every = plan.config.get("log_every")
        bus = None if self._bus is None else self._bus()
        if self.monitor not in plan.eval_metrics and bus is not None and isinstance(log_every, int):
            self._decides = bus.declare_decision_steps(every=log_every)

    def on_metrics_logged(self, event: ev.MetricsLogged) -> None:
        """Report ``monitor`` when this window carries it."""
        self._known.update(event.metrics)
        self._logged = True
        if self.monitor in event.metrics:
            self._report(event.metrics[self.monitor], event.step)
        if self._evaluated and not self._checked:
            self._check_exists(f"the first evaluation and the first log window (step {event.step})")

    def on_evaluation_ended(self, event: ev.EvaluationEnded) -> None:
        """Report ``monitor`` when this evaluation carries it (a barrier: decided here)."""
        if event.error is not None or not self._reads(event):
            return
        self._known.update(event.metrics)
        if self.monitor in event.metrics:
            self._report(event.metrics[self.monitor], event.step)

    def on_evaluation_round_ended(self, event: ev.EvaluationRoundEnded) -> None:
        """At the first round (once a log window closed too): ``ConfigError`` when ``monitor``
        appeared in neither."""
        if self._checked or event.error is not None or event.trigger == "standalone":
            return
        self._evaluated = True
        self._known.update(event.metrics)
        if self._logged:
            self._check_exists(
                f"the first evaluation (step {event.step}) and the log windows before it"
            )

    def _check_exists(self, where: str) -> None:
        self._checked = True
        if not self._found and self.monitor not in self._train_names | self._known:
            raise ConfigError.invalid(
                "OptunaPruning.monitor",
                self.monitor,
                f"a metric of the run's evaluations or MetricsLogged; {where} found none of "
                "that name; metrics that exist: "
                + (", ".join(sorted(self._train_names | self._known)) or "none"),
            )

    def on_fit_ended(self, event: ev.FitEnded) -> None:
        """The run ended: release the decision steps."""
        if self._decides is not None:
            self._decides.dispose()
            self._decides = None

    def after_fit(self, result: FitResult) -> None:
        """After a run this callback pruned, end ``fit()`` with ``optuna.TrialPruned``.

        Raises:
            optuna.TrialPruned: the pruner said prune and the run ended ``Ending.PRUNED``.
            ConfigError: a run without an evaluation or a log window never saw ``monitor``.
        """
        bus = None if self._bus is None else self._bus()
        if bus is not None and not RankFilter(bus.rank).runs_here(self.ranks):
            return  # a rank other than 0: its subscribers did not run, rank 0 decided
        if not self._checked and result.ending in (ev.Ending.COMPLETED, ev.Ending.STOPPED):
            self._check_exists("the whole run")
        if self.pruned_at is not None and result.ending is ev.Ending.PRUNED:
            raise self._pruned_exc(
                f"trainbus: trial {getattr(self.trial, 'number', '?')} "
                f"pruned at step {self.pruned_at} on {self.monitor}; the "
                f"run stopped at step {result.steps}"
            )

    def _report(self, value: float, step: int) -> None:
        self._found = True
        if step in self._reported or self.pruned_at is not None:
            return  # one value per step (an evaluation and a log window of one step)
        self._reported.add(step)
        try:
            self.trial.report(float(value), step)
            prune = bool(self.trial.should_prune())
        except Exception as exc:
            raise PrunerError(
                f"OptunaPruning: reporting {self.monitor}={value} at step {step} to trial "
                f"{getattr(self.trial, 'number', '?')} failed: {type(exc).__name__}: {exc} "
                "(the study's pruner or storage raised)"
            ) from exc
        log.debug("optuna_reported", step=step, metric=self.monitor, value=value, prune=prune)
        if prune:
            self.pruned_at = step
            bus = None if self._bus is None else self._bus()
            assert bus is not None  # added: the bus delivers this very event
            bus.send(cmd.StopTraining(reason=PRUNED))
            log.info(
                "trial_pruned",
                step=step,
                metric=self.monitor,
                value=value if math.isfinite(value) else str(value),
                trial=getattr(self.trial, "number", None),
            )

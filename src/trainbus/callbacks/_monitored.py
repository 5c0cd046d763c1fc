"""Metric monitors: which evaluation events they read, what they check, the tracker they keep.

With ``eval_data={"val": a, "test": b}`` each set's ``EvaluationEnded`` carries only its own
keys (``val/loss``, ``test/acc``). A monitor of ``"test/acc"`` reads the ``test`` set's events
and skips the others; a monitor of a name without ``/`` (``"val_loss"``) reads every evaluation,
so a name no set has still fails loudly with the keys the event does have.

A monitor's ``mode="auto"`` is resolved once, at construction, by ``_validate.check_mode``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from reactivex import operators as ops

from .. import events as ev
from .._exceptions import ConfigError
from .._validate import explains_unknown_keywords, unknown_keyword_message
from ..operators._decide import reads_metric

if TYPE_CHECKING:
    from .._bus import EventBus
    from ..bus import BusObservable
    from ._base import RunPlan

__all__ = [
    "check_monitored",
    "evaluations",
    "lightning_names",
    "reads_metric",
]

P = ParamSpec("P")
R = TypeVar("R")


def evaluations(
    bus: EventBus, metric: str, *types: type[ev.EvaluationEnded | ev.ExternalEvaluationEnded]
) -> BusObservable[Any]:
    """The evaluations of ``types`` a monitor of ``metric`` reads: those without error, of
    ``EvaluationEnded`` the metric's own set's, of ``ExternalEvaluationEnded`` those carrying
    it (a job may score other metrics)."""
    reads = reads_metric(metric)

    def read(e: Any) -> bool:
        if e.error is not None:
            return False
        return metric in e.metrics if isinstance(e, ev.ExternalEvaluationEnded) else reads(e)

    found: BusObservable[Any] = bus.stream(*types).pipe(ops.filter(read))
    return found


def check_monitored(
    plan: RunPlan, option: str, metric: str, *, external: bool = False, train: bool = False
) -> None:
    """``ConfigError`` naming ``option`` (``"EarlyStopping.monitor"``) when nothing in ``plan``
    produces ``metric``: its evaluations, evaluation jobs (``external``) or its training
    metrics (``train``)."""
    if train:
        if metric not in plan.train_metrics:
            raise ConfigError.invalid(option, metric, "a training metric of MetricsLogged: "
                                      + ", ".join(sorted(plan.train_metrics)))  # fmt: skip
        return
    if plan.eval_metrics:
        if metric not in plan.eval_metrics:
            raise ConfigError.invalid(
                option, metric, "a metric this run's evaluation produces: "
                + ", ".join(sorted(plan.eval_metrics)) + " (the metrics= functions, per set)",
            )  # fmt: skip
        return
    if external and plan.external_evaluations:
        return  # only the evaluation jobs know their metrics' names
    jobs = " or add EvaluateCheckpoints" if external else ""
    raise ConfigError.invalid(
        option, metric, f"a metric some evaluation produces, but this run has no eval_data: "
        f"give the Trainer eval_data{jobs}, or remove the callback",
    )  # fmt: skip


def lightning_names(
    owner: str, lightning: str, table: Mapping[str, str]
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorate ``owner``'s ``__init__``: an unknown keyword is a ``TypeError`` that names its
    trainbus spelling when ``table`` has it as an argument of Lightning's ``lightning``."""

    def message(name: str, value: Any, known: list[str]) -> str:
        use = table.get(name)
        hint = use and f"that is Lightning's {lightning}({name}=); in trainbus: {use}"
        return unknown_keyword_message(owner, name, known, hint)

    return explains_unknown_keywords(message)

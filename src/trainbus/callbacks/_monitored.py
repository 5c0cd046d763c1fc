"""Metric monitors: which evaluation events they read and what they check before a run."""

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
    """The evaluations of ``types`` without error that a monitor of ``metric`` reads (its own
    set's; of the evaluation jobs, those carrying it). A standalone ``evaluate()`` is not one
    of the run's: no step is left for what a monitor would send."""
    reads = reads_metric(metric)

    def read(e: Any) -> bool:
        if e.error is not None:
            return False
        if isinstance(e, ev.ExternalEvaluationEnded):
            return metric in e.metrics
        return e.trigger != "standalone" and reads(e)

    found: BusObservable[Any] = bus.stream(*types).pipe(ops.filter(read))
    return found


def check_monitored(
    plan: RunPlan, option: str, metric: str, *, external: bool = False, train: bool = False
) -> None:
    """``ConfigError`` naming ``option`` when nothing in ``plan`` produces ``metric``: its
    evaluations, evaluation jobs (``external``) or training metrics (``train``)."""
    if train:
        if metric not in plan.train_metrics:
            raise ConfigError.invalid(
                option,
                metric,
                "a training metric of MetricsLogged: " + ", ".join(sorted(plan.train_metrics)),
            )
        return
    if plan.eval_metrics:
        if metric not in plan.eval_metrics:
            raise ConfigError.invalid(
                option,
                metric,
                "a metric this run's evaluation produces: "
                + ", ".join(sorted(plan.eval_metrics))
                + " (the metrics= functions, per set)",
            )
        return
    if external and plan.external_evaluations:
        return  # only the evaluation jobs know their metrics' names
    jobs = " or add EvaluateCheckpoints" if external else ""
    raise ConfigError.invalid(
        option,
        metric,
        f"a metric some evaluation produces, but this run has no eval_data: "
        f"give the Trainer eval_data{jobs}, or remove the callback",
    )


def lightning_names(
    owner: str, lightning: str, table: Mapping[str, str]
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorate ``owner``'s ``__init__``: an unknown keyword that ``table`` has (an argument
    of Lightning's ``lightning``) is a ``TypeError`` naming its trainbus spelling."""

    def message(name: str, value: Any, known: list[str]) -> str:
        use = table.get(name)
        hint = use and f"that is Lightning's {lightning}({name}=); in trainbus: {use}"
        return unknown_keyword_message(owner, name, known, hint)

    return explains_unknown_keywords(message)

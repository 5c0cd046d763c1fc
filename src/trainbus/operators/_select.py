"""Operators that pick events: by type, by step (``every``, ``once``), a metric's values."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar, overload

from reactivex import Observable
from reactivex import operators as ops

from .._bus.commands import At, DecisionSteps, Every
from .._exceptions import ConfigError
from .._validate import check_int, check_metric

__all__ = ["DecisionOperator", "every", "metric", "of_type", "once"]

_T = TypeVar("_T")
_E = TypeVar("_E")
_E2 = TypeVar("_E2")


@overload
def of_type(t: type[_E], /) -> Callable[[Observable[Any]], Observable[_E]]: ...
@overload
def of_type(t: type[_E], t2: type[_E2], /) -> Callable[[Observable[Any]], Observable[_E | _E2]]: ...
@overload
def of_type(*types: type) -> Callable[[Observable[Any]], Observable[Any]]: ...
def of_type(*types: type) -> Callable[[Observable[Any]], Observable[Any]]:
    """Keep items that are instances of ``types``; the result is typed accordingly.

    ::

        source:             -A-b-A-c-|
        of_type(A):         -A---A---|

    Raises:
        ConfigError: no type, or something that is not a class.
    """
    if not types or not all(isinstance(t, type) for t in types):
        raise ConfigError.invalid("types", types, "one or more classes")
    return ops.filter(lambda x: isinstance(x, types))


class DecisionOperator(Generic[_T]):
    """An operator that declares decision steps: subscribed on a bus stream, the loop applies the
    pipeline's commands at exactly those steps (docs/events.md, "When a command takes effect").

    Args:
        operator: The operator itself.
        decision_steps: The steps at which its items pass.
    """

    __slots__ = ("_operator", "decision_steps")

    def __init__(
        self, operator: Callable[[Observable[_T]], Observable[_T]], decision_steps: DecisionSteps
    ) -> None:
        self._operator = operator
        self.decision_steps = decision_steps

    def __call__(self, source: Observable[_T]) -> Observable[_T]:
        return self._operator(source)

    def __repr__(self) -> str:
        return f"<DecisionOperator {self.decision_steps!r}>"


def _step_of(event: Any) -> int:
    step = getattr(event, "step", None)
    if type(step) is not int:
        raise ConfigError.invalid(
            "item",
            event,
            "an event with a step (put every/once before operators that map events to values)",
        )
    return step


def every(n: int) -> DecisionOperator[_T]:
    """Keep the events of every ``n``-th step (``step % n == 0``: n, 2n, ...).

    ::

        source (steps):     -1-2-3-4-5-6-|
        every(3):           -----3-----6-|

    Step-based, not counting items: a resumed run, or one whose hooks skipped steps, passes the
    same steps. On a bus stream it declares the decision steps ``Every(n)``: commands the
    pipeline sends are applied at exactly that step.

    Raises:
        ConfigError: ``n`` is not an int >= 1 (eagerly); the stream errors with a
            ``ConfigError`` on an item without an int ``step``.
    """
    n = check_int("n", n, 1)

    def _every(source: Observable[_T]) -> Observable[_T]:
        return source.pipe(ops.filter(lambda e: _step_of(e) % n == 0))

    return DecisionOperator(_every, Every(n))


def once(
    at: int | Callable[[Any], bool] | None = None,
) -> Callable[[Observable[_T]], Observable[_T]]:
    """Emit the first matching item, then complete.

    ``at=None``: the first item; ``at=k`` (int): the first event whose ``step >= k`` (on a bus
    stream this declares the decision step ``At(k)``); ``at=predicate``: the first item the
    predicate accepts.

    ::

        source (steps):     -1-2-3-4-|
        once(at=3):         -----3|

    Raises:
        ConfigError: ``at`` is a negative int, or neither int, callable nor None.
    """

    # filter + take(1), not ops.first: first() errors when the source completes without a
    # match (a run ending before step k would count a subscriber failure).
    def first(predicate: Callable[[Any], bool]) -> Callable[[Observable[_T]], Observable[_T]]:
        return lambda source: source.pipe(ops.filter(predicate), ops.take(1))

    if at is None:
        return ops.take(1)
    if isinstance(at, int) and not isinstance(at, bool):
        step = check_int("at", at, 0)
        declaring: DecisionOperator[Any] = DecisionOperator(
            first(lambda e: e.step >= step), At(step)
        )
        return declaring
    if callable(at):
        return first(at)
    raise ConfigError.invalid("at", at, "None, a step (int >= 0) or a predicate")


def metric(name: str) -> Callable[[Observable[Any]], Observable[float]]:
    """Map events carrying ``metrics`` (``EvaluationEnded``, ``MetricsLogged``) to one value.

    Events without the metric are skipped.

    ::

        source:             -{loss:2}-{acc:1}-{loss:1}-|
        metric("loss"):     -2-----------------1-------|
    """
    name = check_metric("metric", name)

    def has(e: Any) -> bool:
        return name in getattr(e, "metrics", {})

    def read(e: Any) -> float:
        return float(e.metrics[name])

    def _metric(source: Observable[Any]) -> Observable[float]:
        return source.pipe(ops.filter(has), ops.map(read))

    return _metric

"""Rx operators for training streams.

Each operator is a plain function returning ``Callable[[Observable[A]], Observable[B]]``, for use
in ``pipe(...)``. Arguments are validated when the operator is built, so a typo fails where it was
written, not inside the event loop. State lives per subscription: one operator object can serve
several pipelines.

Marble diagrams read left to right in time; ``|`` is completion.
"""

from .._moved import renamed
from ._decide import Tracker, patience, plateau, threshold
from ._select import DecisionOperator, every, metric, of_type, once
from ._spans import Span, span_durations

__all__ = [
    "DecisionOperator",
    "Span",
    "Tracker",
    "every",
    "metric",
    "of_type",
    "once",
    "patience",
    "plateau",
    "span_durations",
    "threshold",
]


def __getattr__(name: str) -> object:
    """A renamed operator (``Scheduled``): an ``AttributeError`` naming what it is now."""
    raise renamed(__name__, name)

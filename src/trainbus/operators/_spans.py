"""Operators over span events: the duration of each phase span."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import reactivex as rx
from reactivex import Observable, abc
from reactivex import operators as ops

from .. import events as ev
from .._exceptions import ConfigError

__all__ = ["Span", "span_durations"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Span:
    """A matched ``XStarted`` / ``XEnded`` pair.

    Attributes:
        start: The start event.
        end: The end event (its ``error`` holds the exception of a failed span).
        duration_s: ``end.time - start.time``.
    """

    start: ev.BaseEvent
    end: ev.BaseEvent
    duration_s: float


def span_durations(
    start: type[ev.BaseEvent] | None = None, end: type[ev.BaseEvent] | None = None
) -> Callable[[Observable[Any]], Observable[Span]]:
    """Pair each ``XStarted`` event with its ``XEnded`` event and emit their :class:`Span`.

    ``start=None`` times every span of :data:`trainbus.events.SPANS`; ``start=X`` only that kind,
    ``end`` defaulting to its partner (or any event class). Nested spans of one kind pair
    innermost first; an end without a start is dropped.

    ::

        source:             -S---E--S-E-|
        span_durations(S):  -----x----y-|     x, y = Span(start, end, duration_s)

        source:             -E-B-b-e-|        E/e EpochStarted/Ended, B/b EvalBatchStarted/Ended
        span_durations():   -----x-y-|        x = eval batch span, y = epoch span

    Raises:
        ConfigError: ``start`` is not a span start (without ``end``), or ``end`` is not an
            event class.
    """
    pairs: dict[type[ev.BaseEvent], type[ev.BaseEvent]]
    if start is None:
        if end is not None:
            raise ConfigError.invalid("end", end, "None when start is None (all of ev.SPANS)")
        pairs = dict(ev.SPANS)
    else:
        if end is None:
            if start not in ev.SPANS:
                raise ConfigError.invalid(
                    "start", start, f"one of {[t.__name__ for t in ev.SPANS]} or give end="
                )
            end = ev.SPANS[start]
        if not (isinstance(end, type) and issubclass(end, ev.BaseEvent)):
            raise ConfigError.invalid("end", end, "an event class")
        pairs = {start: end}
    ends = {e: s for s, e in pairs.items()}
    starts = tuple(pairs)

    def _spans(source: Observable[Any]) -> Observable[Span]:
        def subscribed(_: abc.SchedulerBase) -> Observable[Span]:
            opened: dict[type[ev.BaseEvent], list[ev.BaseEvent]] = {s: [] for s in starts}

            def pair(event: Any) -> Span | None:
                kind = type(event)
                if kind in pairs:
                    opened[kind].append(event)
                if kind not in ends or not opened[ends[kind]]:
                    return None
                first = opened[ends[kind]].pop()
                return Span(start=first, end=event, duration_s=event.time - first.time)

            found: Observable[Span | None] = source.pipe(ops.map(pair))
            return found.pipe(ops.filter(bool))  # type: ignore[arg-type]

        return rx.defer(subscribed)

    return _spans

"""The opt-in trace: each part of a step ``Trainer(trace=...)`` names
(:data:`~trainbus.events.TRACED_SPANS`) timed and published as one ``SpanTraced``.
"""

from __future__ import annotations

import time
from types import TracebackType
from typing import TYPE_CHECKING

from .. import events as ev

if TYPE_CHECKING:
    from .._bus import LoopPort
    from ..checkpoint import TrainState

__all__ = ["Tracer"]


class _Off:
    """The context of a part nobody traces: does nothing."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_OFF = _Off()


class _Timed:
    """The context of one traced part: publishes its ``SpanTraced`` when it ends."""

    __slots__ = ("_event", "_port", "_started")

    def __init__(self, port: LoopPort, event: dict[str, object]) -> None:
        self._port, self._event = port, event
        self._started = time.monotonic()

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._port.publish(
            ev.SpanTraced(started=self._started, ended=time.monotonic(), error=exc,
                          **self._event)  # type: ignore[arg-type]
        )  # fmt: skip


class Tracer:
    """Times the parts ``Trainer(trace=...)`` names while someone subscribes to ``SpanTraced``
    (``on``, read at :meth:`refresh`)."""

    __slots__ = ("_port", "_spans", "_state", "on")

    def __init__(self, port: LoopPort, state: TrainState, spans: frozenset[str]) -> None:
        self._port, self._state, self._spans = port, state, spans
        self.on = False

    def refresh(self) -> None:
        """Re-read whether anyone wants ``SpanTraced`` (the routes changed)."""
        self.on = bool(self._spans) and self._port.wants(ev.SpanTraced)

    def __call__(
        self,
        span: ev.TracedSpan,
        phase: ev.Phase = "train",
        batch_index: int | None = None,
        micro_batch: int | None = None,
        dataset: str | None = None,
    ) -> _Off | _Timed:
        """The context that times ``span`` (a do-nothing one when it is not traced)."""
        if not self.on or span not in self._spans:
            return _OFF
        st = self._state
        return _Timed(self._port, {"step": st.step, "epoch": st.epoch, "span": span,
                                   "phase": phase, "batch_index": batch_index,
                                   "micro_batch": micro_batch, "dataset": dataset})  # fmt: skip

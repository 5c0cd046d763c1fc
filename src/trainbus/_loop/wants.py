"""Which per-step events someone listens to (cached until the doorbell rings), and the
opt-in trace: each part ``Trainer(trace=...)`` names published as one ``SpanTraced``."""

from __future__ import annotations

import contextlib
import time
from types import TracebackType
from typing import TYPE_CHECKING

from .. import events as ev

if TYPE_CHECKING:
    from .._bus import LoopPort
    from ..checkpoint import TrainState

__all__ = ["Tracer", "Wants"]


_OFF = contextlib.nullcontext()  # the context of a part nobody traces


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
            ev.SpanTraced(started=self._started, ended=time.monotonic(), error=exc, **self._event)  # type: ignore[arg-type]
        )


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
    ) -> contextlib.nullcontext[None] | _Timed:
        """The context that times ``span`` (a do-nothing one when it is not traced)."""
        if not self.on or span not in self._spans:
            return _OFF
        st = self._state
        return _Timed(
            self._port,
            {
                "step": st.step,
                "epoch": st.epoch,
                "span": span,
                "phase": phase,
                "batch_index": batch_index,
                "micro_batch": micro_batch,
                "dataset": dataset,
            },
        )


class Wants:
    """Cached ``port.wants(T)`` of each per-step or per-batch event, one flag each;
    ``step_ended_sampled``: only sampled streams want ``StepEnded`` (the demand says when)."""

    __slots__ = (
        "_port",
        "eval_batch_ended",
        "eval_batch_started",
        "metrics_logged",
        "prediction_batch_ended",
        "rings",
        "scheduler_stepped",
        "step_ended",
        "step_ended_demand",
        "step_ended_sampled",
        "trace",
    )

    def __init__(self, port: LoopPort, state: TrainState, trace: frozenset[str]) -> None:
        self._port = port
        self.step_ended_demand = port.demand(ev.StepEnded)
        self.step_ended_sampled = False
        self.rings = -1
        self.trace = Tracer(port, state, trace)
        self.scheduler_stepped = self.step_ended = self.metrics_logged = False
        self.eval_batch_ended = self.eval_batch_started = self.prediction_batch_ended = False

    def refresh(self) -> None:
        """Re-read the flags if the port's doorbell rang since the last read."""
        port = self._port
        rings = port.doorbell.rings
        if rings == self.rings:
            return
        self.rings = rings  # first: a subscription made while the flags are read rings again
        wants = port.wants
        self.scheduler_stepped = wants(ev.SchedulerStepped)
        demand = self.step_ended_demand
        self.step_ended = demand.each
        self.step_ended_sampled = demand.sampled
        self.metrics_logged = wants(ev.MetricsLogged)
        self.eval_batch_ended = wants(ev.EvalBatchEnded)
        self.eval_batch_started = wants(ev.EvalBatchStarted)
        self.prediction_batch_ended = wants(ev.PredictionBatchEnded)
        self.trace.refresh()

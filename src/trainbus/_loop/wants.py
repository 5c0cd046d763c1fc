"""Which per-step events someone listens to: the loop builds no event nobody wants.

``port.wants(T)`` walks the bus' routing table; the step would pay for that a dozen times. The
:class:`Wants` record caches one flag per per-step event type; the loop re-reads them only when
the port's doorbell rang (a subscription came or went, among the other changes it rings for):
one attribute read and an int compare per step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import events as ev
from .trace import Tracer

if TYPE_CHECKING:
    from .._bus import LoopPort
    from ..checkpoint import TrainState

__all__ = ["Wants"]


class Wants:
    """Cached ``port.wants(T)`` for every event the loop publishes per step or per eval batch.

    Attributes (read on the hot path; written only by :meth:`refresh`):
        eval_batch_ended ... scheduler_stepped: ``port.wants`` of the event of that name.
        step_ended: Some subscription takes every ``StepEnded``.
        step_ended_sampled: Only sampled subscriptions want ``StepEnded``: the step builds
            one when ``step_ended_demand.takes(step, now)`` says one of them takes it, and
            tells it the event's stamp (``built``).
        step_ended_demand: The port's :class:`~trainbus._bus.dispatch.Demand` for ``StepEnded``.
        trace: The opt-in trace of the step's parts (``SpanTraced``), refreshed with the flags.
        rings: The doorbell's count the flags were read at (-1: never read).

    Args:
        port: The port whose demand is cached.
        state: The run's train state (stamps the trace's events).
        trace: The parts ``Trainer(trace=...)`` names (empty: tracing is off).
    """

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
    )  # fmt: skip

    def __init__(self, port: LoopPort, state: TrainState, trace: frozenset[str]) -> None:
        self._port = port
        self.step_ended_demand = port.demand(ev.StepEnded)
        self.step_ended_sampled = False
        self.rings = -1
        self.trace = Tracer(port, state, trace)
        self.scheduler_stepped = self.step_ended = self.metrics_logged = False
        self.eval_batch_ended = self.eval_batch_started = self.prediction_batch_ended = False

    def refresh(self) -> None:
        """Re-read the flags if the port's doorbell rang since the last read (else nothing).

        The doorbell is the port's one signal that something changed (a subscription among
        others); a step without a ring pays one compare.
        """
        port = self._port
        rings = port.doorbell.rings
        if rings == self.rings:
            return
        # The count is read first: a subscription made while the flags are read rings again,
        # and the next compare catches that.
        self.rings = rings
        wants = port.wants
        self.scheduler_stepped = wants(ev.SchedulerStepped)
        # Sampled subscriptions only (stream(StepEnded, every_s= / every_steps=)): the step
        # builds one when the demand says one of them takes it, not every step.
        demand = self.step_ended_demand
        self.step_ended = demand.each
        self.step_ended_sampled = demand.sampled
        self.metrics_logged = wants(ev.MetricsLogged)
        self.eval_batch_ended = wants(ev.EvalBatchEnded)
        self.eval_batch_started = wants(ev.EvalBatchStarted)
        self.prediction_batch_ended = wants(ev.PredictionBatchEnded)
        self.trace.refresh()

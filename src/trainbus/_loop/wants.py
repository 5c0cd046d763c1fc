"""Which per-step events someone listens to, so that the loop builds no event nobody wants.
``port.wants(T)`` walks the routing table: :class:`Wants` caches it until the doorbell rings.
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
    """Cached ``port.wants(T)`` for every event the loop publishes per step or per eval batch,
    one flag named after each. ``step_ended_sampled``: only sampled subscriptions
    (``stream(StepEnded, every_s=)``) want ``StepEnded``; ``step_ended_demand`` says when."""

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
        # The count is read first: a subscription made while the flags are read rings again,
        # and the next compare catches that.
        self.rings = rings
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

"""Which per-step events someone listens to: the loop builds no event nobody wants.

``port.wants(T)`` walks the bus' routing table; the step would pay for that a dozen times. The
:class:`Wants` record caches one flag per per-step event type; the loop re-reads them only when
the port's doorbell rang (a subscription came or went, among the other changes it rings for):
one attribute read and an int compare per step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import events as ev

if TYPE_CHECKING:
    from .._bus import LoopPort

__all__ = ["Wants"]


class Wants:
    """Cached ``port.wants(T)`` for every event the loop publishes per step or per eval batch.

    Attributes (read on the hot path; written only by :meth:`refresh`):
        batch_fetched ... eval_batch_ended: ``port.wants`` of the event of that name.
        step_ended: Some subscription takes every ``StepEnded``.
        step_ended_sampled: Only sampled subscriptions want ``StepEnded``: the step builds
            one when ``step_ended_demand.takes(step, now)`` says one of them takes it, and
            tells it the event's stamp (``built``).
        step_ended_demand: The port's :class:`~trainbus._bus.dispatch.Demand` for ``StepEnded``.
        step_extras: ``StepBegan`` or the ``DataWaitStarted/Ended`` span is wanted: the
            step reads this one flag, and the single ones only when it is set.
        rings: The doorbell's count the flags were read at (-1: never read).

    Args:
        port: The port whose demand is cached.
    """

    __slots__ = (
        "_port",
        "backward_ended",
        "backward_started",
        "batch_fetched",
        "data_wait_ended",
        "data_wait_started",
        "eval_batch_ended",
        "eval_batch_started",
        "forward_ended",
        "forward_started",
        "loss_computed",
        "metrics_logged",
        "micro_batch_ended",
        "optimizer_step_ended",
        "optimizer_step_started",
        "prediction_batch_ended",
        "rings",
        "scheduler_stepped",
        "scheduler_stepping",
        "step_began",
        "step_ended",
        "step_ended_demand",
        "step_ended_sampled",
        "step_extras",
        "zero_grad_ended",
        "zero_grad_started",
    )  # fmt: skip

    def __init__(self, port: LoopPort) -> None:
        self._port = port
        self.step_ended_demand = port.demand(ev.StepEnded)
        self.step_ended_sampled = False
        self.rings = -1
        self.batch_fetched = self.forward_started = self.forward_ended = False
        self.loss_computed = self.backward_started = self.backward_ended = False
        self.optimizer_step_started = self.optimizer_step_ended = False
        self.scheduler_stepped = self.step_ended = self.metrics_logged = False
        self.eval_batch_ended = self.eval_batch_started = self.prediction_batch_ended = False
        self.step_began = self.data_wait_started = self.data_wait_ended = False
        self.micro_batch_ended = self.zero_grad_started = self.zero_grad_ended = False
        self.scheduler_stepping = self.step_extras = False

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
        self.batch_fetched = wants(ev.BatchFetched)
        self.forward_started = wants(ev.ForwardStarted)
        self.forward_ended = wants(ev.ForwardEnded)
        self.loss_computed = wants(ev.LossComputed)
        self.backward_started = wants(ev.BackwardStarted)
        self.backward_ended = wants(ev.BackwardEnded)
        self.optimizer_step_started = wants(ev.OptimizerStepStarted)
        self.optimizer_step_ended = wants(ev.OptimizerStepEnded)
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
        self.step_began = wants(ev.StepBegan)
        self.data_wait_started = wants(ev.DataWaitStarted)
        self.data_wait_ended = wants(ev.DataWaitEnded)
        self.micro_batch_ended = wants(ev.MicroBatchEnded)
        self.zero_grad_started = wants(ev.ZeroGradStarted)
        self.zero_grad_ended = wants(ev.ZeroGradEnded)
        self.scheduler_stepping = wants(ev.SchedulerStepping)
        self.step_extras = self.step_began or self.data_wait_started or self.data_wait_ended

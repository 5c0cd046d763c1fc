"""Which per-step events someone listens to: the loop builds no event nobody wants.

``bus.wants(T)`` walks the bus' routing table; the step would pay for that a dozen times. The
:class:`Wants` record caches one flag per per-step event type and re-reads them only when
``bus.routes_version`` changes (a subscription came or went): one int compare per step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import events as ev

if TYPE_CHECKING:
    from ..bus import EventBus

__all__ = ["Wants"]


class Wants:
    """Cached ``bus.wants(T)`` for every event the loop publishes per step or per eval batch.

    Attributes (read on the hot path; written only by :meth:`refresh`):
        batch_fetched ... eval_batch_ended: ``bus.wants`` of the event of that name.
        phases: One of the events only the instrumented phases publish (``BatchFetched``
            through ``OptimizerStepEnded``, ``MicroBatchEnded``, ``ZeroGradStarted/Ended``) is
            wanted; while none is, the step can take its plain path.
        step_ended: Some subscription takes every ``StepEnded``.
        step_ended_sampled: Only sampled subscriptions want ``StepEnded``: the step builds
            one when ``step_ended_due.at`` (a ``time.monotonic()`` value) has come or one of
            ``step_ended_due.periods`` divides its step.
        step_ended_due: The bus' :class:`~trainbus.bus.routes.Due` for ``StepEnded``.
        step_extras: ``StepBegan`` or the ``DataWaitStarted/Ended`` span is wanted: the
            step reads this one flag, and the single ones only when it is set.
        version: The ``bus.routes_version`` the flags were read at (-1: never read).

    Args:
        bus: The bus whose routing is cached.
    """

    __slots__ = (
        "_bus",
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
        "phases",
        "prediction_batch_ended",
        "scheduler_stepped",
        "scheduler_stepping",
        "step_began",
        "step_ended",
        "step_ended_due",
        "step_ended_sampled",
        "step_extras",
        "version",
        "zero_grad_ended",
        "zero_grad_started",
    )  # fmt: skip

    def __init__(self, bus: EventBus) -> None:
        self._bus = bus
        self.step_ended_due = bus.due(ev.StepEnded)
        self.step_ended_sampled = False
        self.version = -1
        self.batch_fetched = self.forward_started = self.forward_ended = False
        self.loss_computed = self.backward_started = self.backward_ended = False
        self.optimizer_step_started = self.optimizer_step_ended = False
        self.scheduler_stepped = self.step_ended = self.metrics_logged = False
        self.eval_batch_ended = self.eval_batch_started = self.prediction_batch_ended = False
        self.step_began = self.data_wait_started = self.data_wait_ended = False
        self.micro_batch_ended = self.zero_grad_started = self.zero_grad_ended = False
        self.scheduler_stepping = self.step_extras = False
        self.phases = False

    def refresh(self) -> None:
        """Re-read the flags if the bus' routing changed since the last read (else nothing).

        The step calls it only after its own ``bus.routes_version != wants.version`` compare,
        so a step without a routing change pays one int compare.
        """
        bus = self._bus
        version = bus.routes_version
        if version == self.version:
            return
        # The version is read first: a subscription made while the flags are read bumps it
        # again, and the next compare catches that.
        self.version = version
        wants = bus.wants
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
        # builds one when step_ended_due says one of them takes it, not every step.
        self.step_ended = bus.wants_each(ev.StepEnded)
        self.step_ended_sampled = not self.step_ended and wants(ev.StepEnded)
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
        self.phases = (
            self.batch_fetched or self.forward_started or self.forward_ended
            or self.loss_computed or self.backward_started or self.backward_ended
            or self.optimizer_step_started or self.optimizer_step_ended
            or self.micro_batch_ended or self.zero_grad_started or self.zero_grad_ended
        )  # fmt: skip

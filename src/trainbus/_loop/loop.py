"""The training loop: the run, its epochs, and after each step taken its evaluation and poll
point (event order: docs/events.md; parts: ARCHITECTURE.md, "The loop")."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal

from .. import events as ev
from .._exceptions import NonFiniteLossError, TrainingError
from .._log import get_logger
from .._tensors import use_device
from ..checkpoint import Checkpoint, TrainState
from ..checkpoint._store import parse_checkpoint_name
from .control import BarrierWait, CommandHandler, RunStop
from .data import EpochData
from .evaluation import Evaluator
from .hooks import Hooks
from .nonfinite import NonFiniteGuard
from .optimizers import SchedulerStepper
from .result import CancelFlag, Cancelled, FitResult
from .saving import CheckpointWriter
from .step import Step, StepOutcome, TrainContext
from .wants import Wants
from .window import LogWindow

if TYPE_CHECKING:
    from .._bus import LoopPort
    from .._distributed.sync import RankSync
    from .settings import Settings

__all__ = ["Cancelled", "FitResult", "Loop"]

log = get_logger(__name__)

_NO_END = 2**62  # a step no run reaches: the epoch length or last step of a run with none


class Loop:
    """One run of the training loop, not reusable; :attr:`result`: how it ended. ``resume``:
    the checkpoint ``state`` was loaded from (its epoch's data order is replayed); ``sync``:
    the ranks' agreement under torchrun (None: no collective ever)."""

    def __init__(
        self,
        settings: Settings,
        port: LoopPort,
        hooks: Hooks,
        barrier: BarrierWait,
        state: TrainState,
        *,
        resume: Checkpoint | None = None,
        resumed_from: str | None = None,
        resume_source: ev.ResumeSource | None = None,
        callback_states: Callable[[], Mapping[str, Mapping[str, Any]]] | None = None,
        sync: RankSync | None = None,
    ) -> None:
        self._s = settings
        self._port = port
        self._hooks = hooks
        self._state = state
        self._resumed_from = resumed_from
        self._resume_source = resume_source
        self._cancel = CancelFlag(port.doorbell)
        self._sync = sync
        self.result: FitResult | None = None
        self._wants = Wants(port, state, settings.trace)
        # No part refers back to one that refers to it: a dropped Trainer frees without gc.
        self._stop = RunStop(port.doorbell)
        self._guard = NonFiniteGuard(
            settings,
            state,
            stop=self._stop.stop,
            agree=None if sync is None else sync.any_nonfinite,
        )
        self._log_window = LogWindow(settings, port, state, guard=self._guard, sync=sync)
        user = self._log_window.user  # ctx.log, LogMetric
        self._checkpoints = CheckpointWriter(
            settings,
            port,
            state,
            callback_states,
            window=self._log_window,
            guard=self._guard,
            sync=sync,
        )
        self._evaluator = Evaluator(
            settings,
            port,
            state,
            self._wants,
            self._cancel.check,
            hooks,
            reduce=None if sync is None else sync.reduce_eval,
            sum_totals=None if sync is None else sync.sum_eval,
        )
        self._control = CommandHandler(
            settings,
            port,
            state,
            wait_barrier=barrier,
            check_cancel=self._cancel.check,
            checkpoints=self._checkpoints,
            evaluator=self._evaluator,
            sync=sync,
            log_metric=user.log,
            stop=self._stop,
        )
        if resume is not None:
            self._resumed(resume)
        self._data = EpochData(settings, state, self._checkpoints, resume)
        self._scheduler = SchedulerStepper(settings, port, state, self._wants)
        self._step = Step(
            settings,
            port,
            state,
            self._wants,
            hooks,
            self._guard,
            self._log_window,
            self._scheduler,
            self._cancel,
        )
        self._ctx = TrainContext(self._step)  # the run's one
        self._demand_rings = -1  # the doorbell's count when wants and decision step were read
        self._rings_seen = -1  # the doorbell's count at the last poll point that looked
        self._decision_step = -1
        # torchrun: the agreed decision steps ((every periods), (at steps)); None: the bus'.
        self._agreed: tuple[tuple[int, ...], tuple[int, ...]] | None = None
        self._epoch_len = settings.train_len if settings.train_len is not None else _NO_END
        self._last_step = settings.max_steps if settings.max_steps is not None else _NO_END
        self._eval_every = settings.eval_every or _NO_END
        self._first_step = state.step  # no optimizer step in this process before it

    def request_cancel(self) -> None:
        """End the run at the loop's next check (``"cancelled"``). Safe from any thread."""
        self._cancel.request()

    def _resumed(self, resume: Checkpoint) -> None:
        """Carry on ``resume``'s last evaluation metrics, and the save itself (a
        ``SaveCheckpoint`` of its step and tag is answered with it)."""
        st = self._state
        self._evaluator.metrics = dict(resume.metrics)
        name = parse_checkpoint_name(resume.path.name)
        if name is not None and name[0] == st.step:
            self._checkpoints.resumed_from(
                ev.CheckpointSaved(
                    step=st.step,
                    epoch=st.epoch,
                    path=str(resume.path),
                    tag=name[1],
                    metrics=resume.metrics,
                )
            )

    def run(self) -> FitResult:
        """Run to the end; always publishes FitEnded. Returns how it ended."""
        pub = self._port.publish
        st, s, control = self._state, self._s, self._control
        reason: Literal["completed", "stopped", "failed", "cancelled"] = "completed"
        error: BaseException | None = None
        use_device(s.device)  # CUDA's current device is per thread: this worker's is the run's
        s.model.train()
        steps_per_epoch = self._data.start()
        pub(
            ev.FitStarted(
                step=st.step,
                epoch=st.epoch,
                max_steps=s.max_steps,
                max_epochs=s.max_epochs,
                device=str(s.device),
                resumed_from=self._resumed_from,
                resume_source=self._resume_source,
                steps_per_epoch=steps_per_epoch,
                rank=0 if self._sync is None else self._sync.rank,
                world_size=1 if self._sync is None else self._sync.world_size,
            )
        )
        try:
            if self._sync is not None:
                self._agree_schedules()
            control.poll(common=True)
            while not self._finished():
                before = st.step
                if self._epoch():
                    st.epoch_done()
                    if st.step == before and s.max_epochs is None:
                        raise self._no_step_error()
            # A last sync point: apply what subscribers sent for the final steps.
            control.barrier_then_poll(None, common=True)
            self._log_window.check_pending()
            # After the last poll: a stop decided on it cannot stop a run with no step left.
            self._log_window.finish()
            ending = ev.Ending.of(
                "completed" if self._stop.reason is None else "stopped", self._stop.reason
            )
            self._checkpoints.save_final(ending, self._evaluator.metrics)
        except Cancelled:
            reason = "cancelled"
        except BaseException as exc:
            reason, error = "failed", exc
            if isinstance(exc, NonFiniteLossError):
                exc.add_note(
                    f"trainbus: last checkpoint: {self._checkpoints.last_checkpoint or 'none'}"
                )
            hook = self._hooks.which(exc)
            if hook is not None:
                exc.add_note(
                    f"trainbus: raised by hook {hook[1]!r} at {hook[0]!r} (step "
                    f"{st.step}, epoch {st.epoch}); the run failed"
                )
        else:
            if self._stop.reason is not None:
                reason = "stopped"
        finally:
            pub(
                ev.FitEnded(
                    step=st.step,
                    epoch=st.epoch,
                    reason=reason,
                    error=error,
                    stop_reason=self._stop.reason,
                )
            )
        log.debug(
            "fit_ended", reason=reason, step=st.step, epoch=st.epoch, stop_reason=self._stop.reason
        )
        self.result = FitResult(
            reason=reason,
            error=error,
            stop_reason=self._stop.reason,
            steps=st.step,
            epochs=st.epoch,
            eval_metrics=self._evaluator.metrics,
            train_metrics=self._log_window.metrics,
            last_checkpoint=self._checkpoints.last_checkpoint,
            statistics=self._port.statistics(),
            skipped_nonfinite=self._guard.skipped,
            resumed_from=self._resumed_from,
            failed_saves=self._checkpoints.failed_saves,
            metric_failures=self._evaluator.failures.counts,
        )
        return self.result

    def _no_step_error(self) -> TrainingError:
        """An epoch took no step and only ``max_steps`` ends the run: it never would."""
        st = self._state
        return TrainingError(
            f"epoch {st.epoch - 1} ended without an optimizer step (still at step {st.step}) and "
            f"only max_steps={self._s.max_steps} ends the run, so it never would: a hook skips "
            "every update (before_optimizer_step) or every batch (batch, after_forward, loss)"
        )

    def _finished(self) -> bool:
        s, st = self._s, self._state
        return (
            self._stop.reason is not None
            or st.step >= self._last_step
            or (s.max_epochs is not None and st.epoch >= s.max_epochs)
        )

    def _epoch(self) -> bool:
        """Run (the rest of) one epoch; True when it completed (the next one starts at 0)."""
        port, st, s, control = self._port, self._state, self._s, self._control
        pub, step, bell = port.publish, self._step, port.doorbell
        pub(ev.EpochStarted(step=st.step, epoch=st.epoch))
        control.begin_epoch()
        error: BaseException | None = None
        try:
            it = self._data.open()
            accumulate = s.accumulate
            short_after = self._epoch_len - accumulate  # past it, a step is the epoch's short last
            complete = False  # the data ran out or StopEpoch: not cut by max_steps / a stop
            while True:
                if control.stop_epoch:
                    complete = True
                    break
                if self._stop.reason is not None or st.step == self._last_step:
                    break
                if bell.rings != self._demand_rings:  # a cancel rings too
                    self._demand_rings = bell.rings  # first: a ring from now on is heard
                    self._cancel.check()
                    self._wants.refresh()
                    self._decision_step = self._next_decision(st.step)
                accumulation_steps = accumulate
                if st.batch_in_epoch > short_after:
                    accumulation_steps = self._epoch_len - st.batch_in_epoch
                    if accumulation_steps <= 0:
                        complete = True
                        break
                outcome = step.run(self._ctx, it, accumulation_steps)
                if outcome.taken:
                    self._after_step(outcome)
                if outcome.exhausted:
                    complete = self._stop.reason is None
                    break
            if st.batch_in_epoch >= self._epoch_len and self._stop.reason is None:
                complete = True  # max_steps reached on the epoch's last batch
            if st.closed_epoch == st.epoch:  # its last step did the epoch's end work
                complete = True
            if st.batch_in_epoch == 0 and not self._finished():
                raise self._data.empty_error()
            # The epoch's end found only now (data of unknown length, a StopEpoch), or the
            # end of the run: what no step closed yet.
            self._close_step(ends_epoch=complete and st.closed_epoch != st.epoch, cadence=False)
        except BaseException as exc:
            error = exc
            raise
        finally:
            ended = ev.EpochEnded(
                step=st.step, epoch=st.epoch, batches=st.batch_in_epoch, error=error
            )
            pub(ended)
            if error is None:
                control.barrier_then_poll(ended, common=True)
        return complete

    def _after_step(self, outcome: StepOutcome) -> None:
        """After a step taken: its evaluation if due, then its poll point (a checkpoint the poll
        writes holds the evaluation: docs/reliability.md)."""
        st = self._state
        step, ends_epoch = st.step, st.batch_in_epoch >= self._epoch_len
        if ends_epoch or step == self._last_step or step % self._eval_every == 0:
            self._close_step(ends_epoch=ends_epoch, cadence=True)
        if step == self._decision_step:
            self._decision_step = self._next_decision(step)
            self._control.decide(
                outcome.ended, outcome.barrier_event, common=self._sync is not None
            )
        elif outcome.barrier_event is not None:
            self._control.barrier_then_poll(outcome.barrier_event)
        elif self._port.doorbell.rings != self._rings_seen:  # else nothing happened: one compare
            # Poll only when a subscriber failed, a command waits, a cancel was asked or a
            # "block" buffer is full (each rings; other rings, a subscription made, need none).
            port = self._port
            self._rings_seen = port.doorbell.rings
            pending = port.failure is not None or port.has_commands() or port.held
            if pending or self._cancel.requested:
                self._control.poll()
                self._rings_seen = -1  # look again next step: the poll may have left some pending
        if self._sync is not None and self._log_window.agree_due():
            self._control.agree()  # a rank had commands at this log window's close

    def _next_decision(self, step: int) -> int:
        """The first declared decision step after ``step`` (-1: none)."""
        if self._agreed is not None:
            every, at = self._agreed
            later = [(step // n + 1) * n for n in every] + [k for k in at if k > step]
            return min(later, default=-1)
        nxt = self._port.next_decision(step)
        return -1 if nxt is None else nxt

    def _agree_schedules(self) -> None:
        """torchrun: every rank takes the union of the decision steps declared at the start (one
        all-gather); later declarations do not join (they would hang the ranks that lack them)."""
        assert self._sync is not None
        schedules = self._port.decision_steps
        every = [int(n) for n in (getattr(x, "n", None) for x in schedules) if n is not None]
        at = [int(k) for k in (getattr(x, "step", None) for x in schedules) if k is not None]
        self._agreed = self._sync.agree_schedules(every, at)
        self._decision_step = self._next_decision(self._state.step)

    def _close_step(self, *, ends_epoch: bool, cadence: bool) -> None:
        """The step's evaluation (one round for the cadences due), then with ``ends_epoch`` the
        epoch's end work; ``cadence``: the ``eval_every`` cadence is asked too."""
        s, st = self._s, self._state
        running = self._stop.reason is None
        ends_epoch = ends_epoch and running
        ends: tuple[ev.EvaluationEnded, ...] = ()
        if s.eval_data is not None and st.evaluated_step != st.step:
            triggers: list[ev.EvalTrigger] = []
            if cadence and st.step % self._eval_every == 0:
                triggers.append("steps")
            if ends_epoch and s.eval_at_epoch_end:
                triggers.append("epoch")
            last = st.step >= self._last_step or (
                ends_epoch and s.max_epochs is not None and st.epoch + 1 >= s.max_epochs
            )
            if (
                last
                and running
                and s.eval_at_end
                and (s.eval_every is not None or s.eval_at_epoch_end)
            ):
                triggers.append("end")
            if triggers:
                ends = self._evaluator.run(tuple(triggers))
        if ends_epoch:
            st.epoch_closed()
            if s.scheduler is not None and s.scheduler_interval == "epoch":
                self._scheduler.step(always=True, replayed=st.step == self._first_step)
        if ends:  # a checkpoint the round's subscribers ask for holds the epoch's end work too
            self._control.barrier_then_poll(ends[-1], *ends[:-1], common=True)

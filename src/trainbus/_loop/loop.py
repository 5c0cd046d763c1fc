"""The training loop. It runs on the training thread, publishes onto the bus, polls commands.

:class:`Loop` is the run, the epoch and the poll point after each step. The rest is owned by
the parts it composes: ``Step`` (one optimizer step with its hooks and events, the only one),
``StepPhases`` (its forward, backward and optimizer step), ``Wants`` (which events someone
listens to), ``LogWindow`` (aggregated metrics and the NaN check), ``NonFiniteGuard``,
``Evaluator``, ``CheckpointWriter``, ``CommandHandler`` (poll points, commands, stop state),
``EpochData`` (each epoch's iterator, the observed fetch) and ``SchedulerStepper``. The run's
position (step, epoch, batch in epoch, samples seen) is the ``TrainState``'s: the loop and the
step advance it through its methods (``batch_taken``, ``samples_done``, ``step_done``,
``epoch_done``) and nowhere else.

The event order is written once, in docs/events.md ("Event order"), and nowhere else: read it
there. tests/loop/test_loop.py pins a recorded run against that pseudocode and checks its
event names against what the loop publishes, so it cannot drift; a copy here could.

The loop holds the bus' loop face, its :class:`~trainbus._bus.LoopPort`, and one signal
tells it to look: the port's doorbell, which rings after a routing change, a declared or
removed decision steps, a command, a failure, a full ``"block"`` buffer or a cancel.
Events nobody wants are never built: before a run of steps the loop compares the doorbell's
count with the one its ``Wants`` and decision step were read at (one attribute read, one int
compare) and re-reads them only after a ring; the step's event and hook points are branches on
those flags. ``Step.run`` takes the steps up to the next one after which the loop has more to
do (``_steps_before_look``) back to back and ends its run early when the doorbell rings; the
poll point after a run reads the same count against the one it last polled at.
No value is read off the device on this thread unless a subscriber or the non-finite guard needs
it: on the CPU the guard reads each step's loss (free); on an accelerator it reads the log window's
losses at syncs that happen anyway (the log step, a checkpoint write, the end of the run), except
under ``on_nonfinite="skip"``, which reads every step before the update (see ``nonfinite.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal

from .. import events as ev
from .._exceptions import CheckpointError, CheckpointWriteError, NonFiniteLossError
from .._log import get_logger
from .._tensors import use_device
from ..checkpoint import Checkpoint, TrainState
from ..checkpoint._store import parse_checkpoint_name
from .context import StepRunner
from .control import BarrierWait, CommandHandler, RunStop
from .data import EpochData
from .evaluation import EvalTrigger, Evaluator
from .hooks import Hooks
from .logged import UserMetrics
from .lr_schedule import SchedulerStepper
from .nonfinite import NonFiniteGuard
from .result import CancelFlag, Cancelled, FitResult
from .saving import CheckpointWriter
from .step import Step, StepOutcome
from .wants import Wants
from .window import LogWindow

if TYPE_CHECKING:
    from .._bus import LoopPort
    from .._distributed.sync import RankSync
    from .settings import Settings

__all__ = ["Cancelled", "FitResult", "Loop"]

log = get_logger(__name__)

_NO_END = 2**62
"""A step number no run reaches: the end of a run of steps when nothing else bounds it."""


class Loop:
    """One run of the training loop. Built by :class:`~trainbus.Trainer`; not reusable.

    Attributes:
        result: How the run ended; None until :meth:`run` returns.

    Args:
        settings: The validated settings.
        port: Where events go and commands come from.
        hooks: The inline hooks (read every step: they may come and go).
        barrier: Waits at a barrier event (see ``trainbus._loop.control.BarrierWait``).
        state: The train state to start from (fresh, or loaded from a checkpoint); the loop
            advances it.
        resume: The checkpoint ``state`` was loaded from (already restored into the model,
            optimizer, scheduler and scaler): the loop replays its epoch's data order and
            restores its RNG states at the moment they were captured.
        resumed_from: The checkpoint file loaded (``FitStarted.resumed_from``), None for a
            fresh start.
        resume_source: Where it was found (``FitStarted.resume_source``).
        callback_states: Returns the stateful callbacks' states at each save (see
            :class:`~trainbus._loop.saving.CheckpointWriter`).
        sync: Under torchrun with more than one rank: commands are agreed at the common sync
            points (start, log-window close when a rank has some pending, evaluations, epoch
            ends, end of run), metrics averaged, checkpoints written by rank 0
            (docs/distributed.md). None: one process, no collective ever.
    """

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
        user = UserMetrics()  # ctx.log, LogMetric: joined to the log window's metrics
        # Built so that no part refers back to another that refers to it: a dropped Trainer
        # frees the run without a gc pass.
        self._stop = RunStop(port.doorbell)
        self._guard = NonFiniteGuard(
            settings,
            state,
            stop=self._stop.stop,
            agree=None if sync is None else sync.any_nonfinite,
        )
        self._log_window = LogWindow(settings, port, state, guard=self._guard, sync=sync, user=user)
        self._checkpoints = CheckpointWriter(settings, port, state, callback_states,
                                             window=self._log_window, guard=self._guard,
                                             sync=sync)  # fmt: skip
        self._evaluator = Evaluator(settings, port, state, self._wants, self._cancel.check, hooks,
                                    reduce=None if sync is None else sync.reduce_eval,
                                    sum_totals=None if sync is None else sync.sum_eval)  # fmt: skip
        self._control = CommandHandler(settings, port, state, wait_barrier=barrier,
                                       check_cancel=self._cancel.check,
                                       checkpoints=self._checkpoints,
                                       evaluator=self._evaluator, sync=sync,
                                       log_metric=user.log, stop=self._stop)  # fmt: skip
        if resume is not None:
            self._resumed(resume)
        self._data = EpochData(settings, state, self._checkpoints, resume)
        self._scheduler = SchedulerStepper(settings, port, state, self._wants)
        runner = StepRunner(settings, state, hooks, self._guard, self._wants.trace, user)
        self._step = Step(settings, port, state, self._wants, hooks, runner, self._guard,
                          self._log_window, self._scheduler, self._cancel)  # fmt: skip
        # The doorbell's count when the wants and the next decision step were last read: they
        # are re-read before a step after any ring (a routing or schedule change rings it).
        self._demand_rings = -1
        # The bus' doorbell count at the last look: the poll point after a plain step reads
        # one attribute; the bus rings after a command, a failure, a full "block" buffer, a
        # routing change, and a cancel rings it too.
        self._rings_seen = -1
        self._decision_step = -1
        # Under torchrun: the union of every rank's decision steps, agreed at the run's
        # start ((every periods), (at steps)); None: the bus' own clock decides.
        self._agreed: tuple[tuple[int, ...], tuple[int, ...]] | None = None
        # The batch count that ends an epoch and the last step: the step that reaches either
        # closes its evaluation (and the epoch's work) before its decision poll (_close_step).
        self._epoch_len = settings.train_len if settings.train_len is not None else _NO_END
        self._last_step = settings.max_steps if settings.max_steps is not None else _NO_END
        self._first_step = state.step  # no optimizer step in this process before it

    # ================================================================== cancellation
    def request_cancel(self) -> None:
        """Ask the loop to stop at its next check (between micro-batches, at poll points and
        between evaluation batches): the run ends with ``FitEnded(reason="cancelled")``.
        Safe from any thread."""
        self._cancel.request()  # rings the doorbell: the poll point after the step hears it

    # ================================================================== run
    def _resumed(self, resume: Checkpoint) -> None:
        """Carry on from ``resume`` what the run that wrote it had: the last evaluation's
        metrics (its later saves and the result carry them) and that save itself, of this
        step (a ``SaveCheckpoint`` of the same step and tag is answered with it)."""
        st = self._state
        self._evaluator.metrics = dict(resume.metrics)
        name = parse_checkpoint_name(resume.path.name)
        if name is not None and name[0] == st.step:
            self._checkpoints.resumed_from(ev.CheckpointSaved(
                step=st.step, epoch=st.epoch, path=str(resume.path), tag=name[1],
                metrics=resume.metrics,
            ))  # fmt: skip

    def run(self) -> FitResult:
        """Run to the end; always publishes FitEnded. Returns how it ended."""
        pub = self._port.publish
        st, s, control = self._state, self._s, self._control
        reason: Literal["completed", "stopped", "failed", "cancelled"] = "completed"
        error: BaseException | None = None
        use_device(s.device)  # CUDA's current device is per thread: this worker's is the run's
        s.model.train()
        steps_per_epoch = self._data.start()
        pub(ev.FitStarted(step=st.step, epoch=st.epoch, max_steps=s.max_steps,
                          max_epochs=s.max_epochs, device=str(s.device),
                          resumed_from=self._resumed_from,
                          resume_source=self._resume_source,
                          steps_per_epoch=steps_per_epoch,
                          rank=0 if self._sync is None else self._sync.rank,
                          world_size=1 if self._sync is None else self._sync.world_size,
                          ))  # fmt: skip
        try:
            if self._sync is not None:
                self._agree_schedules()
            control.poll(common=True)
            while not self._finished():
                if self._epoch():
                    st.epoch_done()
            # A last sync point: subscribers may still be answering the final steps (a
            # SaveCheckpoint for the last StepEnded); deliver, wait, and apply what they sent.
            control.barrier_then_poll(None, common=True)
            self._log_window.check_pending()  # the end of the run: a short run, the last log window
            self._log_window.finish()  # FitResult.train_metrics: the partial last log window too
            checkpoints = self._checkpoints
            ending = ev.Ending.of("completed" if self._stop.reason is None else "stopped",
                                  self._stop.reason)  # fmt: skip
            if (checkpoints.enabled and not self._guard.tripped
                    and ending not in s.skip_final_checkpoint):  # fmt: skip
                if checkpoints.last_checkpoint_step != st.step:
                    try:
                        checkpoints.save("final", self._evaluator.metrics)
                    except CheckpointWriteError:  # the disk refused it: the run fails, naming
                        raise  # the file (the earlier checkpoints stay valid)
                    except CheckpointError as exc:  # non-finite weights: keep the last good one
                        log.warning("final_checkpoint_refused", step=st.step, error=str(exc))
        except Cancelled:
            reason = "cancelled"
        except BaseException as exc:
            reason, error = "failed", exc
            if isinstance(exc, NonFiniteLossError):  # where to go back to
                exc.add_note("trainbus: last checkpoint: "
                             f"{self._checkpoints.last_checkpoint or 'none'}")  # fmt: skip
            hook = self._hooks.which(exc)
            if hook is not None:  # the user's exception reaches the caller as itself, noted
                exc.add_note(f"trainbus: raised by hook {hook[1]!r} at {hook[0]!r} (step "
                             f"{st.step}, epoch {st.epoch}); the run failed")  # fmt: skip
        else:
            if self._stop.reason is not None:
                reason = "stopped"
        finally:
            pub(ev.FitEnded(step=st.step, epoch=st.epoch, reason=reason, error=error,
                            stop_reason=self._stop.reason))  # fmt: skip
        log.debug("fit_ended", reason=reason, step=st.step, epoch=st.epoch,
                  stop_reason=self._stop.reason)  # fmt: skip
        self.result = FitResult(
            reason=reason,
            error=error,
            stop_reason=self._stop.reason,
            steps=st.step,
            epochs=st.epoch,
            eval_metrics=self._evaluator.metrics,
            train_metrics=self._log_window.metrics,
            last_checkpoint=self._checkpoints.last_checkpoint,
            statistics=self._port.statistics(),  # the trainer's with_bus() replaces it
            skipped_nonfinite=self._guard.skipped,
            resumed_from=self._resumed_from,
            failed_saves=self._checkpoints.failed_saves,
            metric_failures=self._evaluator.failures.counts,
        )
        return self.result

    def _finished(self) -> bool:
        s, st = self._s, self._state
        return (
            self._stop.reason is not None
            or (s.max_steps is not None and st.step >= s.max_steps)
            or (s.max_epochs is not None and st.epoch >= s.max_epochs)
        )

    # ================================================================== one epoch
    def _epoch(self) -> bool:
        """Run (the rest of) one epoch; True when it completed (the next one starts at 0)."""
        port, st, s, control = self._port, self._state, self._s, self._control
        pub, step, bell = port.publish, self._step, port.doorbell
        pub(ev.EpochStarted(step=st.step, epoch=st.epoch))
        control.begin_epoch()
        error: BaseException | None = None
        try:
            it = self._data.open()
            total = s.train_len
            accumulate = s.accumulate
            max_steps = s.max_steps if s.max_steps is not None else -1
            complete = False  # the data ran out or StopEpoch: not cut by max_steps / a stop
            while True:  # per step: a few attribute reads decide to go on
                if control.stop_epoch:
                    complete = True
                    break
                if self._stop.reason is not None or st.step == max_steps:
                    break
                if bell.rings != self._demand_rings:  # the one signal: an int compare
                    self._reread_routes()  # pays for its wants and decision steps
                accumulation_steps = accumulate
                if total is not None and total - st.batch_in_epoch < accumulate:
                    accumulation_steps = total - st.batch_in_epoch  # the epoch's last, short step
                    if accumulation_steps <= 0:
                        complete = True
                        break
                outcome = step.run(it, accumulation_steps)
                if outcome.batches == 0:
                    complete = True
                    break
                if outcome.taken:
                    self._after_step(outcome)
                if outcome.exhausted:  # the data ran out inside the step: probe it once only
                    complete = self._stop.reason is None
                    break
            if total is not None and st.batch_in_epoch >= total and self._stop.reason is None:
                complete = True  # max_steps reached on the epoch's last batch
            if st.closed_epoch == st.epoch:  # its last step did the epoch's end work: it is
                complete = True  # complete, also when a stop was applied at that step's poll
            if st.batch_in_epoch == 0 and not self._finished():
                raise self._data.empty_error()
            # The epoch's end found only now (data of unknown length, a StopEpoch), or the
            # end of the run: what no step closed yet (one evaluation per step).
            self._close_step(ends_epoch=complete and st.closed_epoch != st.epoch, cadence=False)
        except BaseException as exc:
            error = exc
            raise
        finally:
            ended = ev.EpochEnded(step=st.step, epoch=st.epoch, batches=st.batch_in_epoch,
                                  error=error)  # fmt: skip
            pub(ended)
            if error is None:
                control.barrier_then_poll(ended, common=True)
        return complete

    # ================================================================== after a step
    def _after_step(self, outcome: StepOutcome) -> None:
        """After a step :class:`Step` took: its evaluation if one is due, then its poll point.

        The evaluation comes first, so that what the step's poll applies (a checkpoint decided
        on its ``StepEnded``) comes after it: a step's checkpoint holds the state after the
        step's evaluation and, for the step that ends an epoch of known length, after the
        epoch's end work too (:meth:`_close_step`); a resume from it starts after them and
        never repeats them (docs/reliability.md).

        A declared decision step delivers everything, waits for ``StepEnded``'s async
        subscribers and applies what they decided, before the next step (docs/events.md); a
        barrier event (``StepEnded`` / ``MetricsLogged`` in ``barriers``) waits for its own
        subscribers; any other step polls only when something is pending.
        """
        st, s = self._state, self._s
        ends_epoch = st.batch_in_epoch >= self._epoch_len
        if (
            ends_epoch
            or st.step == self._last_step
            or (s.eval_every is not None and st.step % s.eval_every == 0)
        ):  # a few int compares on the other steps
            self._close_step(ends_epoch=ends_epoch, cadence=True)
        if st.step == self._decision_step:  # the step clock: one int compare when not due
            self._decision_step = self._next_decision(st.step)
            self._control.decide(outcome.ended, outcome.barrier_event,
                                 common=self._sync is not None)  # fmt: skip
        elif outcome.barrier_event is not None:
            self._control.barrier_then_poll(outcome.barrier_event)
        else:
            self._poll_if_pending()
        if self._sync is not None and self._log_window.agree_due():
            self._control.agree()  # a rank had commands at this log window's close

    def _reread_routes(self) -> None:
        """The doorbell rang: re-read the wanted events and the next decision step."""
        self._demand_rings = self._port.doorbell.rings  # first: a ring from now on is heard
        self._wants.refresh()
        self._decision_step = self._next_decision(self._state.step)

    def _poll_if_pending(self) -> None:
        """The poll point of a step with nothing special: poll only when a subscriber failed,
        a command waits, a cancel was asked or a ``"block"`` buffer is full. Each of those rings
        the bus' doorbell: while it has not rung since the last look, one attribute read."""
        port = self._port
        rings = port.doorbell.rings
        if rings == self._rings_seen:
            return
        # Read before the checks: a ring after this read is heard at the next step.
        self._rings_seen = rings
        if port.failure is not None or port.has_commands() or self._cancel.requested or port.held:
            self._control.poll()
            self._rings_seen = -1  # look again next step: the poll may have left some pending

    def _next_decision(self, step: int) -> int:
        """The first declared decision step after ``step`` (-1: none)."""
        if self._agreed is not None:
            every, at = self._agreed
            later = [(step // n + 1) * n for n in every] + [k for k in at if k > step]
            return min(later, default=-1)
        nxt = self._port.next_decision(step)
        return -1 if nxt is None else nxt

    def _agree_schedules(self) -> None:
        """torchrun: make the step clock's decision steps common sync points. Every rank
        contributes the schedules its subscriptions declared (usually only rank 0 runs them),
        all take the union for the whole run (one all-gather), so a command decided at a
        declared step is agreed and applied at that step on every rank. Later declarations
        do not join: a step only some ranks treated as a sync point would hang the others."""
        assert self._sync is not None
        schedules = self._port.decision_steps
        every = [int(n) for n in (getattr(x, "n", None) for x in schedules) if n is not None]
        at = [int(k) for k in (getattr(x, "step", None) for x in schedules) if k is not None]
        self._agreed = self._sync.agree_schedules(every, at)
        self._decision_step = self._next_decision(self._state.step)

    # ================================================================== evaluation
    def _close_step(self, *, ends_epoch: bool, cadence: bool) -> None:
        """The step's evaluation, once for every cadence that asks for it, then, when the step
        ends the epoch, the epoch scheduler's step.

        One rule for every cadence: a step already evaluated (by another cadence, an
        ``Evaluate`` command, or before the checkpoint a run resumed from) is not evaluated
        again (``TrainState.evaluated_step``). The round's ``triggers`` name every cadence
        due here: ``"steps"`` (``eval_every``), ``"epoch"`` (``eval_at_epoch_end``, the epoch
        completed and the run not stopping) and ``"end"`` (``eval_at_end``, with ``eval_every``
        or ``eval_at_epoch_end`` set: the run completes with this step).

        Args:
            ends_epoch: The step completed the epoch's batches and its end work has not run
                yet (ignored once the run is stopping).
            cadence: Ask the ``eval_every`` cadence too (after a step; not at an epoch's end
                found later).
        """
        s, st = self._s, self._state
        running = self._stop.reason is None
        ends_epoch = ends_epoch and running
        ends: tuple[ev.EvaluationEnded, ...] = ()
        if s.eval_data is not None and st.evaluated_step != st.step:
            triggers: list[EvalTrigger] = []
            if cadence and s.eval_every is not None and st.step % s.eval_every == 0:
                triggers.append("steps")
            if ends_epoch and s.eval_at_epoch_end:
                triggers.append("epoch")
            last = st.step >= self._last_step or (
                ends_epoch and s.max_epochs is not None and st.epoch + 1 >= s.max_epochs
            )
            if (last and running and s.eval_at_end
                    and (s.eval_every is not None or s.eval_at_epoch_end)):  # fmt: skip
                triggers.append("end")
            if triggers:
                ends = self._evaluator.run(triggers[0], triggers=tuple(triggers))
        if ends_epoch:
            st.epoch_closed()
            if s.scheduler is not None and s.scheduler_interval == "epoch":
                self._scheduler.step(always=True, replayed=st.step == self._first_step)
        if ends:
            # Every set's subscribers are waited for (each EvaluationEnded is a barrier), then
            # the commands they sent are applied once, after the whole round and the epoch's
            # scheduler step: a checkpoint saved here holds both.
            self._control.barrier_then_poll(ends[-1], *ends[:-1], common=True)

"""One optimizer step, written once, with everything it may carry.

:class:`Step` runs one optimizer step over its micro-batches and reads top to bottom
in the event order of docs/events.md: per micro-batch the fetch (traced as ``"data_wait"``),
hook ``"batch"``, the forward and its loss (hooks ``"after_forward"``, ``"loss"``), the backward
(hook ``"after_backward"``); the non-finite check; the optimizer step (hooks
``"before_optimizer_step"`` / ``"after_optimizer_step"``); the scheduler, ``StepEnded`` and the
log window's ``MetricsLogged``. What comes after a step that was taken (the poll point, a
decision step's barrier, an evaluation) is the loop's: :class:`Step` reports what it published
through :attr:`Step.ended` and :attr:`Step.barrier_event`.

A custom step (``train_step=``, :mod:`~trainbus._loop.custom`) is two more branches of the same
code: the user's function where the forward, loss and backward of a micro-batch are, and
:meth:`CustomStep.finish <trainbus._loop.custom.CustomStep.finish>` where the optimizer step is.

Every event and hook is a branch: a flag of :class:`~trainbus._loop.wants.Wants` (resolved once
per routing change, when the port's doorbell rang) or the hook tuple of its point; each part
runs inside the opt-in trace (``SpanTraced``), a shared do-nothing context when it is off. A step
nobody observes runs the same code and pays those reads, nothing else: there is no second
copy of the step.

:meth:`Step.run` runs the steps between two the loop must look after back to back (a run of
steps ends at the log step, a declared decision step, an evaluation step, a barrier, a step
not taken, the data's end, or when the port's doorbell rings), so what is the same for all of
them (the wanted events, the settings) is read once per run, not once per step.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .. import events as ev
from .._tensors import batch_size, move_to_device
from .accumulation import ItemWeights, count_items
from .data import END
from .gradsync import GradSync
from .nonfinite import mean_tensor
from .result import Cancelled

if TYPE_CHECKING:
    from .._bus import LoopPort
    from ..checkpoint import TrainState
    from .custom import CustomStep
    from .hooks import Hooks, StepContext
    from .nonfinite import NonFiniteGuard
    from .phases import StepPhases
    from .settings import Settings
    from .wants import Wants
    from .window import LogWindow

__all__ = ["Step", "StepParts"]


@dataclass(frozen=True, slots=True)
class StepParts:
    """What a step works with. The loop builds it once and hands it to :class:`Step`.

    Attributes:
        settings: The run's settings (model, loss, optimizer, scheduler, clipping, device).
        port: Where the step's events go; asked whether it needs the loop's attention.
        state: The run's train state (step, epoch, batch in epoch, samples seen).
        wants: Which events someone listens to (refreshed by the loop when the routes change).
        hooks: The inline hooks, read every step (they may come and go).
        phases: The step's phases (forward, backward, optimizer step, with their events).
        guard: The non-finite guard (which losses are kept, read and checked).
        log_window: The log window each step is added to, and closed at the log step.
        scheduler_step: Steps the scheduler with its events (interval ``"step"``).
        lr: The current learning rate, for ``StepEnded``.
        cancelled: True when a cancel was requested (a cancel also rings the port's
            doorbell, which the step reads between micro-batches).
        custom: The user's ``train_step`` (:mod:`~trainbus._loop.custom`): it replaces the
            forward, loss and backward of each micro-batch and the optimizer step; None: the
            default step.
    """

    settings: Settings
    port: LoopPort
    state: TrainState
    wants: Wants
    hooks: Hooks
    phases: StepPhases
    guard: NonFiniteGuard
    log_window: LogWindow
    scheduler_step: Callable[..., None]
    lr: Callable[[], float]
    cancelled: Callable[[], bool]
    custom: CustomStep | None = None


class Step:
    """Runs optimizer steps, with their hooks and events (see the module's docstring).

    Attributes (of the last step of the last :meth:`run`):
        taken: It took an optimizer step (False: the data ran out before a loss, every
            micro-batch was skipped, the non-finite guard skipped the update, or a hook skipped
            the optimizer step). Only a step taken has a poll point after it.
        exhausted: It found the data exhausted (fewer batches than its micro-batches).
        ended: The ``StepEnded`` it published (None: nobody wanted it).
        barrier_event: Its event that is a barrier (``StepEnded`` or ``MetricsLogged`` listed
            in ``barriers``), None when neither is.

    Args:
        parts: What the step works with.
    """

    def __init__(self, parts: StepParts) -> None:
        p = parts
        self._s, self._port, self._state, self._wants = p.settings, p.port, p.state, p.wants
        self._hooks, self._phases, self._guard, self._log_window = (
            p.hooks,
            p.phases,
            p.guard,
            p.log_window,
        )
        self._scheduler_step, self._lr, self._cancelled = p.scheduler_step, p.lr, p.cancelled
        self._custom = p.custom
        # Loaders yield CPU tensors: on the CPU the device move would be a no-op traversal.
        self._move = p.settings.device.type != "cpu"
        # Under DDP with accumulate > 1: no_sync() for all but the last micro-batch.
        self._grad_sync = GradSync(p.settings.model)
        by = p.settings.accumulate_by
        # accumulate_by="items": micro-batches weigh n_i / N (None: 1 / accumulation_steps each).
        self._items = None if by == "batches" else ItemWeights(count_items if by == "items" else by)
        self.taken = self.exhausted = False
        self.ended: ev.StepEnded | None = None
        self.barrier_event: ev.BaseEvent | None = None

    def run(self, it: Iterator[Any], accumulation_steps: int, steps: int = 1) -> int:
        """Run up to ``steps`` optimizer steps of up to ``accumulation_steps`` micro-batches each
        from ``it``, back to back.

        The loop gives as ``steps`` the steps up to and including the next one it must look
        after (a declared decision step, an evaluation step, ``max_steps``; only full steps
        of the epoch). The run also ends after a step that was not taken, one that found the
        data exhausted, the log step, a barrier event, or a step after which the port's
        doorbell rang (a command, a failure, a routing change, a cancel, a stop): what the loop
        does after a step is then its own. Between the steps of one run there is nothing for
        the loop to do, so the flags it resolved for the run
        (:class:`~trainbus._loop.wants.Wants`, re-read after a ring) are read once here.

        Each step reads top to bottom in event order; the forward, backward and optimizer step
        are :class:`~trainbus._loop.phases.StepPhases`', each publishing only what is wanted.

        Returns:
            The batches consumed (0: the iterator was exhausted before the first).

        Raises:
            Cancelled: a cancel was requested.
            BaseException: Whatever the model, loss, backward, optimizer or a hook raised,
                with a note naming the phase, step, epoch and batch.
        """
        w, pub, st, s, phases = self._wants, self._port.publish, self._state, self._s, self._phases
        guard, custom, hooks, opt = self._guard, self._custom, self._hooks, s.optimizer
        bell, cancelled = self._port.doorbell, self._cancelled
        monotonic, move = time.monotonic, self._move
        rings = bell.rings  # read first: a ring from here on ends the run after its step
        if cancelled():  # asked before the read above; a later cancel rings the doorbell
            raise Cancelled
        # The wants change only after a ring, which ends the run: read once for all its steps.
        trace = w.trace
        each_step_ended, sampled, demand = w.step_ended, w.step_ended_sampled, w.step_ended_demand
        # Every step's loss is kept: the log window's mean (and FitResult.train_metrics, for
        # any run length) is over all of them. A loss that goes on (in an event, to the log window)
        # is kept detached; one only the guard reads stays as it is: detach() costs ~1 µs, and
        # the guard's read does not need it (the log window then takes the value read).
        read_each = guard.per_step and custom is None  # the guard reads the losses: CPU, "skip"
        # Read at sync, a custom step's log window keeps what ctx.backward was given as well.
        check_backward = custom is not None and guard.active and not guard.per_step
        hand_on_each = not read_each  # else the log window takes it
        # On an accelerator the loss handed on is a copy: a loss a CUDA graph returns
        # (torch.compile's mode="reduce-overhead", a graph the step replays itself) lives in
        # the graph's output buffer, which the next replay overwrites before a subscriber or
        # the log window reads it. One small device copy per step; none on the CPU.
        copy = s.device.type != "cpu"
        schedule = s.scheduler is not None and s.scheduler_interval == "step"
        log_every, barriers, add = s.log_every, s.barriers, self._log_window.add
        taken = False
        ended: ev.StepEnded | None = None
        barrier: ev.BaseEvent | None = None
        done = consumed = 0
        several = (
            accumulation_steps > 1
        )  # several micro-batches: DDP's all-reduce waits for its last
        # Weighed by items, a step's batches are all fetched before its first forward (the
        # step's item count scales the first backward already); None: fetched one by one.
        # Also for a step of one micro-batch (an epoch's short last step): its weight is then 1.
        items = self._items
        for _ in range(steps):
            taken, ended, barrier = False, None, None
            by_point = hooks.by_point  # hooks may come and go between steps
            step = st.step
            t0 = tf = monotonic()  # the step's first fetch starts with it
            losses: list[torch.Tensor] = []
            samples = consumed = 0
            data_wait = 0.0
            stepped = False
            log_step = (step + 1) % log_every == 0
            # Sampled StepEnded subscribers only (stream(..., every_s= / every_steps=)): built
            # only when one of them takes it; the port's demand answers, the sampling stays in
            # the bus.
            step_ended = each_step_ended or (sampled and demand.takes(step + 1, t0))
            hand_on = hand_on_each or step_ended
            bi = -1  # the last micro-batch's index in the epoch, set by the first fetch
            ahead: deque[Any] | None = None  # the step's prefetched batches (by items)
            weights: list[float] = []
            if custom is not None:
                custom.begin()
            # ------------------------------------------------------------ micro-batches
            for micro in range(accumulation_steps):
                if bell.rings != rings and cancelled():
                    raise Cancelled
                if micro:
                    tf = monotonic()
                if ahead is None:
                    with trace("data_wait", "train", st.batch_in_epoch, micro):
                        batch = next(it, END)
                    if items is not None and batch is not END:
                        ahead, weights = self._prefetch(it, batch, accumulation_steps, items)
                else:
                    batch = ahead.popleft() if ahead else END
                fetched = monotonic()
                data_wait += fetched - tf
                if batch is END:
                    break
                bi = st.batch_taken()
                consumed += 1
                if move:
                    batch = move_to_device(batch, s.device)
                if several:
                    self._grad_sync.begin(
                        micro, accumulation_steps
                    )  # before the forward: DDP decides there
                ctx: StepContext | None = None
                if by_point["batch"]:
                    ctx = phases.context(bi, micro, batch)
                    for hook in by_point["batch"]:
                        hook(ctx)
                    if ctx.skip:
                        continue
                    batch = ctx.batch
                    if move:  # a hook may replace the batch: the model sees the run's device
                        batch = move_to_device(batch, s.device)
                samples += batch_size(batch)
                if weights:  # the backward's scale (a custom step's ctx.backward too)
                    phases.weigh(weights[micro])
                if custom is None:
                    loss = phases.forward(batch, bi, ctx, micro)
                    if loss is None:  # a hook skipped the micro-batch
                        continue
                else:  # the user's forwards and backwards, and (last) optimizer steps
                    loss = custom.micro_batch(batch, bi, micro, accumulation_steps)
                stepped = True
                kept = loss.detach() if hand_on else loss
                if copy and hand_on:
                    kept = kept.clone()
                # The step's loss (the mean of `losses`) is then the step's item-weighted
                # mean, what one batch of the step's items reports.
                losses.append(kept if not weights else kept * (weights[micro] * len(weights)))
                if custom is None:
                    phases.backward(loss, accumulation_steps, bi, micro)
                if several:
                    self._grad_sync.backward_done()
            if several:
                self._grad_sync.finish()  # a step cut short after no_sync() backwards
            st.samples_done(samples)
            done += consumed
            if not stepped:
                opt.zero_grad(set_to_none=True)
                break
            value: torch.Tensor | float | None = None  # the step's loss for the log window
            if custom is None:
                # -------------------------------------------------------- non-finite check
                if read_each:
                    # The guard reads the losses (free on the CPU); the log window keeps the value.
                    value = guard.read_step(losses)
                    if value is None:
                        # A non-finite loss ("skip", or "stop" before the bad update): no
                        # optimizer step, no scheduler, no StepEnded, like a hook's skip.
                        # "raise" raised in read_step.
                        opt.zero_grad(set_to_none=True)
                        break
                # -------------------------------------------------------- optimizer step
                took, grad_norm = phases.optimizer_step(bi)
            else:  # the user's optimizer steps, checked on ctx.backward's losses before each
                took, grad_norm = self._custom_end(custom, losses, bi)
            if not took:
                break  # a hook skipped the step: no step, no scheduler, no StepEnded
            taken = True
            # ------------------------------------------------------------ scheduler
            if schedule:
                self._scheduler_step(always=False)
            # ------------------------------------------------------------ StepEnded
            step_loss: torch.Tensor | None = None  # the mean of the kept losses, when needed
            if losses and (step_ended or value is None):
                step_loss = losses[0] if len(losses) == 1 else mean_tensor(losses)
                if check_backward and custom is not None:  # its ctx.backward losses too
                    step_loss = custom.checked(step_loss)
            if step_ended:
                assert step_loss is not None  # kept: someone wants StepEnded
                ended = ev.StepEnded(
                    step=step + 1, epoch=st.epoch, loss=step_loss, lr=self._lr(),
                    grad_norm=grad_norm, samples=samples, data_wait_s=data_wait,
                    duration_s=monotonic() - t0,
                )  # fmt: skip
                if sampled:  # the sampled streams measure the next one from its stamp
                    demand.built(ended.time)
                pub(ended)
                if ev.StepEnded in barriers:
                    barrier = ended
            # ------------------------------------------------------------ MetricsLogged
            add(step_loss if value is None else value, grad_norm, samples)
            if log_step:
                logged = self._log_window.close(w.metrics_logged)
                if logged is not None and ev.MetricsLogged in barriers:
                    barrier = logged
                break
            if barrier is not None or consumed < accumulation_steps or bell.rings != rings:
                break
        self.taken, self.ended, self.barrier_event = taken, ended, barrier
        self.exhausted = consumed < accumulation_steps
        return done

    def _prefetch(
        self, it: Iterator[Any], first: Any, accumulation_steps: int, items: ItemWeights
    ) -> tuple[deque[Any], list[float]]:
        """The step's batches after ``first``, fetched now (plain ``next``: the data-wait
        span of the step's first fetch covers them), and the weight of each micro-batch.

        Returns:
            ``(the batches after the first, [n_i / N for the first and those])``.
        """
        ahead: deque[Any] = deque()
        for _ in range(accumulation_steps - 1):
            batch = next(it, END)
            if batch is END:
                break
            ahead.append(batch)
        return ahead, items.weights([first, *ahead])

    def _custom_end(
        self, custom: CustomStep, losses: list[torch.Tensor], bi: int
    ) -> tuple[bool, torch.Tensor | None]:
        """A custom step's micro-batches are done: its deferred optimizer steps, the returned
        losses' non-finite check (``"raise"`` / ``"stop"``; the update is already taken), and the
        step count.

        Returns:
            ``(some optimizer stepped, grad norm)``.
        """
        took, grad_norm = custom.finish(bi)
        if not took:
            return False, None
        guard = self._guard
        if guard.per_step and guard.policy != "skip" and losses:
            try:
                guard.skip_update(losses)
            except BaseException as exc:
                exc.add_note(f"trainbus: the loss train_step {custom.name} returned")
                raise
        self._state.step_done()
        return True, grad_norm

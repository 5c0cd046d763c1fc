"""Ordinary steps: the common case of the step, run back to back in one tight loop.

Most optimizer steps of a run have nothing to do but train: one micro-batch, no hook, no
per-phase event wanted, full precision, and they are not the step a log window closes at, a
declared decision step or an evaluation step. :class:`OrdinarySteps` runs a
stretch of such steps without going back to the loop between them. Per step it pays what the
step itself needs (fetch, forward, backward, optimizer step), the non-finite check, the
window's bookkeeping, ``StepEnded`` when someone wants it, and one look at whether the bus
needs attention (its doorbell: a routing change, a command, a ``"raise"`` subscriber failure,
a cancel) or a hook was added, which ends the stretch so the loop can poll. Everything else
(the first step's loss check, the log step, decision steps, evaluations, accumulation, hooks,
mixed precision, barriers on ``StepEnded``) stays with :meth:`trainbus.loop.step.Step.run`.

What a stretch publishes and changes is exactly what as many calls of ``Step.run`` would:
the same events with the same fields, in the same order (``SchedulerStepping`` /
``SchedulerStepped``, then ``StepEnded``), the same train state. Pinned by the step tests and
``tests/test_ordinary_steps.py``, which runs every option both ways.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from .. import events as ev
from .._tensors import batch_size, move_to_device
from .data import END

if TYPE_CHECKING:
    from .step import StepParts

__all__ = ["OrdinarySteps"]


class OrdinarySteps:
    """Runs consecutive ordinary optimizer steps (see the module's docstring).

    Attributes:
        exhausted: The last :meth:`run` found the epoch's iterator exhausted.

    Args:
        parts: What the step works with (shared with :class:`~trainbus.loop.step.Step`). Its
            ``cancelled`` is read before a stretch; a cancel rings the bus' doorbell, heard
            after each step.
        prompt_commands: Queued commands are applied at the next step (one process). False
            under torchrun, where they wait for the next common sync point: a stretch then
            does not stop for them.
    """

    def __init__(self, parts: StepParts, *, prompt_commands: bool = True) -> None:
        p = parts
        self._s, self._bus, self._state, self._wants = p.settings, p.bus, p.state, p.wants
        self._hooks, self._phases, self._guard, self._window = p.hooks, p.phases, p.guard, p.window
        self._scheduler_step, self._lr, self._cancelled = p.scheduler_step, p.lr, p.cancelled
        self._prompt = prompt_commands
        self.exhausted = False

    def possible(self) -> bool:
        """True when the next step may be ordinary as far as the step's shape goes: one
        micro-batch per step, no hook, no per-phase or step-extra event wanted, full precision,
        the first loss checked, ``StepEnded`` not a barrier. (:meth:`limit` adds the
        step-number conditions.)"""
        w, s = self._wants, self._s
        return not (
            s.accumulate != 1
            or w.phases
            or w.step_extras
            or self._hooks.any
            or self._phases.instrumented_precision
            or not self._phases.loss_checked
            or ((w.step_ended or w.step_ended_sampled) and ev.StepEnded in s.barriers)
        )

    def limit(self, decision_step: int) -> int:
        """How many of the next steps are ordinary: 0 unless :meth:`possible`, else the steps
        before the next log step, declared decision step or evaluation step (those take
        ``Step.run``), within ``max_steps`` and the epoch's batches.

        Args:
            decision_step: The next declared decision step (-1: none).
        """
        if not self.possible():
            return 0
        st, s = self._state, self._s
        step = st.step
        special = (step // s.log_every + 1) * s.log_every
        if decision_step > step:
            special = min(special, decision_step)
        if s.eval_every is not None and s.eval_data is not None:
            special = min(special, (step // s.eval_every + 1) * s.eval_every)
        limit = special - 1 - step
        if s.max_steps is not None:
            limit = min(limit, s.max_steps - step)
        if s.train_len is not None:
            limit = min(limit, s.train_len - st.batch_in_epoch)
        return limit

    def run(self, it: Iterator[Any], limit: int) -> int:
        """Run up to ``limit`` ordinary steps from ``it``.

        Stops early when the iterator is exhausted (:attr:`exhausted`), after a step whose
        loss was not finite (the guard applied its policy), or after a step at which the bus
        needs attention or a hook was added (the loop then polls, as after any step).

        Args:
            it: The epoch's batch iterator.
            limit: The most steps to run (the steps before the next step that is not
                ordinary, and before the epoch's end).

        Returns:
            The batches consumed (each one step, or one skipped non-finite update).

        Raises:
            NonFiniteLossError: a non-finite loss under ``on_nonfinite="raise"``.
            BaseException: Whatever the model, loss, backward or optimizer raised, with a note
                naming the phase, step, epoch and batch.
        """
        s, st, w, bus, guard = self._s, self._state, self._wants, self._bus, self._guard
        model, loss_fn, opt = s.model, s.loss_fn, s.optimizer
        add, pub, phases, hooks = self._window.add, bus.publish, self._phases, self._hooks
        optimizer_step = phases.plain_optimizer_step
        move = s.device if s.device.type != "cpu" else None
        schedule = s.scheduler is not None and s.scheduler_interval == "step"
        # The guard reads every loss (the CPU, where it is free, or "skip"): the window keeps
        # the float. Otherwise the window keeps the detached tensor and reads it at its close
        # when the guard or a subscriber needs the losses (as Step.run does).
        read = guard.per_step
        keep = guard.active or w.metrics_logged or w.step_ended or w.step_ended_sampled
        check = guard.per_step
        agreed = guard.collective  # "skip" under several ranks: every rank asks every step
        every, sampled, due = w.step_ended, w.step_ended_sampled, w.step_ended_due
        by_step = due.takes_step if due.periods else None  # routes change: the stretch ends
        bell = bus.doorbell
        seen = bell.rings  # read before the look below: a later ring is heard after a step
        if (
            bus.failure is not None
            or self._cancelled()
            or (self._prompt and bus.has_commands())
            or bus.held  # a full "block" buffer: the loop's poll waits for it first
        ):
            return 0  # something to act on already: the loop polls first
        isfinite, monotonic, is_tensor = math.isfinite, time.monotonic, torch.Tensor
        self.exhausted = False
        done = 0
        loss: Any
        while done < limit:
            t0 = monotonic()
            batch = next(it, END)
            fetched = monotonic()
            if batch is END:
                self.exhausted = True
                break
            bi = st.batch_in_epoch
            st.batch_in_epoch = bi + 1
            done += 1
            if move is not None:
                batch = move_to_device(batch, move)
            if type(batch) is tuple and len(batch) == 2 and type(batch[0]) is is_tensor:
                samples = batch[0].shape[0] if batch[0].dim() else 1
                if loss_fn is not None:
                    inputs, targets = batch
                    try:
                        loss = loss_fn(model(inputs), targets)
                    except BaseException as exc:
                        phases.annotate(exc, "forward", bi)
                        raise
                else:
                    loss = phases.plain_loss(batch, bi)
            else:
                samples = batch_size(batch)
                loss = phases.plain_loss(batch, bi)
            try:
                loss.backward()
            except BaseException as exc:
                phases.annotate(exc, "backward", bi)
                raise
            st.samples_seen += samples
            value: torch.Tensor | float | None = None
            detached: torch.Tensor | None = None
            if read:
                value = loss.item()
                if check and (agreed or not isfinite(value)) and guard.skip_update([loss.detach()]):
                    opt.zero_grad(set_to_none=True)  # "skip" / "stop": no update, no StepEnded
                    break
            elif keep:
                value = detached = loss.detach()
            grad_norm = optimizer_step(bi)
            st.step += 1
            if schedule:
                self._scheduler_step(always=False)
            if every or (  # or a sampled subscriber takes this one
                sampled and (due.at <= t0 or (by_step is not None and by_step(st.step)))
            ):
                if detached is None:
                    detached = loss.detach()
                pub(ev.StepEnded(step=st.step, epoch=st.epoch, loss=detached, lr=self._lr(),
                                 grad_norm=grad_norm, samples=samples, data_wait_s=fetched - t0,
                                 duration_s=monotonic() - t0))  # fmt: skip
            add(value, grad_norm, samples)
            # One attribute read: the bus rings after a routing change, a command, a "raise"
            # failure, a cancel; a hook added during the stretch runs from the next step on.
            if bell.rings != seen or hooks.any:
                break
        return done

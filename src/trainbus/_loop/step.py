"""One optimizer step (ARCHITECTURE.md, "The loop"; event order: docs/events.md)."""

from __future__ import annotations

import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from .. import events as ev
from .._exceptions import TrainingError
from .._tensors import batch_size, move_to_device
from .context import TrainContext
from .forward import metric_targets

if TYPE_CHECKING:
    from .._bus import LoopPort
    from ..checkpoint import TrainState
    from .context import StepRunner
    from .control import CancelFlag
    from .hooks import Hooks
    from .nonfinite import NonFiniteGuard
    from .settings import Settings
    from .wants import Wants
    from .window import LogWindow

__all__ = [
    "END",
    "GradSync",
    "SchedulerStepper",
    "Step",
    "StepOutcome",
    "count_items",
    "item_weights",
]

END = object()  # what next(it, END) returns from an exhausted iterator


class StepOutcome(NamedTuple):
    """What one :meth:`Step.run` did."""

    taken: bool  # an optimizer step was taken: only then does a poll point follow
    exhausted: bool  # fewer batches than the step's micro-batches (none included)
    ended: ev.StepEnded | None = None  # None: nobody wanted it
    barrier_event: ev.BaseEvent | None = None  # StepEnded or MetricsLogged, when in `barriers`


class Step:
    """Runs one optimizer step per :meth:`run` (see the module's docstring)."""

    def __init__(
        self,
        settings: Settings,
        port: LoopPort,
        state: TrainState,
        wants: Wants,
        hooks: Hooks,
        runner: StepRunner,
        guard: NonFiniteGuard,
        log_window: LogWindow,
        scheduler: SchedulerStepper,
        cancel: CancelFlag,
    ) -> None:
        self._s, self._port, self._state, self._wants = settings, port, state, wants
        self._hooks, self._runner, self._guard = hooks, runner, guard
        self._log_window, self._scheduler, self._cancel = log_window, scheduler, cancel
        # Off the CPU the batch moves to the device and the loss handed on is a copy: a CUDA
        # graph's next replay overwrites its output buffer (docs/compile.md).
        self._move = settings.device.type != "cpu"
        self._grad_sync = GradSync(settings.model)
        self._ctx = TrainContext(runner)  # the run's one: the runner keeps no reference to it
        by = settings.accumulate_by
        self._count: Callable[[Any], int] | None = None
        if by != "batches":
            self._count = count_items if by == "items" else by
        self._schedule = settings.scheduler is not None and settings.scheduler_interval == "step"
        self._check_later = guard.active and not guard.per_step  # the log window reads the loss

    def run(self, it: Iterator[Any], accumulation_steps: int) -> StepOutcome:
        """Run one optimizer step of up to ``accumulation_steps`` micro-batches from ``it``;
        ``Cancelled`` when a cancel was asked between them."""
        st, runner, trace = self._state, self._runner, self._wants.trace
        batch_hooks = self._hooks.by_point["batch"]  # hooks may come and go between steps
        step = runner.begin()
        t0 = tf = time.monotonic()  # the step's first fetch starts with it
        losses: list[torch.Tensor] = []
        samples = 0
        data_wait = 0.0
        exhausted = False  # the data ended before the step's last micro-batch
        several = accumulation_steps > 1
        ahead: deque[Any] | None = None  # the step's prefetched batches (by items)
        weights: list[float] = []
        for micro in range(accumulation_steps):
            if micro:
                self._cancel.check()
                tf = time.monotonic()
            if ahead is None:
                if trace.on:
                    with trace("data_wait", "train", st.batch_in_epoch, micro):
                        batch = next(it, END)
                else:
                    batch = next(it, END)
                if self._count is not None and batch is not END:
                    ahead, weights = self._prefetch(it, batch, accumulation_steps, self._count)
            else:
                batch = ahead.popleft() if ahead else END
            data_wait += time.monotonic() - tf
            if batch is END:
                exhausted = True
                break
            bi = st.batch_taken()
            if self._move:
                batch = move_to_device(batch, self._s.device)
            if several:  # before the forward: DDP decides there
                self._grad_sync.begin(micro, accumulation_steps)
            hook_ctx = None
            if batch_hooks:
                hook_ctx = runner.hook_context(bi, micro, batch)
                runner.run_hooks("batch", batch_hooks, hook_ctx)
                if hook_ctx.skip:
                    continue
                batch = hook_ctx.batch
                if self._move:  # a hook may replace the batch: the model sees the run's device
                    batch = move_to_device(batch, self._s.device)
            samples += batch_size(batch)
            if weights:  # the backward's scale
                runner.weigh(weights[micro])
            loss = runner.call(self._ctx, batch, bi, micro, accumulation_steps, hook_ctx)
            if loss is None:  # a hook skipped the micro-batch
                continue
            if self._move:
                loss = loss.clone()
            # Weighed by items, the step's loss (the mean of `losses`) is the item-weighted
            # mean, what one batch of the step's items reports.
            losses.append(loss if not weights else loss * (weights[micro] * len(weights)))
            if several:
                self._grad_sync.backward_done()
        if several:
            self._grad_sync.finish()  # a step cut short after no_sync() backwards
        st.samples_done(samples)
        if not losses:
            runner.drop_gradients()
            return StepOutcome(False, exhausted)
        took, grad_norm = runner.finish(self._ctx)
        if not took:  # skipped by a hook or the non-finite check: no scheduler, no StepEnded
            return StepOutcome(False, exhausted)
        if not runner.same:  # a custom step returned other losses than it gave to backward
            self._check_returned(losses, step + 1)
        if self._schedule:
            self._scheduler.step(always=False)
        # The mean with each loss divided before the sum (nonfinite.mean's rule), on the device.
        step_loss = losses[0] if len(losses) == 1 else torch.stack(losses).div(len(losses)).sum()
        if self._check_later:
            step_loss = runner.checked(step_loss)
        w, s = self._wants, self._s
        ended: ev.StepEnded | None = None
        barrier: ev.BaseEvent | None = None
        if w.step_ended or (w.step_ended_sampled and w.step_ended_demand.takes(step + 1, t0)):
            ended = ev.StepEnded(
                step=step + 1,
                epoch=st.epoch,
                loss=step_loss,
                lr=self._scheduler.lr(),
                grad_norm=grad_norm,
                samples=samples,
                data_wait_s=data_wait,
                duration_s=time.monotonic() - t0,
            )
            if w.step_ended_sampled:  # the sampled streams measure the next one from its stamp
                w.step_ended_demand.built(ended.time)
            self._port.publish(ended)
            if ev.StepEnded in s.barriers:
                barrier = ended
        self._log_window.add(step_loss, grad_norm, samples)
        if (step + 1) % s.log_every == 0:
            logged = self._log_window.close(w.metrics_logged)
            if logged is not None and ev.MetricsLogged in s.barriers:
                barrier = logged
        return StepOutcome(True, exhausted, ended, barrier)

    def _check_returned(self, losses: list[torch.Tensor], step: int) -> None:
        """The per-step check of the losses a custom step returned but did not backward."""
        guard, runner = self._guard, self._runner
        if not guard.per_step or guard.policy == "skip":
            return
        try:
            guard.skip_update(losses, step)
        except BaseException as exc:
            exc.add_note(f"trainbus: the loss train_step {runner.name} returned")
            raise

    def _prefetch(
        self, it: Iterator[Any], first: Any, accumulation_steps: int, count: Callable[[Any], int]
    ) -> tuple[deque[Any], list[float]]:
        """The step's batches after ``first``, fetched now, and each batch's ``n_i / N``."""
        ahead: deque[Any] = deque()
        for _ in range(accumulation_steps - 1):
            batch = next(it, END)
            if batch is END:
                break
            ahead.append(batch)
        return ahead, item_weights(count, [first, *ahead])


# ---------------------------------------------------------------------- accumulation
# Accumulate(n, by="items" | fn) weighs micro-batch i by n_i / N (docs/trainer.md, "Gradient
# accumulation"): N is needed before the first backward, so such a step fetches its batches first.

IGNORE_INDEX = -100  # the label of an item the loss ignores (PyTorch's and Hugging Face's)


def count_items(batch: Any) -> int:
    """The labels ``!= -100`` of ``batch`` (its metric targets), counted on the host."""
    labels: Any = None
    if isinstance(batch, Mapping | tuple | list):
        try:
            labels = metric_targets(batch)
        except TrainingError:  # a mapping without "labels"
            labels = None
    if not isinstance(labels, torch.Tensor):
        raise TrainingError(
            'Accumulate(n, by="items") counts the labels != -100 of a mapping batch\'s "labels" or '
            "of the targets of an (inputs, targets) batch; this batch "
            f"({type(batch).__name__}) has no labels tensor there: pass Accumulate(n, by=fn), "
            "fn(batch) -> the number of items its loss averages over"
        )
    return int((labels != IGNORE_INDEX).sum())


def item_weights(count: Callable[[Any], int], batches: Sequence[Any]) -> list[float]:
    """``n_i / N`` for each of a step's ``batches`` (all 0 when the step holds no item)."""
    counts: list[int] = []
    for batch in batches:
        n = count(batch)
        if isinstance(n, torch.Tensor) and n.numel() == 1 and not n.is_floating_point():
            n = int(n)
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            name = getattr(count, "__qualname__", repr(count))
            raise TrainingError(
                f"Accumulate(by={name}) returned {n!r} for a batch: it must return the number "
                "of items the batch's loss averages over, an int >= 0"
            )
        counts.append(n)
    total = sum(counts)
    return [n / total if total else 0.0 for n in counts]


# ---------------------------------------------------------------------- DDP's gradient sync
class GradSync:
    """Under DDP, lets only a step's last micro-batch's backward all-reduce (what
    ``no_sync()`` does, by its public flag)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._ddp = model if isinstance(model, DistributedDataParallel) else None
        self._deferring = False
        self._unreduced = False  # the last backward ran without a reduction
        if self._ddp is not None:
            self._ddp.require_backward_grad_sync = True  # a failed run may have left it off

    def begin(self, micro: int, accumulation_steps: int) -> None:
        """Before micro-batch ``micro``'s forward: its backward reduces only if it is the last."""
        ddp = self._ddp
        if ddp is None:
            return
        self._deferring = micro < accumulation_steps - 1
        ddp.require_backward_grad_sync = not self._deferring

    def backward_done(self) -> None:
        """A micro-batch's backward ran (reduced, or deferred to the last one)."""
        self._unreduced = self._deferring

    def finish(self) -> None:
        """Before the optimizer step: reduce again, and average what a step cut short left."""
        ddp = self._ddp
        if ddp is None:
            return
        ddp.require_backward_grad_sync = True
        self._deferring = False
        if not self._unreduced:
            return
        self._unreduced = False
        world = dist.get_world_size()
        for p in ddp.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad.div_(world)


# ---------------------------------------------------------------------- the LR scheduler
# torch's warning for a scheduler stepped before its optimizer in this process.
_BEFORE_OPTIMIZER = r"Detected call of `lr_scheduler\.step\(\)` before `optimizer\.step\(\)`"


class SchedulerStepper:
    """Steps the scheduler and publishes ``SchedulerStepped``."""

    def __init__(self, settings: Settings, port: LoopPort, state: TrainState, wants: Wants) -> None:
        self._s, self._port, self._state, self._wants = settings, port, state, wants

    def lr(self) -> float:
        """The optimizer's current learning rate of parameter group 0."""
        return float(self._s.optimizer.param_groups[0]["lr"])

    def step(self, *, always: bool, replayed: bool = False) -> None:
        """``scheduler.step()``, then ``SchedulerStepped`` (if wanted, or ``always``).
        ``replayed``: a resume's epoch end before any optimizer step (torch's warning muted)."""
        pub, st, w, s = self._port.publish, self._state, self._wants, self._s
        assert s.scheduler is not None
        try:
            with w.trace("scheduler_step"):
                if replayed:
                    with warnings.catch_warnings():
                        warnings.filterwarnings("ignore", _BEFORE_OPTIMIZER, UserWarning)
                        s.scheduler.step()
                else:
                    s.scheduler.step()
        except BaseException as exc:
            if always or w.scheduler_stepped:
                pub(ev.SchedulerStepped(step=st.step, epoch=st.epoch, lr=self.lr(), error=exc))
            if s.scheduler_interval == "step" and "Tried to step" in str(exc):
                # OneCycleLR's total_steps counted batches, or the last short step of an epoch
                per_epoch = "?" if s.train_len is None else -(-s.train_len // s.accumulate)
                exc.add_note(
                    f"trainbus: the scheduler steps once per optimizer step (here step "
                    f"{st.step}, epoch {st.epoch}): {per_epoch} per epoch, ceil(batches / "
                    f"accumulate={s.accumulate}), the last short one included"
                )
            raise
        if always or w.scheduler_stepped:
            pub(ev.SchedulerStepped(step=st.step, epoch=st.epoch, lr=self.lr()))

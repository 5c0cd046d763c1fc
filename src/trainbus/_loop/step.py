"""One optimizer step: the training step as a user writes one and its context (docs/trainer.md,
"Custom steps"), the user's ``train_step`` (or the default one) called on each micro-batch, and
what its context asks done (ARCHITECTURE.md, "The loop"; event order: docs/events.md)."""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from .. import events as ev
from .._exceptions import ConfigError, TrainingError
from .._log import get_logger
from .._tensors import batch_size, move_to_device, plain_value
from .forward import loss_of, metric_targets, model_outputs
from .hooks import StepContext

if TYPE_CHECKING:
    from .._bus import LoopPort
    from ..checkpoint import TrainState
    from .hooks import Hooks
    from .nonfinite import NonFiniteGuard
    from .optimizers import SchedulerStepper
    from .result import CancelFlag
    from .settings import Settings
    from .wants import Wants
    from .window import LogWindow

__all__ = [
    "END",
    "GradSync",
    "Step",
    "StepOutcome",
    "TrainContext",
    "count_items",
    "default_train_step",
    "item_weights",
]

log = get_logger(__name__)


def default_train_step(ctx: TrainContext) -> torch.Tensor | None:
    """The step trainbus runs when ``Trainer(train_step=)`` is not given: forward and loss,
    backward, and (at the step's last micro-batch) the optimizer step."""
    loss = ctx.compute_loss()
    if loss is None:  # an after_forward or loss hook skipped the batch
        return None
    ctx.backward(loss)
    ctx.optimizer_step()
    return loss


class TrainContext:
    """What ``train_step`` gets for each micro-batch: the batch, the model, the optimizers, and
    the calls the default step makes. One per run, its fields the current micro-batch's: see
    docs/trainer.md, "Custom steps".

    Attributes:
        batch: The batch, on the run's device (after the ``batch`` hooks).
        batch_index: The batch's index in the epoch.
        micro_batch: Its position among the step's micro-batches (0 without accumulation).
        accumulation_steps: The step's micro-batches (``accumulate``, shorter at an epoch's end).
    """

    __slots__ = ("_runner", "accumulation_steps", "batch", "batch_index", "micro_batch")

    def __init__(self, runner: Step) -> None:
        self._runner = runner
        self.batch: Any = None
        self.batch_index = self.micro_batch = 0
        self.accumulation_steps = 1

    @property
    def step(self) -> int:
        """Optimizer steps completed before this one (the step being taken is ``step + 1``)."""
        return self._runner.step

    @property
    def epoch(self) -> int:
        """The epoch in progress."""
        return self._runner.state.epoch

    @property
    def model(self) -> torch.nn.Module:
        """The model being trained (DDP-wrapped under torchrun)."""
        return self._runner.settings.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The run's optimizer (with several, one that steps them all)."""
        return self._runner.settings.optimizer

    @property
    def optimizers(self) -> Mapping[str, torch.optim.Optimizer]:
        """Every optimizer by name (``{"default": optimizer}`` for one)."""
        return self._runner.settings.optimizers

    @property
    def device(self) -> torch.device:
        """The run's device."""
        return self._runner.settings.device

    @property
    def last_micro_batch(self) -> bool:
        """This is the step's last micro-batch: :meth:`optimizer_step` steps now."""
        return self.micro_batch == self.accumulation_steps - 1

    def compute_loss(self) -> torch.Tensor | None:
        """Forward and loss of ``ctx.batch``, with their hooks, as the default step computes them.

        Returns:
            The loss, or None when an ``after_forward`` or ``loss`` hook skipped the batch.
        """
        return self._runner.compute_loss(self)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of ``loss``, weighed for accumulation and scaled under fp16, then the
        ``after_backward`` hooks; ``loss`` joins the non-finite check.

        Raises:
            TrainingError: ``loss`` is not a scalar tensor that requires grad.
        """
        self._runner.backward(loss, self)

    def optimizer_step(self, name: str | None = None) -> bool:
        """Step the run's optimizer (every one of several; ``name``: that one) at the step's
        last micro-batch, with the non-finite check, clipping, hooks and ``zero_grad``.

        Returns:
            True when it stepped now; False on an earlier micro-batch (the gradients
            accumulate), when a ``before_optimizer_step`` hook skipped it, or when the
            non-finite check skipped the step's update.

        Raises:
            ConfigError: ``name`` is not one of the run's optimizers.
        """
        return self._runner.optimizer_step(name, self)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The run's mixed-precision context for a forward (a no-op at ``precision="32"``)."""
        return self._runner.settings.autocast()

    def log(self, name: str, value: torch.Tensor | float) -> None:
        """Log a metric of this step (its mean over the log window reaches ``MetricsLogged``).

        Raises:
            ConfigError: a reserved name or a value that is not a number / one-element tensor.
        """
        self._runner.user.log(name, value)


END = object()  # what next(it, END) returns from an exhausted iterator


class StepOutcome(NamedTuple):
    """What one :meth:`Step.run` did."""

    taken: bool  # an optimizer step was taken: only then does a poll point follow
    exhausted: bool  # fewer batches than the step's micro-batches (none included)
    ended: ev.StepEnded | None = None  # None: nobody wanted it
    barrier_event: ev.BaseEvent | None = None  # StepEnded or MetricsLogged, when in `barriers`


class Step:
    """Runs one optimizer step per :meth:`run`, calling ``train_step`` on each micro-batch and
    doing what its :class:`TrainContext` asks. ``same``: every loss returned this step was
    given to ``ctx.backward`` (its non-finite check covers them)."""

    __slots__ = (
        "_called",
        "_cancel",
        "_check_later",
        "_clean",
        "_count",
        "_deferred",
        "_each",
        "_fn",
        "_grad_sync",
        "_guard",
        "_hook_ctx",
        "_hooks",
        "_keep",
        "_last",
        "_log_window",
        "_losses",
        "_mixed",
        "_move",
        "_own",
        "_per_step",
        "_port",
        "_schedule",
        "_scheduler",
        "_skip",
        "_skipped",
        "_skipped_any",
        "_stepped",
        "_trace",
        "_unscaled",
        "_wants",
        "_warned",
        "_weight",
        "name",
        "same",
        "settings",
        "state",
        "step",
        "user",
    )

    def __init__(
        self,
        settings: Settings,
        port: LoopPort,
        state: TrainState,
        wants: Wants,
        hooks: Hooks,
        guard: NonFiniteGuard,
        log_window: LogWindow,
        scheduler: SchedulerStepper,
        cancel: CancelFlag,
    ) -> None:
        self.settings, self.state, self.user = settings, state, log_window.user
        self._port, self._wants, self._trace = port, wants, wants.trace
        self._hooks, self._guard = hooks, guard
        self._log_window, self._scheduler, self._cancel = log_window, scheduler, cancel
        fn = settings.train_step or default_train_step
        self._fn: Callable[[TrainContext], Any] = fn
        self._own = fn is not default_train_step
        self.name = getattr(fn, "__qualname__", None) or repr(fn)
        # Off the CPU the batch moves to the device and the loss handed on is a copy: a CUDA
        # graph's next replay overwrites its output buffer (docs/compile.md).
        self._move = settings.device.type != "cpu"
        model = settings.model
        self._grad_sync = GradSync(model) if isinstance(model, DistributedDataParallel) else None
        by = settings.accumulate_by
        self._count: Callable[[Any], int] | None = None
        if by != "batches":
            self._count = count_items if by == "items" else by
        self._schedule = settings.scheduler is not None and settings.scheduler_interval == "step"
        self._check_later = guard.active and not guard.per_step  # the log window reads the loss
        # What the grad scaler unscales and steps for the run's optimizer: each of several.
        self._each = tuple(settings.optimizers.values()) or (settings.optimizer,)
        self._keep = guard.active  # the backward losses are kept for the non-finite check
        self._per_step = guard.per_step  # and checked before each update
        self._mixed = settings.precision != "32"
        self._warned: set[str] = set()
        self._hook_ctx: StepContext | None = None  # the micro-batch's, once a hook needed one
        self._last: torch.Tensor | None = None  # the loss of the call's ctx.backward
        self._clean = True  # every gradient is None: the step need not zero them first
        self._weight: float | None = None

    def run(self, ctx: TrainContext, it: Iterator[Any], accumulation_steps: int) -> StepOutcome:
        """Run one optimizer step of up to ``accumulation_steps`` micro-batches from ``it`` on
        ``ctx``, the run's one (kept by the caller: it refers to this step); ``Cancelled`` when
        a cancel was asked between them."""
        st, trace = self.state, self._trace
        batch_hooks = self._hooks.by_point["batch"]  # hooks may come and go between steps
        self._stepped: dict[str | None, torch.Tensor | None] = {}  # optimizer -> grad norm
        self._deferred: list[str | None] = []  # asked to step at an earlier micro-batch
        self._called: set[str | None] = set()  # asked to step (a custom step's)
        self._losses: list[torch.Tensor] = []  # given to ctx.backward, not checked yet
        self._skip = self._unscaled = self._skipped = self._skipped_any = False
        step = self.step = st.step  # the steps done before this one
        self.same = True
        if not self._clean:  # gradients a custom step left
            self._drop_gradients()
        ctx.accumulation_steps = accumulation_steps
        t0 = tf = time.monotonic()  # the step's first fetch starts with it
        losses: list[torch.Tensor] = []
        samples = 0
        data_wait = 0.0
        exhausted = False  # the data ended before the step's last micro-batch
        sync = self._grad_sync if accumulation_steps > 1 else None
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
                batch = move_to_device(batch, self.settings.device)
            if sync is not None:  # before the forward: DDP decides there
                sync.begin(micro, accumulation_steps)
            hook_ctx = None
            if batch_hooks:
                hook_ctx = self._hook_context(bi, micro, batch)
                self._run_hooks("batch", batch_hooks, hook_ctx)
                if hook_ctx.skip:
                    continue
                batch = hook_ctx.batch
                if self._move:  # a hook may replace the batch: the model sees the run's device
                    batch = move_to_device(batch, self.settings.device)
            samples += batch_size(batch)
            if weights:  # the backward's scale, not 1 / accumulation_steps
                self._weight = weights[micro]
            ctx.batch, ctx.batch_index, ctx.micro_batch = batch, bi, micro
            loss = self._call(ctx, bi, hook_ctx)
            if loss is None:  # a hook skipped the micro-batch
                continue
            if self._move:
                loss = loss.clone()
            # Weighed by items, the step's loss (the mean of `losses`) is the item-weighted
            # mean, what one batch of the step's items reports.
            losses.append(loss if not weights else loss * (weights[micro] * len(weights)))
            if sync is not None:
                sync.backward_done()
        if sync is not None:
            sync.finish()  # a step cut short after no_sync() backwards
        st.samples_done(samples)
        if not losses:
            self._drop_gradients()
            return StepOutcome(False, exhausted)
        took, grad_norm = self._finish(ctx)
        if not took:  # skipped by a hook or the non-finite check: no scheduler, no StepEnded
            return StepOutcome(False, exhausted)
        if not self.same:  # a custom step returned other losses than it gave to backward
            self._check_returned(losses, step + 1)
        if self._schedule:
            self._scheduler.step(always=False)
        # The mean with each loss divided before the sum (nonfinite.mean's rule), on the device.
        step_loss = losses[0] if len(losses) == 1 else torch.stack(losses).div(len(losses)).sum()
        if self._check_later:
            step_loss = self._checked(step_loss)
        w, s = self._wants, self.settings
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
        guard = self._guard
        if not guard.per_step or guard.policy == "skip":
            return
        try:
            guard.skip_update(losses, step)
        except BaseException as exc:
            exc.add_note(f"trainbus: the loss train_step {self.name} returned")
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

    def _hook_context(
        self, bi: int, micro: int, batch: Any, optimizer: torch.optim.Optimizer | None = None
    ) -> StepContext:
        """A fresh hook context for batch ``bi`` of the step (``optimizer`` None: the run's)."""
        st, s = self.state, self.settings
        return StepContext(
            step=st.step,
            epoch=st.epoch,
            batch_index=bi,
            micro_batch=micro,
            batch=batch,
            model=s.model,
            optimizer=s.optimizer if optimizer is None else optimizer,
            metrics_sink=self.user.log,
        )

    def _annotate(self, exc: BaseException, where: str, bi: int) -> None:
        """Note the part, step, epoch and batch on an exception from the step."""
        st = self.state
        exc.add_note(f"trainbus: raised in {where} at step {st.step}, epoch {st.epoch}, batch {bi}")

    # ------------------------------------------------------------------ the call
    def _call(
        self, ctx: TrainContext, bi: int, hook_ctx: StepContext | None
    ) -> torch.Tensor | None:
        """Call ``train_step`` on ``ctx``'s micro-batch (batch ``bi``): the loss it returned,
        detached and 0-d, or None when a hook skipped the batch."""
        self._hook_ctx, self._last = hook_ctx, None
        try:
            out = self._fn(ctx)
        except BaseException as exc:
            if self._own:
                st = self.state
                exc.add_note(
                    f"trainbus: raised in train_step {self.name} at step "
                    f"{st.step + 1}, epoch {st.epoch}, batch {bi}"
                )
            raise
        backwarded = self._last
        if backwarded is not None and out is backwarded:  # given to ctx.backward: checked
            loss = backwarded
        elif out is None and self._skipped:
            self._skipped, self._skipped_any = False, True
            return None
        else:  # another loss than the backward's: checked after the update too
            self.same = False
            loss = self._returned(out, bi)
        loss = loss.detach()
        return loss.reshape(()) if loss.dim() else loss

    def _returned(self, out: Any, bi: int) -> torch.Tensor:
        """The loss in what ``train_step`` returned (a mapping's other entries are logged)."""
        where = f"at step {self.step + 1}, batch {bi}"
        if isinstance(out, Mapping) and "loss" not in out:
            raise TrainingError(
                f"train_step {self.name} returned a mapping without a 'loss' entry (keys: "
                f"{', '.join(map(repr, out))}) {where}: return the step's loss (a scalar "
                "tensor) or a mapping with a 'loss' entry"
            )
        loss: Any = out
        if isinstance(out, Mapping):
            loss = out.get("loss")
            for key, value in out.items():
                if key != "loss":
                    self.user.log(str(key), value)
        if isinstance(loss, int | float) and not isinstance(loss, bool):
            loss = torch.tensor(float(loss))
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            got = (
                "None"
                if loss is None
                else (
                    f"a tensor of shape {tuple(loss.shape)}"
                    if isinstance(loss, torch.Tensor)
                    else type(out).__name__
                )
            )
            raise TrainingError(
                f"train_step {self.name} returned {got} {where}: return the step's loss (a "
                "scalar tensor) or a mapping with a 'loss' entry"
            )
        return loss

    # ------------------------------------------------------------------ forward and loss
    def compute_loss(self, ctx: TrainContext) -> torch.Tensor | None:
        """``ctx.compute_loss()``; None when a hook skipped the batch."""
        trace = self._trace
        try:
            if trace.on or self._mixed:
                with (
                    trace("forward", "train", ctx.batch_index, ctx.micro_batch),
                    self.settings.autocast(),
                ):
                    outputs, loss = self._outputs_and_loss(ctx)
            else:
                outputs, loss = self._outputs_and_loss(ctx)
        except BaseException as exc:
            self._annotate(exc, "forward", ctx.batch_index)
            raise
        if loss is None:
            self._skipped = True
            return None
        hooks = self._hooks.by_point["loss"]
        if hooks:
            hc = self._hook_ctx or self._hook_context(ctx.batch_index, ctx.micro_batch, ctx.batch)
            hc.outputs, hc.loss = outputs, loss
            self._run_hooks("loss", hooks, hc)
            if hc.skip:
                self._skipped = True
                return None
            loss = hc.loss
        return loss

    def _outputs_and_loss(self, ctx: TrainContext) -> tuple[Any, torch.Tensor | None]:
        """The outputs after the ``after_forward`` hooks, and the loss (None: skipped)."""
        s = self.settings
        outputs, targets = model_outputs(s, ctx.batch)
        hooks = self._hooks.by_point["after_forward"]
        if hooks:
            if self._hook_ctx is None:
                self._hook_ctx = self._hook_context(ctx.batch_index, ctx.micro_batch, ctx.batch)
            hc = self._hook_ctx
            hc.outputs = outputs
            self._run_hooks("after_forward", hooks, hc)
            outputs = hc.outputs
            if hc.skip:
                return outputs, None
        return outputs, loss_of(s, outputs, targets)

    def _run_hooks(self, point: str, hooks: tuple[Any, ...], hc: StepContext) -> None:
        """Run ``hooks`` on ``hc``; warn once per point about a hook that returns the value it
        should set (None and a bool, a ``lambda``'s ``a and b``, are not warned about)."""
        field = _REPLACED.get(point)
        for hook in hooks:
            out = hook(hc)
            if field is None or out is None or isinstance(out, bool) or point in self._warned:
                continue
            self._warned.add(point)
            warnings.warn(
                f"the {point!r} hook {getattr(hook, '__qualname__', hook)!r} returned a value, "
                f"which trainbus ignores: set {field} = ... (or ctx.skip = True) instead "
                "(warned once per point)",
                RuntimeWarning,
                stacklevel=2,
            )

    # ------------------------------------------------------------------ backward
    def backward(self, loss: Any, ctx: TrainContext) -> None:
        """``ctx.backward(loss)``; a loss that is not a scalar tensor requiring grad is refused
        when its backward fails (torch checks it there)."""
        if self._keep:  # read only for its value: kept as it is
            self._losses.append(loss)
        self._last, self._clean = loss, False
        weight = self._weight
        try:
            if weight is not None:
                scaled = loss * weight
            elif ctx.accumulation_steps > 1:
                scaled = loss / ctx.accumulation_steps
            else:
                scaled = loss
            scaler = self.settings.scaler
            if scaler is not None:
                scaled = scaler.scale(scaled)
            if self._trace.on:
                with self._trace("backward", "train", ctx.batch_index, ctx.micro_batch):
                    scaled.backward()
            else:
                scaled.backward()
        except BaseException as exc:
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
                self._refuse(loss, ctx.batch_index, exc)
            self._annotate(exc, "backward", ctx.batch_index)
            if "backward through the graph a second time" in str(exc):
                exc.add_note(
                    "trainbus: this loss's graph was already backwarded (ctx.backward or "
                    "loss.backward() twice on one loss): call it once per loss"
                )
            raise
        hooks = self._hooks.by_point["after_backward"]
        if hooks:
            hc = self._hook_context(ctx.batch_index, ctx.micro_batch, ctx.batch)
            hc.loss = loss
            self._run_hooks("after_backward", hooks, hc)

    def _refuse(self, loss: Any, bi: int, exc: BaseException) -> None:
        """Raise the error for a loss that is not a scalar tensor that requires grad."""
        st = self.state
        where = f"at step {st.step}, epoch {st.epoch}, batch {bi}"
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            got = (
                f"a tensor of shape {tuple(loss.shape)}"
                if isinstance(loss, torch.Tensor)
                else repr(type(loss))
            )
            fix = "Reduce it (e.g. .mean()) in loss_fn or the model"
            if self.settings.loss_fn is None:
                fix = (
                    "Without loss_fn the model must return the loss: pass loss_fn= (e.g. "
                    "torch.nn.CrossEntropyLoss()) if it returns outputs"
                )
            raise TrainingError(
                f"the loss must be a scalar tensor; got {got} {where}. {fix}"
            ) from exc
        raise TrainingError(
            f"the loss does not require grad {where}: it is detached from the model's parameters"
        ) from exc

    # ------------------------------------------------------------------ optimizer steps
    def optimizer_step(self, name: str | None, ctx: TrainContext) -> bool:
        """``ctx.optimizer_step(name)``: step at the last micro-batch, else defer."""
        if name is not None and name not in self.settings.optimizers:
            raise ConfigError.invalid(
                f"ctx.optimizer_step in train_step {self.name}",
                name,
                "one of the optimizers: " + ", ".join(map(repr, self.settings.optimizers)),
            )
        if self._own:
            self._called.add(name)
        if ctx.micro_batch != ctx.accumulation_steps - 1:
            if name not in self._deferred:
                self._deferred.append(name)
            return False
        return self._step_now(name, ctx)

    def _step_now(self, name: str | None, ctx: TrainContext) -> bool:
        """Check the pending backward losses, then step optimizer ``name`` (None: the run's)."""
        if self._skip or name in self._stepped:
            return False
        s = self.settings
        if self._losses and self._per_step:  # the non-finite check of the losses not checked yet
            pending, self._losses = self._losses, []
            try:
                self._skip = self._guard.skip_update(pending, self.step + 1)
            except BaseException as exc:
                if self._own:
                    names = s.optimizers if name is None else (name,)
                    exc.add_note(
                        f"trainbus: a loss given to ctx.backward in train_step "
                        f"{self.name} before stepping optimizer "
                        f"{', '.join(map(repr, names))}"
                    )
                raise
            if self._skip:  # no update in this step
                self.zero_grad(s.optimizer, ctx.batch_index)
                return False
        opt = s.optimizer if name is None else s.optimizers[name]
        scaler = s.scaler
        if scaler is not None:
            for o in self._each if name is None else (opt,):
                scaler.unscale_(o)
            self._unscaled = True
        hooks = self._hooks.by_point["before_optimizer_step"]
        if hooks:
            hc = self._hook_context(ctx.batch_index, ctx.micro_batch, ctx.batch, opt)
            self._run_hooks("before_optimizer_step", hooks, hc)
            if hc.skip:
                self.zero_grad(opt, ctx.batch_index)
                return False
        if self._own and self._clean:
            self._warn_no_backward(opt)
        grad_norm: torch.Tensor | None = None
        if s.clip_grad_norm is not None:
            params = s.model.parameters() if name is None else _params_of(opt)
            # A sharded (FSDP2) model's norm is a replicated DTensor: its plain value.
            grad_norm = plain_value(torch.nn.utils.clip_grad_norm_(params, s.clip_grad_norm))
        try:
            if self._trace.on:
                with self._trace("optimizer_step"):
                    self._update(opt, name)
            else:
                self._update(opt, name)
        except BaseException as exc:
            self._annotate(exc, "optimizer step", ctx.batch_index)
            raise
        if name is None:  # the run's one update: the step is taken now
            self.state.step_done()
        self._stepped[name] = grad_norm
        self.zero_grad(opt, ctx.batch_index)
        hooks = self._hooks.by_point["after_optimizer_step"]
        if hooks:
            hc = self._hook_context(ctx.batch_index, ctx.micro_batch, ctx.batch, opt)
            hc.step = self.step + 1  # the step this update completes
            self._run_hooks("after_optimizer_step", hooks, hc)
        return True

    def _update(self, opt: torch.optim.Optimizer, name: str | None) -> None:
        scaler = self.settings.scaler
        if scaler is None:
            opt.step()
        else:
            for o in self._each if name is None else (opt,):
                scaler.step(o)

    def _drop_gradients(self) -> None:
        """Drop every gradient, untraced."""
        self.settings.optimizer.zero_grad(set_to_none=True)
        self._clean = True

    def zero_grad(self, optimizer: torch.optim.Optimizer, bi: int) -> None:
        """``optimizer.zero_grad(set_to_none=True)``, traced as ``"zero_grad"``."""
        try:
            if self._trace.on:
                with self._trace("zero_grad"):
                    optimizer.zero_grad(set_to_none=True)
            else:
                optimizer.zero_grad(set_to_none=True)
        except BaseException as exc:
            self._annotate(exc, "zero_grad", bi)
            raise
        if optimizer is self.settings.optimizer:
            self._clean = True

    def _finish(self, ctx: TrainContext) -> tuple[bool, torch.Tensor | None]:
        """After the micro-batches: the deferred steps, the scaler's update, a custom step's
        checks; ``(some optimizer stepped, the pre-clip grad norm or None)``."""
        for name in self._deferred:
            self._step_now(name, ctx)
        stepped = self._stepped
        if self._unscaled:
            assert self.settings.scaler is not None
            self.settings.scaler.update()
        if self._own:
            self._check_called(ctx)
        ctx.batch = None  # the batch is not kept past its step
        if None in stepped:  # the run's update: the step was counted then
            return True, stepped[None]
        if not stepped:
            return False, None
        self.state.step_done()  # named optimizers stepped: the step is taken now
        norms = [n for n in stepped.values() if n is not None]
        if len(norms) <= 1:
            return True, norms[0] if norms else None
        return True, torch.linalg.vector_norm(torch.stack(norms))

    def _check_called(self, ctx: TrainContext) -> None:
        """A whole step of a custom step that stepped no optimizer is an error; one that left
        a named optimizer out is warned about once."""
        called = self._called
        whole = ctx.micro_batch == ctx.accumulation_steps - 1 and not self._skipped_any
        if not whole or self._skip:
            return
        if not called:
            raise TrainingError(
                f"train_step {self.name} never called ctx.optimizer_step() in step "
                f"{self.step + 1} (epoch {self.state.epoch}, batch {ctx.batch_index}): "
                "call it in every step (it steps at the step's last micro-batch), or the run "
                "never counts a step; it replaces an optimizer.step() of your own, and "
                "Trainer(accumulate=n) an accumulation of your own"
            )
        if None in called:
            return
        for name in self.settings.optimizers:
            if name not in called and name not in self._warned:
                self._warned.add(name)
                warnings.warn(
                    f"train_step {self.name} did not step optimizer {name!r} at step "
                    f"{self.step + 1}: call ctx.optimizer_step({name!r}) (warned once per "
                    "optimizer)",
                    RuntimeWarning,
                    stacklevel=3,
                )
                log.warning(
                    "optimizer_not_stepped", step_fn=self.name, optimizer=name, step=self.state.step
                )

    def _warn_no_backward(self, opt: torch.optim.Optimizer) -> None:
        """Warn once when a custom step steps an optimizer none of whose parameters has a
        gradient (no ``ctx.backward`` since its last step)."""
        if "backward" in self._warned:
            return
        self._warned.add("backward")  # checked once: a step that trains keeps training
        if any(p.grad is not None for p in _params_of(opt)):
            return  # a backward of its own (loss.backward()): it trains
        warnings.warn(
            f"train_step {self.name} stepped the optimizer with no gradients at step "
            f"{self.step + 1}: call ctx.backward(loss) before ctx.optimizer_step() (warned "
            "once)",
            RuntimeWarning,
            stacklevel=4,
        )

    def _checked(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss``, or NaN when a loss given to ``ctx.backward`` was not finite (on the
        device: the log window's read finds this step)."""
        if self.same or not self._losses:
            return loss
        finite = torch.isfinite(torch.stack([x.detach() for x in self._losses])).all()
        return torch.where(finite, loss, loss.new_full((), math.nan))


# The hook points whose hooks replace a value, and the context's field they set.
_REPLACED = {"batch": "ctx.batch", "after_forward": "ctx.outputs", "loss": "ctx.loss"}


def _params_of(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The parameters ``optimizer`` updates (what a named optimizer step clips)."""
    return [p for g in optimizer.param_groups for p in g["params"]]


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

    def __init__(self, ddp: DistributedDataParallel) -> None:
        self._ddp = ddp
        self._deferring = False
        self._unreduced = False  # the last backward ran without a reduction
        ddp.require_backward_grad_sync = True  # a failed run may have left it off

    def begin(self, micro: int, accumulation_steps: int) -> None:
        """Before micro-batch ``micro``'s forward: its backward reduces only if it is the last."""
        self._deferring = micro < accumulation_steps - 1
        self._ddp.require_backward_grad_sync = not self._deferring

    def backward_done(self) -> None:
        """A micro-batch's backward ran (reduced, or deferred to the last one)."""
        self._unreduced = self._deferring

    def finish(self) -> None:
        """Before the optimizer step: reduce again, and average what a step cut short left."""
        ddp = self._ddp
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

"""The training step as a user writes one, and the context it runs on.

Every step is a function ``train_step(ctx)`` that :class:`~trainbus._loop.step.Step` calls once
per micro-batch with a :class:`TrainContext`. Without ``Trainer(train_step=)`` it is
:func:`default_train_step`, the code a user would write::

    def default_train_step(ctx):
        loss = ctx.compute_loss()  # forward and loss, with their hooks
        if loss is None:           # an after_forward or loss hook skipped the batch
            return None
        ctx.backward(loss)
        ctx.optimizer_step()       # at the step's last micro-batch
        return loss

What the context does for a step:

- ``ctx.compute_loss()``: the model's forward on ``ctx.batch`` under the run's precision, the
  ``after_forward`` hooks, ``loss_fn`` (or the loss the model returns), the ``loss`` hooks;
  traced as ``"forward"``. None when a hook skipped the batch.
- ``ctx.backward(loss)``: the loss checked (a scalar tensor that requires grad), divided by the
  step's micro-batches (or weighed by its items), scaled by the fp16 grad scaler, traced as
  ``"backward"``, then the ``after_backward`` hooks; the loss joins the non-finite check.
- ``ctx.optimizer_step(name=None)``: at the step's last micro-batch, the optimizer's step
  (every optimizer of the run; ``name``: that one only) with unscaling, clipping, the
  ``before/after_optimizer_step`` hooks, traced as ``"optimizer_step"``, and its ``zero_grad``.
  On an earlier micro-batch the gradients accumulate and it returns False (a step cut short by
  the data steps it at the end). Under ``on_nonfinite="skip"`` (and on the CPU, for every
  policy) the losses given to ``ctx.backward`` are checked before the update.
- ``ctx.autocast()``: the run's precision context; ``ctx.log(name, value)``: a metric.

``train_step`` returns the micro-batch's loss: a tensor, a number, or a mapping with a
``"loss"`` entry whose other scalar entries are logged as metrics. The run's step count
advances once per step in which some optimizer stepped: at ``ctx.optimizer_step()`` (the run's
one update, so its ``after_optimizer_step`` hooks see the step done), or after ``train_step``
returned when it stepped named optimizers (each of their hooks sees the same step).
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from .._exceptions import ConfigError, TrainingError
from .._log import get_logger
from .._tensors import plain_value
from .forward import loss_of, model_outputs
from .hooks import StepContext

if TYPE_CHECKING:
    from ..checkpoint import TrainState
    from .hooks import Hooks
    from .logged import UserMetrics
    from .nonfinite import NonFiniteGuard
    from .settings import Settings
    from .trace import Tracer

__all__ = ["StepRunner", "TrainContext", "default_train_step"]

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
    """What ``train_step`` gets for one micro-batch (see :mod:`trainbus._loop.context`).

    Attributes:
        batch: The batch, on the run's device (after the ``batch`` hooks).
        batch_index: The batch's index in the epoch.
        micro_batch: Its position among the step's micro-batches (0 without accumulation).
        accumulation_steps: The step's micro-batches (``accumulate``, shorter at an epoch's end).
    """

    __slots__ = ("_runner", "accumulation_steps", "batch", "batch_index", "micro_batch")

    def __init__(
        self, runner: StepRunner, batch: Any, batch_index: int, micro_batch: int,
        accumulation_steps: int,
    ) -> None:  # fmt: skip
        self._runner = runner
        self.batch, self.batch_index = batch, batch_index
        self.micro_batch, self.accumulation_steps = micro_batch, accumulation_steps

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
        """Forward and loss of ``ctx.batch`` as the default step computes them (see the module
        docstring).

        Returns:
            The loss, or None when an ``after_forward`` or ``loss`` hook skipped the batch.
        """
        return self._runner.compute_loss(self)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of ``loss`` as trainbus does it (see the module docstring).

        Raises:
            TrainingError: ``loss`` is not a scalar tensor that requires grad.
        """
        self._runner.backward(loss, self)

    def optimizer_step(self, name: str | None = None) -> bool:
        """Step the run's optimizer (every one of several; ``name``: that one) at the step's
        last micro-batch (see the module docstring).

        Returns:
            True when it stepped now; False on an earlier micro-batch (the gradients
            accumulate), when a ``before_optimizer_step`` hook skipped it, or when the
            non-finite check skipped the step's update.

        Raises:
            ConfigError: ``name`` is not one of the run's optimizers.
        """
        last = self.micro_batch == self.accumulation_steps - 1
        return self._runner.optimizer_step(name, self.batch_index, last)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The run's mixed-precision context for a forward (a no-op at ``precision="32"``)."""
        return self._runner.settings.autocast()

    def log(self, name: str, value: torch.Tensor | float) -> None:
        """Log a metric of this step (its mean over the log window reaches ``MetricsLogged``).

        Raises:
            ConfigError: a reserved name or a value that is not a number / one-element tensor.
        """
        self._runner.user.log(name, value)


class StepRunner:
    """Calls ``train_step`` for :class:`~trainbus._loop.step.Step` and does what its context
    asks (forward, backward, optimizer steps), with their hooks and traces.

    Attributes:
        settings: The run's settings.
        state: The run's train state.
        user: Where ``ctx.log`` and a returned mapping's extra entries go.
        name: The step function's name, for messages.
        step: Optimizer steps completed when the current step began.
        same: Every loss ``train_step`` returned in this step is the one it gave to
            ``ctx.backward`` (the default step): the non-finite check of the backward losses
            covers them.

    Args:
        settings: The run's settings.
        state: The run's train state.
        hooks: The inline hooks.
        guard: The non-finite guard (checks the backward losses before an update).
        tracer: The opt-in trace of the step's parts.
        user: Where logged metrics go.
    """

    def __init__(
        self,
        settings: Settings,
        state: TrainState,
        hooks: Hooks,
        guard: NonFiniteGuard,
        tracer: Tracer,
        user: UserMetrics,
    ) -> None:
        self.settings, self.state, self.user = settings, state, user
        self._hooks, self._guard, self._trace = hooks, guard, tracer
        fn = settings.train_step or default_train_step
        self._fn: Callable[[TrainContext], Any] = fn
        self._own = fn is not default_train_step
        self.name = getattr(fn, "__qualname__", None) or repr(fn)
        # What the grad scaler unscales and steps for the run's optimizer: each of several.
        self._each = tuple(settings.optimizers.values()) or (settings.optimizer,)
        self._keep = guard.active  # the backward losses are kept for the non-finite check
        self._mixed = settings.precision != "32"
        self._warned: set[str] = set()
        self._batch: Any = None  # what the step's later hooks see as ctx.batch
        self._hook_ctx: StepContext | None = None  # the micro-batch's, once a hook needed one
        self._clean = True  # every gradient is None: the step need not zero them first
        self._weight: float | None = None
        self.begin()

    def begin(self) -> None:
        """A step begins: its bookkeeping is reset and stale gradients dropped (a custom
        step's backward may leave some in an optimizer it did not step)."""
        self._stepped: dict[str | None, torch.Tensor | None] = {}
        self._requested: list[str | None] = []
        self._called: set[str | None] = set()
        self._losses: list[torch.Tensor] = []  # given to ctx.backward, not checked yet
        self._skip = self._unscaled = self._skipped = False
        self._last: torch.Tensor | None = None
        self.step = self.state.step
        self.same = True
        if not self._clean:
            self.settings.optimizer.zero_grad(set_to_none=True)
            self._clean = True

    def weigh(self, weight: float) -> None:
        """Scale the coming backward(s) of this micro-batch by ``weight`` (its items over the
        step's: ``accumulate_by="items"``) instead of ``1 / accumulation_steps``."""
        self._weight = weight

    def hook_context(self, bi: int, micro: int, batch: Any) -> StepContext:
        """A fresh hook context for batch ``bi`` (micro-batch ``micro``) of the current step;
        ``batch`` None: the batch the model saw last."""
        st, s = self.state, self.settings
        return StepContext(step=st.step, epoch=st.epoch, batch_index=bi, micro_batch=micro,
                           batch=self._batch if batch is None else batch, model=s.model,
                           optimizer=s.optimizer, metrics_sink=self.user.log)  # fmt: skip

    def annotate(self, exc: BaseException, where: str, bi: int) -> None:
        """Add a note naming the part, step, epoch and batch to an exception from the step."""
        st = self.state
        exc.add_note(f"trainbus: raised in {where} at step {st.step}, epoch {st.epoch}, "
                     f"batch {bi}")  # fmt: skip

    # ------------------------------------------------------------------ the call
    def call(
        self, batch: Any, bi: int, micro: int, accumulation_steps: int, hook_ctx: StepContext | None
    ) -> torch.Tensor | None:
        """Call ``train_step`` on one micro-batch.

        Returns:
            The loss it returned, detached (a 0-d tensor); None when a hook skipped the batch.

        Raises:
            TrainingError: it returned no loss (None, or a mapping without ``"loss"``) or a
                loss that is not a one-element tensor or a number.
            BaseException: whatever ``train_step`` raised; a custom step's with a note naming
                it and where.
        """
        self._batch, self._hook_ctx = batch, hook_ctx
        last = self._last
        try:
            out = self._fn(TrainContext(self, batch, bi, micro, accumulation_steps))
        except BaseException as exc:
            if self._own:
                st = self.state
                exc.add_note(f"trainbus: raised in train_step {self.name} at step "
                             f"{st.step + 1}, epoch {st.epoch}, batch {bi}")  # fmt: skip
            raise
        backwarded = self._last  # the loss it gave ctx.backward in this call: checked there
        if backwarded is not None and out is backwarded and out is not last:
            loss = backwarded
        elif out is None and self._skipped:
            self._skipped = False
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
            got = "None" if loss is None else (
                f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor)
                else type(out).__name__
            )  # fmt: skip
            raise TrainingError(
                f"train_step {self.name} returned {got} {where}: return the step's loss (a "
                "scalar tensor) or a mapping with a 'loss' entry"
            )
        return loss

    # ------------------------------------------------------------------ forward and loss
    def compute_loss(self, ctx: TrainContext) -> torch.Tensor | None:
        """``ctx.compute_loss()``: the forward (traced ``"forward"``, under the run's precision,
        the ``after_forward`` hooks inside), then the ``loss`` hooks.

        Returns:
            The loss, or None when a hook skipped the batch.
        """
        bi, trace = ctx.batch_index, self._trace
        try:
            if trace.on or self._mixed:
                with trace("forward", "train", bi, ctx.micro_batch), self.settings.autocast():
                    outputs, loss = self._outputs_and_loss(ctx)
            else:
                outputs, loss = self._outputs_and_loss(ctx)
        except BaseException as exc:
            self.annotate(exc, "forward", bi)
            raise
        if loss is None:
            self._skipped = True
            return None
        hooks = self._hooks.by_point["loss"]
        if hooks:
            hc = self._hook_ctx or self.hook_context(bi, ctx.micro_batch, ctx.batch)
            hc.outputs, hc.loss = outputs, loss
            for hook in hooks:
                hook(hc)
            if hc.skip:
                self._skipped = True
                return None
            loss = hc.loss
        return loss

    def _outputs_and_loss(self, ctx: TrainContext) -> tuple[Any, torch.Tensor | None]:
        """The model's outputs, the ``after_forward`` hooks (they may replace the outputs or
        skip: loss None), the loss."""
        s = self.settings
        outputs, targets = model_outputs(s, ctx.batch)
        after_forward = self._hooks.by_point["after_forward"]
        if after_forward:
            if self._hook_ctx is None:
                self._hook_ctx = self.hook_context(ctx.batch_index, ctx.micro_batch, ctx.batch)
            hc = self._hook_ctx
            hc.outputs = outputs
            for hook in after_forward:
                hook(hc)
            outputs = hc.outputs
            if hc.skip:
                return outputs, None
        return outputs, loss_of(s, outputs, targets)

    # ------------------------------------------------------------------ backward
    def backward(self, loss: Any, ctx: TrainContext) -> None:
        """``ctx.backward``: check the loss, keep it for the non-finite check, then the
        backward (traced ``"backward"``) and the ``after_backward`` hooks."""
        bi = ctx.batch_index
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
            self._refuse(loss, bi)
        if self._keep:  # read only for its value: kept as it is
            self._losses.append(loss)
        self._last, self._clean = loss, False
        weight, n = self._weight, ctx.accumulation_steps
        if weight is not None:
            scaled = loss * weight
        else:
            scaled = loss / n if n > 1 else loss
        scaler = self.settings.scaler
        if scaler is not None:
            scaled = scaler.scale(scaled)
        try:
            if self._trace.on:
                with self._trace("backward", "train", bi, ctx.micro_batch):
                    scaled.backward()
            else:
                scaled.backward()
        except BaseException as exc:
            self.annotate(exc, "backward", bi)
            raise
        hooks = self._hooks.by_point["after_backward"]
        if hooks:
            hc = self.hook_context(bi, ctx.micro_batch, None)
            hc.loss = loss
            for hook in hooks:
                hook(hc)

    def _refuse(self, loss: Any, bi: int) -> None:
        """Raise the error for a loss that is not a scalar tensor that requires grad (checked
        on metadata only: never syncs the device)."""
        st = self.state
        where = f"at step {st.step}, epoch {st.epoch}, batch {bi}"
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            got = (f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor)
                   else repr(type(loss)))  # fmt: skip
            raise TrainingError(f"the loss must be a scalar tensor; got {got} {where}. Reduce it "
                                "(e.g. .mean()) in loss_fn or the model")  # fmt: skip
        raise TrainingError(f"the loss does not require grad {where}: it is detached from the "
                            "model's parameters")  # fmt: skip

    # ------------------------------------------------------------------ optimizer steps
    def optimizer_step(self, name: str | None, bi: int, last: bool) -> bool:
        """``ctx.optimizer_step``: step now at the last micro-batch, else defer.

        Raises:
            ConfigError: ``name`` is not one of the run's optimizers.
            NonFiniteLossError: a non-finite backward loss under ``on_nonfinite="raise"``.
        """
        if name is not None and name not in self.settings.optimizers:
            raise ConfigError.invalid(
                f"ctx.optimizer_step in train_step {self.name}", name,
                "one of the optimizers: " + ", ".join(map(repr, self.settings.optimizers)),
            )  # fmt: skip
        self._called.add(name)
        if not last:
            if name not in self._requested:
                self._requested.append(name)
            return False
        return self._step_now(name, bi)

    def _step_now(self, name: str | None, bi: int) -> bool:
        """Check the pending backward losses, then step optimizer ``name`` (None: the run's)."""
        if self._skip or name in self._stepped:
            return False
        guard = self._guard
        if guard.per_step and self._losses:
            pending, self._losses = self._losses, []
            try:
                bad = guard.skip_update(pending, self.step + 1)
            except BaseException as exc:
                if self._own:
                    names = self.settings.optimizers if name is None else (name,)
                    exc.add_note(f"trainbus: a loss given to ctx.backward in train_step "
                                 f"{self.name} before stepping optimizer "
                                 f"{', '.join(map(repr, names))}")  # fmt: skip
                raise
            if bad:  # "skip" or "stop": no update in this step
                self._skip = True
                self.zero_grad(bi, self.settings.optimizer)
                return False
        s = self.settings
        opt = s.optimizer if name is None else s.optimizers[name]
        each = self._each if name is None else (opt,)
        scaler = s.scaler
        if scaler is not None:
            for o in each:
                scaler.unscale_(o)
            self._unscaled = True
        hooks = self._hooks.by_point["before_optimizer_step"]
        if hooks:
            hc = self.hook_context(bi, 0, None)
            hc.optimizer = opt
            for hook in hooks:
                hook(hc)
            if hc.skip:
                self.zero_grad(bi, opt)
                return False
        grad_norm: torch.Tensor | None = None
        if s.clip_grad_norm is not None:
            params = s.model.parameters() if name is None else _params_of(opt)
            # A sharded (FSDP2) model's norm is a replicated DTensor: its plain value.
            grad_norm = plain_value(torch.nn.utils.clip_grad_norm_(params, s.clip_grad_norm))
        try:
            if self._trace.on:
                with self._trace("optimizer_step"):
                    self._update(opt, each)
            else:
                self._update(opt, each)
        except BaseException as exc:
            self.annotate(exc, "optimizer step", bi)
            raise
        if name is None:  # the run's one update: the step is taken now
            self.state.step_done()
        self._stepped[name] = grad_norm
        self.zero_grad(bi, opt)
        hooks = self._hooks.by_point["after_optimizer_step"]
        if hooks:
            for hook in hooks:
                hc = self.hook_context(bi, 0, None)
                hc.optimizer = opt
                hc.step = self.step + 1  # the step this update completes
                hook(hc)
        return True

    def _update(self, opt: torch.optim.Optimizer, each: tuple[torch.optim.Optimizer, ...]) -> None:
        scaler = self.settings.scaler
        if scaler is None:
            opt.step()
        else:
            for o in each:
                scaler.step(o)

    def drop_gradients(self) -> None:
        """Drop every gradient (a step that computed no loss), untraced."""
        self.settings.optimizer.zero_grad(set_to_none=True)
        self._clean = True

    def zero_grad(self, bi: int, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer.zero_grad(set_to_none=True)``, traced as ``"zero_grad"``."""
        try:
            if self._trace.on:
                with self._trace("zero_grad"):
                    optimizer.zero_grad(set_to_none=True)
            else:
                optimizer.zero_grad(set_to_none=True)
        except BaseException as exc:
            self.annotate(exc, "zero_grad", bi)
            raise
        if optimizer is self.settings.optimizer:
            self._clean = True

    def finish(self, bi: int) -> tuple[bool, torch.Tensor | None]:
        """After the micro-batches: the steps deferred by a step cut short, the grad scaler's
        update, a warning for each declared optimizer never stepped.

        Returns:
            ``(some optimizer stepped, grad norm)``: the norm of the stepped optimizers'
            pre-clip norms (None without clipping).

        Warns:
            RuntimeWarning: once per optimizer that ``train_step`` never asked to step
                (also logged as ``optimizer_not_stepped``).
        """
        for name in self._requested:
            self._step_now(name, bi)
        self._batch = None
        s = self.settings
        if self._unscaled:
            assert s.scaler is not None
            s.scaler.update()
        if self._own and not self._skip and None not in self._called:
            for name in s.optimizers:
                if name not in self._called and name not in self._warned:
                    self._warn_not_stepped(name)
        stepped = self._stepped
        if None in stepped:  # the run's update: the step was counted then
            return True, stepped[None]
        if not stepped:
            return False, None
        self.state.step_done()  # named optimizers stepped: the step is taken now
        if len(stepped) == 1:
            return True, next(iter(stepped.values()))
        norms = [n for n in stepped.values() if n is not None]
        if not norms:
            return True, None
        if len(norms) == 1:
            return True, norms[0]
        return True, torch.linalg.vector_norm(torch.stack(norms))

    def _warn_not_stepped(self, name: str) -> None:
        self._warned.add(name)
        warnings.warn(
            f"train_step {self.name} did not step optimizer {name!r} at step "
            f"{self.step + 1}: call ctx.optimizer_step({name!r}) (warned once per "
            "optimizer)",
            RuntimeWarning,
            stacklevel=3,
        )
        log.warning("optimizer_not_stepped", step_fn=self.name, optimizer=name,
                    step=self.state.step)  # fmt: skip

    def checked(self, loss: torch.Tensor) -> torch.Tensor:
        """The step's ``loss`` as the log window keeps it where the guard reads at the next
        sync: NaN when a loss given to ``ctx.backward`` in the step was not finite (the read
        then finds this step). On the device: no sync."""
        if self.same or not self._losses:
            return loss
        finite = torch.isfinite(torch.stack([x.detach() for x in self._losses])).all()
        return torch.where(finite, loss, loss.new_full((), math.nan))


def _params_of(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The parameters ``optimizer`` updates (what a named optimizer step clips)."""
    return [p for g in optimizer.param_groups for p in g["params"]]

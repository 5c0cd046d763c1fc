"""The training step as a user writes one, its context, and the runner that does what the
context asks (docs/trainer.md, "Custom steps")."""

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
    from .nonfinite import NonFiniteGuard
    from .settings import Settings
    from .wants import Tracer
    from .window import UserMetrics

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

    def __init__(self, runner: StepRunner) -> None:
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


class StepRunner:
    """Calls ``train_step`` and does what its context asks. ``same``: every loss returned this
    step was given to ``ctx.backward`` (its non-finite check covers them)."""

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
        self._per_step = guard.per_step  # and checked before each update
        self._mixed = settings.precision != "32"
        self._warned: set[str] = set()
        self._hook_ctx: StepContext | None = None  # the micro-batch's, once a hook needed one
        self._last: torch.Tensor | None = None  # the loss of the call's ctx.backward
        self._clean = True  # every gradient is None: the step need not zero them first
        self._weight: float | None = None
        self.begin()

    def begin(self) -> int:
        """Start a step (dropping gradients a custom step left); return the steps done before."""
        self._stepped: dict[str | None, torch.Tensor | None] = {}  # optimizer -> grad norm
        self._deferred: list[str | None] = []  # asked to step at an earlier micro-batch
        self._called: set[str | None] = set()  # asked to step (a custom step's)
        self._losses: list[torch.Tensor] = []  # given to ctx.backward, not checked yet
        self._skip = self._unscaled = self._skipped = self._skipped_any = False
        self.step = self.state.step
        self.same = True
        if not self._clean:
            self.drop_gradients()
        return self.step

    def weigh(self, weight: float) -> None:
        """Weigh this micro-batch's backwards by ``weight``, not ``1 / accumulation_steps``."""
        self._weight = weight

    def hook_context(
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

    def annotate(self, exc: BaseException, where: str, bi: int) -> None:
        """Note the part, step, epoch and batch on an exception from the step."""
        st = self.state
        exc.add_note(f"trainbus: raised in {where} at step {st.step}, epoch {st.epoch}, batch {bi}")

    # ------------------------------------------------------------------ the call
    def call(
        self,
        ctx: TrainContext,
        batch: Any,
        bi: int,
        micro: int,
        accumulation_steps: int,
        hook_ctx: StepContext | None,
    ) -> torch.Tensor | None:
        """Call ``train_step`` on one micro-batch: the loss it returned, detached and 0-d, or
        None when a hook skipped the batch."""
        ctx.batch, ctx.batch_index, ctx.micro_batch = batch, bi, micro
        ctx.accumulation_steps = accumulation_steps
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
            self.annotate(exc, "forward", ctx.batch_index)
            raise
        if loss is None:
            self._skipped = True
            return None
        hooks = self._hooks.by_point["loss"]
        if hooks:
            hc = self._hook_ctx or self.hook_context(ctx.batch_index, ctx.micro_batch, ctx.batch)
            hc.outputs, hc.loss = outputs, loss
            self.run_hooks("loss", hooks, hc)
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
                self._hook_ctx = self.hook_context(ctx.batch_index, ctx.micro_batch, ctx.batch)
            hc = self._hook_ctx
            hc.outputs = outputs
            self.run_hooks("after_forward", hooks, hc)
            outputs = hc.outputs
            if hc.skip:
                return outputs, None
        return outputs, loss_of(s, outputs, targets)

    def run_hooks(self, point: str, hooks: tuple[Any, ...], hc: StepContext) -> None:
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
        """``ctx.backward(loss)``."""
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
            self._refuse(loss, ctx.batch_index)
        if self._keep:  # read only for its value: kept as it is
            self._losses.append(loss)
        self._last, self._clean = loss, False
        weight = self._weight
        if weight is not None:
            scaled = loss * weight
        elif ctx.accumulation_steps > 1:
            scaled = loss / ctx.accumulation_steps
        else:
            scaled = loss
        scaler = self.settings.scaler
        if scaler is not None:
            scaled = scaler.scale(scaled)
        try:
            if self._trace.on:
                with self._trace("backward", "train", ctx.batch_index, ctx.micro_batch):
                    scaled.backward()
            else:
                scaled.backward()
        except BaseException as exc:
            self.annotate(exc, "backward", ctx.batch_index)
            if "backward through the graph a second time" in str(exc):
                exc.add_note(
                    "trainbus: this loss's graph was already backwarded (ctx.backward or "
                    "loss.backward() twice on one loss): call it once per loss"
                )
            raise
        hooks = self._hooks.by_point["after_backward"]
        if hooks:
            hc = self.hook_context(ctx.batch_index, ctx.micro_batch, ctx.batch)
            hc.loss = loss
            self.run_hooks("after_backward", hooks, hc)

    def _refuse(self, loss: Any, bi: int) -> None:
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
            raise TrainingError(f"the loss must be a scalar tensor; got {got} {where}. {fix}")
        raise TrainingError(
            f"the loss does not require grad {where}: it is detached from the model's parameters"
        )

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
            hc = self.hook_context(ctx.batch_index, ctx.micro_batch, ctx.batch, opt)
            self.run_hooks("before_optimizer_step", hooks, hc)
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
            self.annotate(exc, "optimizer step", ctx.batch_index)
            raise
        if name is None:  # the run's one update: the step is taken now
            self.state.step_done()
        self._stepped[name] = grad_norm
        self.zero_grad(opt, ctx.batch_index)
        hooks = self._hooks.by_point["after_optimizer_step"]
        if hooks:
            hc = self.hook_context(ctx.batch_index, ctx.micro_batch, ctx.batch, opt)
            hc.step = self.step + 1  # the step this update completes
            self.run_hooks("after_optimizer_step", hooks, hc)
        return True

    def _update(self, opt: torch.optim.Optimizer, name: str | None) -> None:
        scaler = self.settings.scaler
        if scaler is None:
            opt.step()
        else:
            for o in self._each if name is None else (opt,):
                scaler.step(o)

    def drop_gradients(self) -> None:
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
            self.annotate(exc, "zero_grad", bi)
            raise
        if optimizer is self.settings.optimizer:
            self._clean = True

    def finish(self, ctx: TrainContext) -> tuple[bool, torch.Tensor | None]:
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

    def checked(self, loss: torch.Tensor) -> torch.Tensor:
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

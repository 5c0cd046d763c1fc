"""The phases of one optimizer step, each written once with its hooks and its trace.

:class:`StepPhases` is the forward (the ``after_forward`` hook inside, then the ``loss`` hook),
the backward (then the ``after_backward`` hook) and the optimizer step (the
``before/after_optimizer_step`` hooks, clipping, ``zero_grad``). Each part runs inside the
opt-in trace (:class:`~trainbus._loop.trace.Tracer`: one ``SpanTraced`` per part, with the
error when it raises); a hook is a branch on the hook tuple of its point.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .._exceptions import TrainingError
from .._tensors import plain_value
from .forward import loss_of, model_outputs
from .hooks import Hooks, StepContext

if TYPE_CHECKING:
    from .._bus import LoopPort
    from ..checkpoint import TrainState
    from .logged import UserMetrics
    from .settings import Settings
    from .wants import Wants

__all__ = ["StepPhases"]


class StepPhases:
    """Forward, backward and optimizer step of the training step, with their events and hooks.

    Attributes:
        loss_checked: The first loss was checked (a scalar tensor that requires grad); a
            ``loss`` hook's replacement is always checked.

    Args:
        settings: The run's settings (model, optimizer, scaler, precision, clip_grad_norm).
        port: Where the phase events are published.
        state: The run's train state (stamps the events; ``step`` advances here).
        hooks: The inline hooks.
        wants: The loop's cache of wanted events.
        user: Where a training hook's ``ctx.log`` puts its values (None: ``ctx.log`` refuses).
    """

    def __init__(
        self,
        settings: Settings,
        port: LoopPort,
        state: TrainState,
        hooks: Hooks,
        wants: Wants,
        user: UserMetrics | None = None,
    ) -> None:
        self._s, self._port, self._state = settings, port, state
        self._hooks, self._wants = hooks, wants
        self._sink = None if user is None else user.log
        # What the grad scaler unscales and steps: the optimizer, or each of several.
        self._each = tuple(settings.optimizers.values()) or (settings.optimizer,)
        self._scaler = settings.scaler
        self._mixed = settings.precision != "32"
        self.loss_checked = False
        # The batch the model saw last: the step's later hooks (after_backward, before and
        # after the optimizer step) see it as ctx.batch. Dropped after the step's last hook.
        self._batch: Any = None
        # The current micro-batch's share of the step's items (accumulate_by="items"; set
        # by the step before each micro-batch); None: 1 / accumulation_steps, every micro-batch
        # the same.
        self._weight: float | None = None

    def annotate(self, exc: BaseException, where: str, batch_index: int) -> None:
        """Add a note naming the phase, step, epoch and batch to an exception from the step."""
        st = self._state
        exc.add_note(
            f"trainbus: raised in {where} at step {st.step}, epoch {st.epoch}, batch {batch_index}"
        )

    def hold_batch(self, batch: Any) -> None:
        """Make ``batch`` what the step's later hooks see as ``ctx.batch`` (a custom step's
        micro-batch; None drops it at the step's end)."""
        self._batch = batch

    def weigh(self, weight: float) -> None:
        """Scale the coming backward(s) of this micro-batch by ``weight`` (its items over the
        step's: ``accumulate_by="items"``) instead of ``1 / accumulation_steps``."""
        self._weight = weight

    def context(self, bi: int, micro: int, batch: Any) -> StepContext:
        """A fresh hook context for batch ``bi`` (micro-batch ``micro``) of the current step;
        ``batch`` None: the batch the model saw last (the step's last micro-batch)."""
        st, s = self._state, self._s
        if batch is None:
            batch = self._batch
        return StepContext(step=st.step, epoch=st.epoch, batch_index=bi, micro_batch=micro,
                           batch=batch, model=s.model, optimizer=s.optimizer,
                           metrics_sink=self._sink)  # fmt: skip

    def forward(
        self, batch: Any, bi: int, ctx: StepContext | None, micro: int
    ) -> torch.Tensor | None:
        """Forward and loss (traced as ``"forward"``) and the ``loss`` hooks.

        Returns:
            The loss, or None when a hook (``after_forward`` or ``loss``) skipped the batch.

        Raises:
            TrainingError: the loss is not a scalar tensor that requires grad.
        """
        self._batch = batch
        try:
            with self._wants.trace("forward", "train", bi, micro):
                if self._mixed:
                    with self._s.autocast():
                        outputs, loss, ctx = self._outputs_and_loss(batch, bi, ctx, micro)
                else:
                    outputs, loss, ctx = self._outputs_and_loss(batch, bi, ctx, micro)
        except BaseException as exc:
            self.annotate(exc, "forward", bi)
            raise
        if loss is None:
            return None  # an after_forward hook skipped the batch
        if not self.loss_checked:
            self.check_loss(loss, bi)
        hooks = self._hooks.by_point["loss"]
        if hooks:
            if ctx is None:
                ctx = self.context(bi, micro, batch)
            ctx.outputs, ctx.loss = outputs, loss
            for hook in hooks:
                hook(ctx)
            if ctx.skip:
                return None
            self.check_loss(ctx.loss, bi)
            loss = ctx.loss
        return loss

    def _outputs_and_loss(
        self, batch: Any, bi: int, ctx: StepContext | None, micro: int
    ) -> tuple[Any, torch.Tensor | None, StepContext | None]:
        """The forward's inside (under autocast when the run is mixed precision): the model's
        outputs, the ``after_forward`` hooks, the loss.

        Returns:
            ``(outputs, loss, ctx)``: loss None when a hook skipped the batch; ctx the hooks'
            context when one was made.
        """
        s = self._s
        outputs, targets = model_outputs(s, batch)
        after_forward = self._hooks.by_point["after_forward"]
        if after_forward:
            # May replace the outputs: the loss is computed from what the hooks leave.
            if ctx is None:
                ctx = self.context(bi, micro, batch)
            ctx.outputs = outputs
            for hook in after_forward:
                hook(ctx)
            outputs = ctx.outputs
            if ctx.skip:
                return outputs, None, ctx
        loss: torch.Tensor = loss_of(s, outputs, targets)  # checked by the caller
        return outputs, loss, ctx

    def check_loss(self, loss: Any, bi: int) -> None:
        """Check that ``loss`` is a scalar tensor that requires grad (never syncs the device).

        Raises:
            TrainingError: naming what the loss was, and where.
        """
        # Shape and dtype are metadata: checking them never syncs the device.
        st = self._state
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            got = (
                f"a tensor of shape {tuple(loss.shape)}"
                if isinstance(loss, torch.Tensor)
                else repr(type(loss))
            )
            raise TrainingError(
                f"the loss must be a scalar tensor; got {got} at step {st.step}, epoch "
                f"{st.epoch}, batch {bi}. Reduce it (e.g. .mean()) in loss_fn or the model"
            )
        if not loss.requires_grad:
            raise TrainingError(
                f"the loss does not require grad at step {st.step}, epoch {st.epoch}, batch "
                f"{bi}: it is detached from the model's parameters"
            )
        self.loss_checked = True

    def backward(self, loss: torch.Tensor, accumulation_steps: int, bi: int, micro: int) -> None:
        """Backward of one micro-batch (traced as ``"backward"``), scaled by
        ``1 / accumulation_steps`` (or by its items' share of the step's, see :meth:`weigh`),
        then the ``after_backward`` hooks."""
        scaler = self._scaler
        try:
            with self._wants.trace("backward", "train", bi, micro):
                weight = self._weight
                if weight is None:
                    scaled = loss / accumulation_steps if accumulation_steps > 1 else loss
                else:
                    scaled = loss * weight
                (scaler.scale(scaled) if scaler is not None else scaled).backward()
        except BaseException as exc:
            self.annotate(exc, "backward", bi)
            raise
        hooks = self._hooks.by_point["after_backward"]
        if hooks:
            ctx = self.context(bi, micro, None)
            ctx.loss = loss
            for hook in hooks:
                hook(ctx)

    def zero_grad(self, bi: int, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer.zero_grad(set_to_none=True)``, traced as ``"zero_grad"``."""
        try:
            with self._wants.trace("zero_grad"):
                optimizer.zero_grad(set_to_none=True)
        except BaseException as exc:
            self.annotate(exc, "zero_grad", bi)
            raise

    def optimizer_step(
        self, bi: int, optimizer: torch.optim.Optimizer | None = None
    ) -> tuple[bool, torch.Tensor | None]:
        """The optimizer step with its hooks (traced as ``"optimizer_step"``); advances
        ``state.step``.

        Args:
            bi: The batch index (for an error's note).
            optimizer: One optimizer of a custom step (:mod:`~trainbus._loop.custom`): only it
                is unscaled, clipped (its own parameters), stepped and zeroed, the grad scaler
                is not updated and ``state.step`` does not advance (the custom step does both
                once for all its optimizers). None: the run's optimizer (every one of several).

        Returns:
            ``(taken, grad_norm)``: taken is False when a ``before_optimizer_step`` hook
            skipped the step (gradients dropped, step unchanged); grad_norm is the pre-clip
            norm (None without clipping).
        """
        st, s, scaler = self._state, self._s, self._scaler
        custom = optimizer is not None
        opt = s.optimizer if optimizer is None else optimizer
        if scaler is not None:
            for o in (opt,) if custom else self._each:
                scaler.unscale_(o)
        hooks = self._hooks.by_point["before_optimizer_step"]
        if hooks:
            ctx = self.context(bi, 0, None)
            ctx.optimizer = opt
            for hook in hooks:
                hook(ctx)
            if ctx.skip:
                self.zero_grad(bi, opt)
                if scaler is not None and not custom:
                    scaler.update()
                if not custom:
                    self._batch = None
                return False, None
        grad_norm: torch.Tensor | None = None
        if s.clip_grad_norm is not None:
            params = s.model.parameters() if not custom else _params_of(opt)
            # Sharded (FSDP2) parameters give a replicated DTensor: its plain value, the
            # same on every rank (no communication), so events and the log window hold tensors.
            grad_norm = plain_value(torch.nn.utils.clip_grad_norm_(params, s.clip_grad_norm))
        try:
            with self._wants.trace("optimizer_step"):
                if scaler is not None:
                    for o in (opt,) if custom else self._each:
                        scaler.step(o)
                    if not custom:
                        scaler.update()
                else:
                    opt.step()
        except BaseException as exc:
            self.annotate(exc, "optimizer step", bi)
            raise
        if not custom:
            st.step_done()
        self.zero_grad(bi, opt)
        for hook in self._hooks.by_point["after_optimizer_step"]:
            ctx = self.context(bi, 0, None)
            ctx.optimizer = opt
            if custom:  # the step this update completes (state.step advances after them all)
                ctx.step = st.step + 1
            hook(ctx)
        if not custom:  # a custom step's later optimizers still see it (CustomStep.finish)
            self._batch = None
        return True, grad_norm


def _params_of(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The parameters ``optimizer`` updates (what a custom step's clipping clips)."""
    return [p for g in optimizer.param_groups for p in g["params"]]

"""The user's own step: ``Trainer(..., train_step=fn)``, in the spirit of ignite's
``process_function`` and Lightning's manual optimization.

:class:`~trainbus._loop.step.Step` stays the one step: it fetches the batch, runs the
``batch`` hooks, and where the default step runs the
forward, loss and backward of a micro-batch it calls :meth:`CustomStep.micro_batch`, which
calls ``fn(ctx)`` with a :class:`TrainContext`; where the default step takes the optimizer step
it calls :meth:`CustomStep.finish`. The non-finite check of the step's losses, the scheduler,
``StepEnded`` and the log window are the step's, as for everyone.

Inside ``fn`` the user runs any forwards, and calls:

- ``ctx.backward(loss)``: the loss checked (a scalar that requires grad), divided by the
  step's micro-batches, scaled by the fp16 grad scaler, traced as ``"backward"``, then the
  ``after_backward`` hooks; the loss joins the non-finite check.
- ``ctx.optimizer_step(name)``: at the step's last micro-batch, the named optimizer's step
  with unscaling, clipping of its own parameters (``clip_grad_norm``), the
  ``before/after_optimizer_step`` hooks (``ctx.optimizer`` is that optimizer),
  traced as ``"optimizer_step"``, and its ``zero_grad``; on an earlier micro-batch the gradients
  accumulate and it returns False (a step cut short by the data steps it at the end).
- ``ctx.autocast()``: the run's precision context for a forward.
- ``ctx.log(name, value)``: a metric of the step (as in hooks).

``fn`` returns the step's loss: a tensor, or a mapping with a ``"loss"`` entry whose other
scalar entries are logged as metrics (``{"loss": g_loss, "d_loss": d_loss}``). The run's step
count advances once per step in which some optimizer stepped; every optimizer's gradients
are dropped when a step begins (a generator's backward leaves gradients in the
discriminator).
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

if TYPE_CHECKING:
    from ..checkpoint import TrainState
    from .logged import UserMetrics
    from .nonfinite import NonFiniteGuard
    from .phases import StepPhases
    from .settings import Settings

__all__ = ["CustomStep", "TrainContext"]

log = get_logger(__name__)


class TrainContext:
    """What a custom step gets for one micro-batch (see :mod:`trainbus._loop.custom`).

    Attributes:
        step: Optimizer steps completed so far (the step being taken is ``step + 1``).
        epoch: The epoch in progress.
        batch_index: The batch's index in the epoch.
        micro_batch: Its position among the step's micro-batches (0 without accumulation).
        accumulation_steps: The step's micro-batches (``accumulate``, shorter at an epoch's end).
        batch: The batch, on the run's device (after the ``batch`` hooks).
        model: The model being trained (DDP-wrapped under torchrun).
        optimizers: Every optimizer by name (``{"default": optimizer}`` for one).
        device: The run's device.
    """

    __slots__ = ("_runner", "accumulation_steps", "batch", "batch_index", "device", "epoch",
                 "micro_batch", "model", "optimizers", "step")  # fmt: skip

    def __init__(
        self, runner: CustomStep, batch: Any, batch_index: int, micro: int, accumulation_steps: int
    ) -> None:
        s, st = runner.settings, runner.state
        self._runner = runner
        self.step, self.epoch = st.step, st.epoch
        self.batch_index, self.micro_batch, self.accumulation_steps = (
            batch_index,
            micro,
            accumulation_steps,
        )
        self.batch = batch
        self.model: torch.nn.Module = s.model
        self.optimizers: Mapping[str, torch.optim.Optimizer] = s.optimizers
        self.device: torch.device = s.device

    @property
    def last_micro_batch(self) -> bool:
        """This is the step's last micro-batch: :meth:`optimizer_step` steps now."""
        return self.micro_batch == self.accumulation_steps - 1

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of ``loss`` as trainbus does it (see the module docstring).

        Raises:
            TrainingError: ``loss`` is not a scalar tensor that requires grad.
        """
        self._runner.backward(loss, self.batch_index, self.micro_batch, self.accumulation_steps)

    def optimizer_step(self, name: str = "default") -> bool:
        """Step the optimizer ``name`` (at the step's last micro-batch; see the module
        docstring).

        Returns:
            True when it stepped now; False on an earlier micro-batch (the gradients
            accumulate), when a ``before_optimizer_step`` hook skipped it, or when the
            non-finite check skipped the step's update.

        Raises:
            ConfigError: ``name`` is not one of the run's optimizers.
        """
        return self._runner.optimizer_step(name, self.batch_index, self.last_micro_batch)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The run's mixed-precision context for a forward (a no-op at ``precision="32"``)."""
        return self._runner.settings.autocast()

    def log(self, name: str, value: torch.Tensor | float) -> None:
        """Log a metric of this step (its mean over the log window reaches ``MetricsLogged``).

        Raises:
            ConfigError: a reserved name or a value that is not a number / one-element tensor.
        """
        self._runner.user.log(name, value)


class CustomStep:
    """Runs the user's ``train_step`` for :class:`~trainbus._loop.step.Step`.

    Attributes:
        settings: The run's settings (``train_step``, ``optimizers``, precision).
        state: The run's train state.
        user: Where logged metrics go.

    Args:
        settings: The run's settings.
        state: The run's train state.
        phases: The step's phases (backward and optimizer step, with their events and hooks).
        guard: The non-finite guard (checks the backward losses before an update).
        user: Where ``ctx.log`` and a returned mapping's extra entries go.
    """

    def __init__(
        self,
        settings: Settings,
        state: TrainState,
        phases: StepPhases,
        guard: NonFiniteGuard,
        user: UserMetrics,
    ) -> None:
        self.settings, self.state, self.user = settings, state, user
        self._phases, self._guard = phases, guard
        fn = settings.train_step
        assert fn is not None
        self._fn: Callable[[TrainContext], Any] = fn
        self.name = getattr(fn, "__qualname__", None) or repr(fn)
        self._stepped: dict[str, torch.Tensor | None] = {}
        self._requested: list[str] = []
        self._called: set[str] = set()
        self._losses: list[torch.Tensor] = []
        self._checked = 0
        self._skip = False
        self._warned: set[str] = set()

    def begin(self) -> None:
        """A step begins: every optimizer's gradients are dropped."""
        self._stepped, self._requested, self._losses = {}, [], []
        self._called = set()
        self._checked, self._skip = 0, False
        self.settings.optimizer.zero_grad(set_to_none=True)

    def micro_batch(self, batch: Any, bi: int, micro: int, accumulation_steps: int) -> torch.Tensor:
        """Call ``train_step`` on one micro-batch.

        Returns:
            The loss it returned, detached.

        Raises:
            TrainingError: it returned no loss (None, or a mapping without ``"loss"``) or a
                loss that is not a one-element tensor or a number.
            BaseException: whatever ``train_step`` raised, with a note naming it and where.
        """
        self._phases.hold_batch(batch)
        try:
            out = self._fn(TrainContext(self, batch, bi, micro, accumulation_steps))
        except BaseException as exc:
            st = self.state
            exc.add_note(f"trainbus: raised in train_step {self.name} at step {st.step + 1}, "
                         f"epoch {st.epoch}, batch {bi}")  # fmt: skip
            raise
        if isinstance(out, Mapping) and "loss" not in out:
            raise TrainingError(
                f"train_step {self.name} returned a mapping without a 'loss' entry (keys: "
                f"{', '.join(map(repr, out))}) at step {self.state.step + 1}, batch {bi}: "
                "return the step's loss (a scalar tensor) or a mapping with a 'loss' entry"
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
                f"train_step {self.name} returned {got} at step {self.state.step + 1}, batch "
                f"{bi}: return the step's loss (a scalar tensor) or a mapping with a 'loss' "
                "entry"
            )
        return loss.detach().reshape(())

    def backward(self, loss: torch.Tensor, bi: int, micro: int, accumulation_steps: int) -> None:
        """``ctx.backward``: check, keep for the non-finite check, backward with its hooks."""
        phases = self._phases
        phases.check_loss(loss, bi)
        self._losses.append(loss.detach())
        phases.backward(loss, accumulation_steps, bi, micro)

    def optimizer_step(self, name: str, bi: int, last: bool) -> bool:
        """``ctx.optimizer_step``: step ``name`` now at the last micro-batch, else defer.

        Raises:
            ConfigError: ``name`` is not one of the run's optimizers.
            NonFiniteLossError: a non-finite backward loss under ``on_nonfinite="raise"``.
        """
        opts = self.settings.optimizers
        if name not in opts:
            raise ConfigError.invalid(
                f"ctx.optimizer_step in train_step {self.name}", name,
                "one of the optimizers: " + ", ".join(map(repr, opts)),
            )  # fmt: skip
        self._called.add(name)
        if not last:
            if name not in self._requested:
                self._requested.append(name)
            return False
        return self._step_now(name, bi)

    def _step_now(self, name: str, bi: int) -> bool:
        if self._skip or name in self._stepped:
            return False
        guard = self._guard
        if guard.per_step and len(self._losses) > self._checked:
            pending = self._losses[self._checked :]
            self._checked = len(self._losses)
            try:
                bad = guard.skip_update(pending)
            except BaseException as exc:
                exc.add_note(f"trainbus: a loss given to ctx.backward in train_step {self.name} "
                             f"before stepping optimizer {name!r}")  # fmt: skip
                raise
            if bad:  # "skip" or "stop": no further update in this step
                self._skip = True
                self.settings.optimizer.zero_grad(set_to_none=True)
                return False
        took, grad_norm = self._phases.optimizer_step(bi, self.settings.optimizers[name])
        if took:
            self._stepped[name] = grad_norm
        return took

    def checked(self, loss: torch.Tensor) -> torch.Tensor:
        """The step's ``loss`` as the log window keeps it where the guard reads at the next
        sync (``"raise"`` / ``"stop"`` on an accelerator, or under several ranks): NaN when a
        loss given to ``ctx.backward`` in the step was not finite, so that read finds this
        step (it reads only what the log window keeps). On the device: no sync."""
        if not self._losses:
            return loss
        finite = torch.isfinite(torch.stack(self._losses)).all()
        return torch.where(finite, loss, loss.new_full((), math.nan))

    def finish(self, bi: int) -> tuple[bool, torch.Tensor | None]:
        """After the micro-batches: the steps deferred by a step cut short, the grad scaler's
        update, a warning for each declared optimizer never stepped.

        Returns:
            ``(some optimizer stepped, grad norm)``: the norm of the stepped optimizers'
            pre-clip norms (None without clipping).

        Warns:
            RuntimeWarning: once per optimizer that ``train_step`` never asked to step in a
                step (also logged as ``optimizer_not_stepped``).
        """
        for name in self._requested:
            self._step_now(name, bi)
        self._phases.hold_batch(None)
        s = self.settings
        if s.scaler is not None and self._stepped:
            s.scaler.update()
        if not self._skip:
            for name in s.optimizers:
                if name not in self._called and name not in self._warned:
                    self._warned.add(name)
                    warnings.warn(
                        f"train_step {self.name} did not step optimizer {name!r} at step "
                        f"{self.state.step + 1}: call "
                        f"ctx.optimizer_step({name!r}) (warned once per optimizer)",
                        RuntimeWarning,
                        stacklevel=2,
                    )
                    log.warning("optimizer_not_stepped", step_fn=self.name, optimizer=name,
                                step=self.state.step)  # fmt: skip
        if not self._stepped:
            return False, None
        norms = [n for n in self._stepped.values() if n is not None]
        if not norms:
            return True, None
        if len(norms) == 1:
            return True, norms[0]
        return True, torch.linalg.vector_norm(torch.stack(norms))

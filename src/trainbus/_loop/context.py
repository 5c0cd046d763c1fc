"""The training step as a user writes one, and its context (docs/trainer.md, "Custom
steps"); :class:`~trainbus._loop.step.Step` does what the context asks."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .step import Step

__all__ = ["TrainContext", "default_train_step"]


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

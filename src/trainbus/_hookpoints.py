"""The inline hook points and the :class:`StepContext` a hook sees. What each point may change:
docs/trainer.md, "Callbacks"."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias, get_args

import torch

from ._exceptions import TrainingError

__all__ = ["HOOK_POINTS", "HookPoint", "StepContext"]

HookPoint: TypeAlias = Literal[
    "batch",
    "after_forward",
    "loss",
    "after_backward",
    "before_optimizer_step",
    "after_optimizer_step",
    "before_evaluation",
    "eval_batch",
    "after_evaluation",
]
"""One of the hook points."""

HOOK_POINTS: tuple[HookPoint, ...] = get_args(HookPoint)
"""Every hook point, in the order a step reaches them."""


@dataclass(slots=True, kw_only=True)
class StepContext:
    """The mutable state of the step a hook runs in.

    Attributes:
        step: Optimizer steps completed so far.
        epoch: Current epoch.
        batch_index: Index of the current batch in the epoch.
        micro_batch: Position among the step's micro-batches (gradient accumulation).
        batch: The (micro-)batch, on the device; a ``"batch"`` hook may replace it.
        outputs: Model outputs (from ``"after_forward"`` on, which may replace them).
        loss: The loss tensor (from ``"loss"`` on, which may replace it).
        model: The model being trained.
        optimizer: Its optimizer.
        skip: Set it (or call :meth:`skip_batch`) to skip the rest of this batch; at
            ``"before_optimizer_step"`` it skips the optimizer step and drops the gradients.
        phase: ``"train"``, ``"eval"`` or ``"predict"``.
        dataset: The evaluation set's name at ``"eval_batch"`` in evaluation, else None.
        trigger: Why the evaluation round runs (``EvalTrigger``), in evaluation; else None.
        error: At ``"after_evaluation"``: the exception the round is ending with, else None.
        metrics_sink: Where :meth:`log` puts a value (None in evaluation and prediction).
    """

    step: int
    epoch: int
    batch_index: int
    micro_batch: int
    batch: Any
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    outputs: Any = None
    loss: torch.Tensor | None = None
    skip: bool = False
    phase: str = "train"
    dataset: str | None = None
    trigger: str | None = None
    error: BaseException | None = None
    metrics_sink: Callable[[str, Any], None] | None = field(default=None, repr=False)

    def log(self, name: str, value: torch.Tensor | float) -> None:
        """Log a named value of this training step: its mean over the log window reaches
        ``MetricsLogged`` (docs/trainer.md, "Metrics of your own").

        Args:
            name: The metric's name (not one of the window's own: ``loss``, ``lr``, ...).
            value: A number or a one-element tensor (detached here).

        Raises:
            ConfigError: a reserved name or a value that is not a number / one-element tensor.
            TrainingError: called from an evaluation or prediction hook (their metrics come
                from the Trainer's ``metrics=``).
        """
        if self.metrics_sink is None:
            raise TrainingError(
                f"ctx.log({name!r}, ...) in a hook of phase {self.phase!r}: only training hooks "
                "and custom steps log metrics (evaluation metrics come from metrics=)"
            )
        self.metrics_sink(name, value)

    def skip_batch(self) -> None:
        """Skip the rest of this batch (or, before the optimizer step, the step)."""
        self.skip = True

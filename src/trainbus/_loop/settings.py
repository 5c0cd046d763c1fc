"""Validated, frozen trainer settings, built by ``trainbus._trainer.options``."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from .. import events as ev

__all__ = ["NonFinitePolicy", "Precision", "Settings"]

Precision = Literal["32", "bf16", "fp16"]
NonFinitePolicy = Literal["raise", "stop", "skip", "ignore"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    """Everything the loop needs, validated (each option's default is declared once, in
    ``Trainer.__init__``'s signature)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    train_data: Iterable[Any]
    train_len: int | None
    loss_fn: Callable[[Any, Any], torch.Tensor] | None
    eval_data: Iterable[Any] | Mapping[str, Iterable[Any]] | None
    max_epochs: int | None
    max_steps: int | None
    scheduler: Any | None
    scheduler_interval: Literal["step", "epoch"]
    """``"epoch"`` for ``scheduler=PerEpoch(...)``, else ``"step"``."""
    accumulate: int
    accumulate_by: Any
    """``Accumulate(by=)``: ``"batches"``, ``"items"`` or ``fn(batch) -> items``."""
    clip_grad_norm: float | None
    precision: Precision
    device: torch.device
    seed: int | None
    metrics: Mapping[str, Callable[[Any, Any], Any]]
    set_metrics: Mapping[str, Any]
    """Metrics of the whole evaluation set (:class:`~trainbus._loop.set_metrics.SetMetric`)."""
    eval_every: int | None
    """``EvalSchedule.every_steps``."""
    eval_at_epoch_end: bool
    """``EvalSchedule.epoch_end``."""
    eval_at_end: bool
    """``EvalSchedule.at_end``."""
    log_every: int
    checkpoint_dir: Path | None
    skip_final_checkpoint: frozenset[ev.Ending]
    """``CheckpointDir.skip_final``: the endings that write no final checkpoint."""
    barriers: frozenset[type[ev.BaseEvent]]
    """The bus' ``barriers``: the event types the loop waits at."""
    on_nonfinite: NonFinitePolicy
    scaler: Any | None = field(compare=False)
    eval_sets: tuple[tuple[str, Iterable[Any]], ...]
    """``(name, data)`` of each evaluation set, in order: a single loader is ``("val", it)``."""
    eval_named: bool
    """``eval_data`` was a mapping of named sets: metrics are keyed ``<set>/<name>``."""
    optimizers: Mapping[str, torch.optim.Optimizer] = field(compare=False)
    """Every optimizer by name: ``{"default": optimizer}`` for one, the mapping given for
    several (then ``optimizer`` is their :class:`~trainbus._loop.optimizers.OptimizerSet`)."""
    schedulers: Mapping[str, Any] = field(compare=False)
    """Every scheduler by the name of its optimizer (``scheduler`` steps them all)."""
    train_step: Callable[..., Any] | None = field(compare=False)
    """The user's step (``train_step=``); None: the default step."""
    trace: frozenset[str]
    """The parts of a step ``Trainer(trace=...)`` times (``SpanTraced``); empty: none."""

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The mixed-precision context of a forward pass (a no-op at full precision)."""
        if self.precision == "32":
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.precision == "bf16" else torch.float16
        return torch.autocast(device_type=self.device.type, dtype=dtype)

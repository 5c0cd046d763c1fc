"""Validated, frozen trainer settings: every argument checked before anything runs.

The Trainer's options are declared once (``Trainer.__init__``'s signature); their checks
(``trainbus._trainer.options``) build :class:`Settings`, with the loop's checks of data and
precision from here. A bad value raises ``ConfigError`` naming the field, the value and what is
allowed, before anything runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from .. import events as ev
from .._exceptions import ConfigError

__all__ = [
    "NonFinitePolicy",
    "Precision",
    "Settings",
    "check_loader",
    "check_precision",
    "check_reiterable",
    "eval_sets",
]

Precision = Literal["32", "bf16", "fp16"]
NonFinitePolicy = Literal["raise", "stop", "skip", "ignore"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    """Everything the loop needs, validated (built by ``trainbus._trainer.options``; each
    option's default is declared once, in ``Trainer.__init__``'s signature)."""

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
    """How a step's micro-batches weigh: ``"batches"`` (``1 / accumulate`` each), ``"items"`` or
    ``fn(batch) -> items`` (``n_i / N``; :mod:`~trainbus._loop.accumulation`)."""
    clip_grad_norm: float | None
    precision: Precision
    device: torch.device
    seed: int | None
    metrics: Mapping[str, Callable[[Any, Any], Any]]
    set_metrics: Mapping[str, Any]
    """Metrics of the whole evaluation set by name
    (:class:`~trainbus._loop.set_metrics.SetMetric`)."""
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
    """The user's step (``train_step=``): called per micro-batch with a
    :class:`~trainbus._loop.context.TrainContext`; None: the default step."""
    trace: frozenset[str]
    """The parts of a step ``Trainer(trace=...)`` times (``SpanTraced``); empty: none."""

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The mixed-precision context of a forward pass (a no-op at full precision)."""
        if self.precision == "32":
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.precision == "bf16" else torch.float16
        return torch.autocast(device_type=self.device.type, dtype=dtype)


def check_loader(name: str, value: Any, *, optional: bool) -> int | None:
    """Check an iterable data source; return its length when it has one.

    Raises:
        ConfigError: a tensor, a string, a non-iterable or an empty loader.
    """
    if value is None and optional:
        return None
    # A map-style Dataset yields samples, not batches: say how to batch it.
    if isinstance(value, torch.utils.data.Dataset) and not isinstance(value, Iterable):
        raise ConfigError.invalid(
            name, type(value).__name__,
            "an iterable of batches: a Dataset gives single samples; wrap it, "
            "DataLoader(dataset, batch_size=N, shuffle=..., collate_fn=...)",
        )  # fmt: skip
    if isinstance(value, torch.Tensor | str | bytes) or not isinstance(value, Iterable):
        raise ConfigError.invalid(
            name, type(value).__name__, "an iterable of batches, such as a DataLoader or a list"
        )
    try:
        length = len(value)  # type: ignore[arg-type]
    except TypeError:
        return None
    if length == 0:
        raise ConfigError.invalid(
            name, f"<{type(value).__name__} of length 0>", "a non-empty loader"
        )
    return length


def check_reiterable(name: str, value: Any, why: str, *, alternative: str = "") -> None:
    """Refuse a one-shot iterator (a generator, ``map(...)``, ``iter(list)``) where the data is
    iterated more than once. The test is the iterator protocol, not a call of ``iter()``
    (which would start a ``DataLoader``'s workers and draw from torch's global generator).

    Args:
        name: The option, as the message names it.
        value: The data given.
        why: When it would be iterated a second time (the message says so).
        alternative: Another way out, appended to the message (``"; or ..."``).

    Raises:
        ConfigError: ``value`` is an iterator.
    """
    if isinstance(value, Iterator):
        raise ConfigError.invalid(
            name, f"<one-shot {type(value).__name__}>",
            f"data that can be iterated again ({why}, and a {type(value).__name__} is spent "
            "after its first pass): a list of batches, a DataLoader, or an IterableDataset "
            f"whose __iter__ starts a new pass (wrapped in a DataLoader){alternative}",
        )  # fmt: skip


PRECISION_SPELLINGS: Mapping[str, Precision] = {
    "32": "32", "bf16": "bf16", "fp16": "fp16",
    # Lightning's spellings of the same three (a user's Trainer(precision=...) carried over).
    "32-true": "32", "bf16-mixed": "bf16", "16-mixed": "fp16",
}  # fmt: skip
"""Every accepted ``precision`` and what it means here."""

_TRUE_DTYPES = {"16-true": "torch.float16", "bf16-true": "torch.bfloat16",
                "64-true": "torch.float64"}  # fmt: skip
"""Lightning's ``"*-true"`` spellings and the dtype they cast the model to."""


def check_precision(value: Any) -> Precision:
    """``value`` as one of ``"32"``, ``"bf16"``, ``"fp16"``.

    Raises:
        ConfigError: an unknown spelling (listing the accepted ones), or Lightning's
            ``"*-true"`` half/double precision, which trainbus does not do by casting.
    """
    allowed = ", ".join(repr(k) for k in PRECISION_SPELLINGS)
    if isinstance(value, str) and value in PRECISION_SPELLINGS:
        return PRECISION_SPELLINGS[value]
    if isinstance(value, str) and value in _TRUE_DTYPES:
        raise ConfigError.invalid(
            "precision", value,
            f"one of {allowed}; trainbus does not cast the model: for weights in another "
            f"dtype cast it yourself (model.to({_TRUE_DTYPES[value]})) and train with "
            "precision='32'",
        )  # fmt: skip
    if isinstance(value, int) and not isinstance(value, bool):
        raise ConfigError.invalid("precision", value,
                                  f"one of {allowed} (strings: precision='{value}' if that is "
                                  "one of them)")  # fmt: skip
    raise ConfigError.invalid("precision", value, f"one of {allowed}")


def eval_sets(eval_data: Any) -> tuple[tuple[tuple[str, Iterable[Any]], ...], bool]:
    """Check ``eval_data`` (None, one iterable, or a mapping of set names to iterables).

    Returns:
        ``((name, data), ...)`` and whether the sets are named (a mapping was given).

    Raises:
        ConfigError: an empty mapping, a set name that is not a non-empty string without ``/``,
            or a set (or ``eval_data``) that is not a non-empty iterable of batches.
    """
    if eval_data is None:
        return (), False
    if isinstance(eval_data, Mapping):
        if not eval_data:
            raise ConfigError.invalid(
                "eval_data", "<empty mapping>", "a loader, or a mapping of set names to loaders"
            )
        sets: list[tuple[str, Iterable[Any]]] = []
        for name, data in eval_data.items():
            if not isinstance(name, str) or not name or "/" in name:
                raise ConfigError.invalid(
                    "eval_data", name, "set names that are non-empty strings without '/' "
                    "(metrics are keyed '<set>/<metric>')",
                )  # fmt: skip
            check_loader(f"eval_data[{name!r}]", data, optional=False)
            sets.append((name, data))
        return tuple(sets), True
    check_loader("eval_data", eval_data, optional=False)
    return (("val", eval_data),), False

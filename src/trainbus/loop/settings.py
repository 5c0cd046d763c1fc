"""Validated, frozen trainer settings: every argument checked before anything runs.

``Trainer.__init__`` hands its arguments to :func:`build_settings`; a bad value raises
``ConfigError`` naming the field, the value and what is allowed, and nothing touches the disk.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from .. import events as ev
from .._exceptions import ConfigError
from .._tensors import bf16_supported, resolve_device
from .._validate import check_int
from ..checkpoint import check_checkpoint_dir
from .optimizers import check_optimizers, check_schedulers

__all__ = [
    "BARRIER_TYPES",
    "DEFAULT_BARRIERS",
    "NonFinitePolicy",
    "Precision",
    "Settings",
    "build_settings",
    "eval_sets",
]

Precision = Literal["32", "bf16", "fp16"]
NonFinitePolicy = Literal["raise", "stop", "skip", "ignore"]
DEFAULT_BARRIERS: tuple[type[ev.BaseEvent], ...] = (ev.EvaluationEnded, ev.EpochEnded)
BARRIER_TYPES: tuple[type[ev.BaseEvent], ...] = (
    ev.StepEnded, ev.MetricsLogged, ev.EvaluationEnded, ev.EpochEnded,
)  # fmt: skip
"""Events followed by a poll point: the only ones a barrier can make decisions exact on."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    """Everything the loop needs, validated. Built by :func:`build_settings`."""

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
    accumulate: int
    clip_grad_norm: float | None
    precision: Precision
    device: torch.device
    seed: int | None
    metrics: Mapping[str, Callable[[Any, Any], Any]]
    eval_every: int | None
    eval_at_epoch_end: bool
    log_every: int
    eval_at_end: bool = True
    """Evaluate the final weights once more when a completed run's last step was not evaluated
    (only when ``eval_every`` or ``eval_at_epoch_end`` evaluates during the run)."""
    checkpoint_dir: Path | None
    barriers: frozenset[type[ev.BaseEvent]]
    barrier_timeout: float
    on_nonfinite: NonFinitePolicy
    scaler: Any | None = field(default=None, compare=False)
    eval_sets: tuple[tuple[str, Iterable[Any]], ...] = ()
    """``(name, data)`` of each evaluation set, in order: a single loader is ``("val", it)``."""
    eval_named: bool = False
    """``eval_data`` was a mapping of named sets: metrics are keyed ``<set>/<name>``."""
    optimizers: Mapping[str, torch.optim.Optimizer] = field(default_factory=dict, compare=False)
    """Every optimizer by name: ``{"default": optimizer}`` for one, the mapping given for
    several (then ``optimizer`` is their :class:`~trainbus.loop.optimizers.OptimizerSet`)."""
    schedulers: Mapping[str, Any] = field(default_factory=dict, compare=False)
    """Every scheduler by the name of its optimizer (``scheduler`` steps them all)."""
    train_step: Callable[..., Any] | None = field(default=None, compare=False)
    """The user's step (``train_step=``): called per micro-batch with a
    :class:`~trainbus.loop.custom.TrainContext`; None: the default step."""
    skip_final_checkpoint: frozenset[ev.Ending] = frozenset()
    """Stopped runs (``Ending.STOPPED``/``PRUNED``/``SIGNAL``) that write no final checkpoint."""

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The mixed-precision context of a forward pass (a no-op at full precision)."""
        if self.precision == "32":
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.precision == "bf16" else torch.float16
        return torch.autocast(device_type=self.device.type, dtype=dtype)


def _iterable(name: str, value: Any, *, optional: bool) -> int | None:
    """Check an iterable data source; return its length when it has one."""
    if value is None and optional:
        return None
    # A string is iterable (of characters) but never a loader: refuse it here, not at step 0.
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


PRECISION_SPELLINGS: Mapping[str, Precision] = {
    "32": "32", "bf16": "bf16", "fp16": "fp16",
    # Lightning's spellings of the same three (a user's Trainer(precision=...) carried over).
    "32-true": "32", "bf16-mixed": "bf16", "16-mixed": "fp16",
}  # fmt: skip
"""Every accepted ``precision`` and what it means here."""

_TRUE_DTYPES = {"16-true": "torch.float16", "bf16-true": "torch.bfloat16",
                "64-true": "torch.float64"}
"""Lightning's ``"*-true"`` spellings and the dtype they cast the model to."""


def _precision(value: Any) -> Precision:
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
            _iterable(f"eval_data[{name!r}]", data, optional=False)
            sets.append((name, data))
        return tuple(sets), True
    _iterable("eval_data", eval_data, optional=False)
    return (("val", eval_data),), False


def build_settings(
    model: Any,
    optimizer: Any,
    train_data: Any,
    *,
    loss_fn: Any,
    eval_data: Any,
    max_epochs: Any,
    max_steps: Any,
    scheduler: Any,
    scheduler_interval: Any,
    accumulate: Any,
    clip_grad_norm: Any,
    precision: Any,
    device: Any,
    seed: Any,
    metrics: Any,
    eval_every: Any,
    eval_at_epoch_end: Any,
    log_every: Any,
    checkpoint_dir: Any,
    barriers: Any,
    barrier_timeout: Any,
    on_nonfinite: Any,
    train_step: Any = None,
    eval_at_end: Any = True,
) -> Settings:
    """Validate every trainer argument and build :class:`Settings`.

    Raises:
        ConfigError: naming the first bad field, its value and what is allowed.
    """
    if not isinstance(model, torch.nn.Module):
        raise ConfigError.invalid("model", type(model).__name__, "a torch.nn.Module")
    optimizer, optimizers = check_optimizers(model, optimizer)
    if train_step is not None and not callable(train_step):
        raise ConfigError.invalid(
            "train_step", type(train_step).__name__, "a callable step(ctx) or None"
        )
    train_len = _iterable("train_data", train_data, optional=False)
    sets, named = eval_sets(eval_data)
    if loss_fn is not None and not callable(loss_fn):
        raise ConfigError.invalid(
            "loss_fn", loss_fn, "a callable loss_fn(outputs, targets) or None"
        )
    max_epochs = check_int("max_epochs", max_epochs, 1, optional=True)
    max_steps = check_int("max_steps", max_steps, 1, optional=True)
    if max_epochs is None and max_steps is None:
        raise ConfigError.invalid("max_epochs", None, "set max_epochs or max_steps (or both)")
    scheduler, schedulers = check_schedulers(scheduler, optimizers)
    if scheduler_interval not in ("step", "epoch"):
        raise ConfigError.invalid("scheduler_interval", scheduler_interval, "'step' or 'epoch'")
    accumulate = check_int("accumulate", accumulate, 1)
    if clip_grad_norm is not None and not (
        isinstance(clip_grad_norm, int | float)
        and not isinstance(clip_grad_norm, bool)
        and math.isfinite(clip_grad_norm)
        and clip_grad_norm > 0
    ):
        raise ConfigError.invalid("clip_grad_norm", clip_grad_norm, "a finite number > 0 or None")
    precision = _precision(precision)
    resolved = resolve_device(device)  # "auto"/"cuda" -> "cuda:N", once for every thread
    if precision == "bf16" and not bf16_supported(resolved):
        props = torch.cuda.get_device_properties(resolved)
        raise ConfigError.invalid(
            "precision", precision, f"'32' or 'fp16' on {resolved} ({props.name}, compute "
            f"capability {props.major}.{props.minor}): bf16 needs compute capability 8.0 or "
            "later (torch would only emulate it, slower than fp32)",
        )  # fmt: skip
    if precision == "fp16" and resolved.type != "cuda":
        raise ConfigError.invalid(
            "precision",
            precision,
            f"'32' or 'bf16' on {resolved.type}; fp16 with a grad scaler needs CUDA",
        )
    seed = check_int("seed", seed, 0, optional=True)
    if metrics is not None and not isinstance(metrics, Mapping):
        raise ConfigError.invalid("metrics", metrics, "a mapping of names to fn(outputs, targets)")
    metrics = dict(metrics or {})
    for name, fn in metrics.items():
        if not isinstance(name, str) or not name.isidentifier() or not callable(fn):
            raise ConfigError.invalid(
                f"metrics[{name!r}]", fn, "an identifier mapped to fn(outputs, targets)"
            )
    eval_every = check_int("eval_every", eval_every, 1, optional=True)
    if eval_every is not None and eval_data is None:
        raise ConfigError.invalid("eval_every", eval_every, "None unless eval_data is given")
    if not isinstance(eval_at_epoch_end, bool):
        raise ConfigError.invalid("eval_at_epoch_end", eval_at_epoch_end, "True or False")
    if not isinstance(eval_at_end, bool):
        raise ConfigError.invalid("eval_at_end", eval_at_end, "True or False")
    log_every = check_int("log_every", log_every, 1)
    # Creatable and writable, not under a file: found now, not at the first save.
    ckpt = None if checkpoint_dir is None else check_checkpoint_dir(checkpoint_dir)
    if not isinstance(barriers, Iterable) or isinstance(barriers, str):
        raise ConfigError.invalid("barriers", barriers, "an iterable of event classes")
    barriers = tuple(barriers)
    for b in barriers:
        if b not in BARRIER_TYPES:
            raise ConfigError.invalid(
                "barriers", b, "event classes followed by a poll point: "
                + ", ".join(t.__name__ for t in BARRIER_TYPES),
            )  # fmt: skip
    if not (
        isinstance(barrier_timeout, int | float)
        and not isinstance(barrier_timeout, bool)
        and barrier_timeout > 0  # NaN compares False; inf waits without a deadline
    ):
        raise ConfigError.invalid("barrier_timeout", barrier_timeout, "seconds > 0")
    if on_nonfinite not in ("raise", "stop", "skip", "ignore"):
        raise ConfigError.invalid(
            "on_nonfinite", on_nonfinite, "'raise', 'stop', 'skip' or 'ignore'"
        )
    scaler = torch.amp.GradScaler("cuda") if precision == "fp16" else None
    return Settings(
        model=model, optimizer=optimizer, train_data=train_data, train_len=train_len,
        loss_fn=loss_fn, eval_data=eval_data, max_epochs=max_epochs, max_steps=max_steps,
        scheduler=scheduler, scheduler_interval=scheduler_interval, accumulate=accumulate,
        clip_grad_norm=float(clip_grad_norm) if clip_grad_norm is not None else None,
        precision=precision, device=resolved, seed=seed, metrics=metrics, eval_every=eval_every,
        eval_at_epoch_end=eval_at_epoch_end, log_every=log_every, checkpoint_dir=ckpt,
        barriers=frozenset(barriers), barrier_timeout=float(barrier_timeout),
        on_nonfinite=on_nonfinite, scaler=scaler, eval_sets=sets, eval_named=named,
        optimizers=optimizers, schedulers=schedulers, train_step=train_step,
        eval_at_end=eval_at_end,
    )  # fmt: skip

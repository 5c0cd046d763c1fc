"""The checks of single Trainer options, named by :data:`~trainbus._trainer.options.CHECKS`.

Each takes the option's (or a group field's) name and value, returns the value the run uses,
and raises :class:`~trainbus.ConfigError` naming the option, the value and what is allowed.
Checks that need two options (a scheduler and its optimizers, a precision and its device) and
those of the groups of options (``EvalSchedule``...) live in :mod:`~trainbus._trainer.options`.
"""

from __future__ import annotations

import inspect
import math
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from .. import events as ev
from .._bus import EventBus
from .._exceptions import ConfigError
from .._loop.set_metrics import SetMetric
from .._loop.settings import eval_sets
from .._validate import check_int
from ..callbacks._base import Callback
from ..checkpoint import check_checkpoint_dir

Check = Callable[[str, Any], Any]
"""``check(name, value) -> the value the run uses``; raises ConfigError."""


def callable_or_none(allowed: str, *, show_type: bool = False) -> Check:
    """A callable or None (``show_type``: the message shows the value's type, not the value)."""

    def check(name: str, value: Any) -> Any:
        if value is not None and not callable(value):
            raise ConfigError.invalid(name, type(value).__name__ if show_type else value, allowed)
        return value

    return check


def int_at_least(minimum: int, *, optional: bool = False) -> Check:
    """An int >= ``minimum`` (or None when ``optional``)."""
    return lambda name, value: check_int(name, value, minimum, optional=optional)


def boolean(allowed: str = "True or False") -> Check:
    """True or False."""

    def check(name: str, value: Any) -> bool:
        if not isinstance(value, bool):
            raise ConfigError.invalid(name, value, allowed)
        return value

    return check


def one_of(*choices: str, allowed: str) -> Check:
    """One of the strings ``choices``."""

    def check(name: str, value: Any) -> Any:
        if value not in choices:
            raise ConfigError.invalid(name, value, allowed)
        return value

    return check


def eval_data(name: str, value: Any) -> Any:
    """None, an iterable of batches, or a mapping of set names to them."""
    eval_sets(value)  # raises on a bad set; the settings build the sets
    return value


def clip_grad_norm(name: str, value: Any) -> float | None:
    """A finite number > 0, or None."""
    if value is None:
        return None
    if not (isinstance(value, int | float) and not isinstance(value, bool)
            and math.isfinite(value) and value > 0):  # fmt: skip
        raise ConfigError.invalid(name, value, "a finite number > 0 or None")
    return float(value)


def accumulate_by(name: str, value: Any) -> Any:
    """``"batches"``, ``"items"`` or a function ``fn(batch) -> items``."""
    if (
        value in ("batches", "items")
        if isinstance(value, str)
        else callable(value) and not isinstance(value, type)
    ):
        return value
    raise ConfigError.invalid(
        name, value, "'batches', 'items' (labels != -100 per micro-batch) or fn(batch) -> int"
    )


def _refuses_two_arguments(fn: Callable[..., Any]) -> str | None:
    """``fn``'s signature when it cannot be called with two positional arguments, else None
    (also when it has no signature to read, as some builtins)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    try:
        signature.bind(None, None)
    except TypeError:
        return str(signature)
    return None


def metrics(name: str, value: Any) -> dict[str, Callable[[Any, Any], Any]]:
    """None or a mapping of identifiers to ``fn(outputs, targets)``."""
    if value is not None and not isinstance(value, Mapping):
        raise ConfigError.invalid(name, value, "a mapping of names to fn(outputs, targets)")
    out = dict(value or {})
    for key, fn in out.items():
        if not isinstance(key, str) or not key.isidentifier() or not callable(fn):
            raise ConfigError.invalid(
                f"metrics[{key!r}]", fn, "an identifier mapped to fn(outputs, targets)"
            )
        taken = _refuses_two_arguments(fn)
        if taken is not None:
            raise ConfigError.invalid(
                f"metrics[{key!r}]",
                fn,
                f"fn(outputs, targets), called with two arguments per evaluation batch; this "
                f"one takes {taken}",
            )
    return out


def set_metrics(name: str, value: Any) -> dict[str, SetMetric]:
    """None or a mapping of identifiers to objects with ``update`` and ``compute``."""
    allowed = "a mapping of names to set metrics (update(outputs, targets), compute(totals))"
    if value is not None and not isinstance(value, Mapping):
        raise ConfigError.invalid(name, value, allowed)
    out = dict(value or {})
    for key, metric in out.items():
        if (not isinstance(key, str) or not key.isidentifier()
                or isinstance(metric, type) or not isinstance(metric, SetMetric)):  # fmt: skip
            raise ConfigError.invalid(
                f"{name}[{key!r}]", metric, "an identifier mapped to an object with "
                "update(outputs, targets) -> {name: sum} and compute(totals) -> float "
                "(trainbus.SetMetric; e.g. trainbus.Perplexity())",
            )  # fmt: skip
        taken = _refuses_two_arguments(metric.update)
        if taken is not None:
            raise ConfigError.invalid(
                f"{name}[{key!r}]",
                metric,
                f"a set metric whose update(outputs, targets) takes two arguments; its update "
                f"takes {taken}",
            )
    return out


def checkpoint_dir(name: str, value: Any) -> Path | None:
    """None, or a folder creatable and writable, not under a file: found now, not at the
    first save (nothing is created)."""
    return None if value is None else check_checkpoint_dir(value)


def callbacks(name: str, value: Any) -> tuple[Callback | type[Callback], ...]:
    """Callback classes or instances (one alone too), checked, not instantiated."""
    if isinstance(value, Callback | type):
        value = [value]
    if not isinstance(value, Iterable):
        raise ConfigError.invalid(name, value, "an iterable of Callbacks")
    out = tuple(value)
    for cb in out:
        if not (isinstance(cb, Callback) or (isinstance(cb, type) and issubclass(cb, Callback))):
            raise ConfigError.invalid(name, cb, "Callback subclasses or instances")
    return out


def progress(name: str, value: Any) -> bool | None:
    """None, True or False."""
    if value is not None and not isinstance(value, bool):
        raise ConfigError.invalid(name, value, "None (when stderr is a terminal), True or False")
    return value


def bus(name: str, value: Any) -> EventBus | None:
    """An EventBus or None."""
    if value is not None and not isinstance(value, EventBus):
        raise ConfigError.invalid(name, value, "a trainbus.EventBus or None")
    return value


train_step = callable_or_none("a callable step(ctx) or None", show_type=True)
loss_fn = callable_or_none("a callable loss_fn(outputs, targets) or None")
on_nonfinite = one_of("raise", "stop", "skip", "ignore",
                      allowed="'raise', 'stop', 'skip' or 'ignore'")  # fmt: skip


def ddp(name: str, value: Any) -> bool | None:
    """None (DDP unless the model is sharded), True or False; the model decides None later."""
    if value is not None and not isinstance(value, bool):
        raise ConfigError.invalid(
            name, value, "None (DDP unless the model is sharded with fully_shard), True or False"
        )
    return value


def attach(name: str, value: Any) -> bool | str | os.PathLike[str]:
    """True, False or a folder; the folder itself is checked with the run's checkpoint_dir
    (:func:`~trainbus._distributed.attach_server.attach_folder`)."""
    if isinstance(value, bool):
        return value
    if not isinstance(value, str | os.PathLike) or not os.fspath(value):
        raise ConfigError.invalid(name, value, "True (listen in checkpoint_dir), False, or a "
                                  "folder to listen in")  # fmt: skip
    return value


def trace(name: str, value: Any) -> frozenset[str]:
    """The parts of a step to time: True (every one of ``events.TRACED_SPANS``), False (none)
    or a collection of their names.

    Raises:
        ConfigError: ``value`` is none of those, or names a part that is not traced.
    """
    allowed = f"True, False or a set of {list(ev.TRACED_SPANS)}"
    if isinstance(value, bool):
        return frozenset(ev.TRACED_SPANS) if value else frozenset()
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise ConfigError.invalid(name, value, allowed)
    spans = frozenset(value)
    unknown = sorted(str(s) for s in spans if s not in ev.TRACED_SPANS)
    if unknown:
        raise ConfigError.invalid(name, value, f"{allowed} (not {unknown})")
    return spans

"""Eager argument checks: each raises :class:`~trainbus.ConfigError` naming the argument, the
value received and what is allowed, where the typo was written."""

from __future__ import annotations

import difflib
import functools
import inspect
import math
import os
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Literal, ParamSpec, TypeGuard, TypeVar, overload

from ._exceptions import ConfigError

__all__ = [
    "check_bool",
    "check_int",
    "check_metric",
    "check_mode",
    "check_number",
    "check_optional_seconds",
    "check_path",
    "check_seconds",
    "explains_unknown_keywords",
    "unknown_keyword_message",
]


def _finite(value: object) -> TypeGuard[int | float]:
    """A finite int or float, not a bool."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def check_seconds(name: str, value: object) -> float:
    """A finite number of seconds > 0."""
    if _finite(value) and value > 0:
        return float(value)
    raise ConfigError.invalid(name, value, "seconds as a finite number > 0")


def check_optional_seconds(name: str, value: object) -> float | None:
    """None, or a finite number of seconds > 0."""
    if value is None:
        return None
    if _finite(value) and value > 0:
        return float(value)
    raise ConfigError.invalid(name, value, "None, or seconds as a finite number > 0")


@overload
def check_int(name: str, value: object, minimum: int) -> int: ...
@overload
def check_int(name: str, value: object, minimum: int, *, optional: bool) -> int | None: ...
def check_int(name: str, value: object, minimum: int, *, optional: bool = False) -> int | None:
    """An int >= ``minimum`` (or None when ``optional``); bools are refused."""
    if value is None and optional:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError.invalid(
            name, value, f"an int >= {minimum}" + (", or None" if optional else "")
        )
    return value


def check_number(name: str, value: object, *, positive: bool = False) -> float:
    """A finite number >= 0 (> 0 when ``positive``); bools are refused."""
    if not _finite(value) or value < 0 or (positive and value == 0):
        raise ConfigError.invalid(name, value, "a finite number " + ("> 0" if positive else ">= 0"))
    return float(value)


def check_bool(name: str, value: object) -> bool:
    """True or False (not a truthy stand-in)."""
    if not isinstance(value, bool):
        raise ConfigError.invalid(name, value, "True or False")
    return value


_HIGHER_IS_BETTER = frozenset(
    "acc accuracy auc auroc ap map f1 fmeasure precision recall iou miou dice bleu rouge".split()
)


def check_mode(value: object, metric: str | None) -> Literal["min", "max"]:
    """A monitor's ``mode`` with ``"auto"`` resolved for ``metric``: ``"max"`` when a word of
    its name is accuracy-like and none is ``loss`` or ``error``, else ``"min"``
    (docs/callbacks/index.md); ``ConfigError`` for any other mode."""
    if value == "min" or value == "max":
        return value
    if value != "auto":
        raise ConfigError.invalid(
            "mode", value, "'min' (lower is better), 'max' or 'auto' (from the metric's name)"
        )
    words = set(re.split(r"[^a-z0-9]+", (metric or "").lower()))
    if words & {"loss", "error"} or not words & _HIGHER_IS_BETTER:
        return "min"
    return "max"


def check_metric(name: str, value: object) -> str:
    """A non-empty metric name such as ``"val_loss"``."""
    if not isinstance(value, str) or not value:
        raise ConfigError.invalid(name, value, "a metric name such as 'val_loss'")
    return value


def check_state_key(value: object) -> str | None:
    """A callback's ``state_key``: None or a non-empty string."""
    if value is not None and (not isinstance(value, str) or not value):
        raise ConfigError.invalid("state_key", value, "a non-empty string or None (the class name)")
    return value


def _path(name: str, value: object, kind: str) -> Path:
    if not isinstance(value, str | os.PathLike) or not os.fspath(value):
        raise ConfigError.invalid(name, value, f"a {kind} path (str or pathlib.Path)")
    return Path(value)


def check_path(name: str, value: object) -> Path:
    """A file path (``str`` or ``os.PathLike``) that is not an existing directory."""
    path = _path(name, value, "file")
    if path.is_dir():
        raise ConfigError.invalid(name, value, "a file path, not an existing directory")
    return path


def check_folder(name: str, value: object) -> Path:
    """A folder path (``str`` or ``os.PathLike``) that is not an existing file."""
    path = _path(name, value, "folder")
    if path.exists() and not path.is_dir():
        raise ConfigError.invalid(name, value, "a folder path, not an existing file")
    return path


P = ParamSpec("P")
R = TypeVar("R")


def unknown_keyword_message(
    owner: str, name: str, known: Iterable[str], hint: str | None = None
) -> str:
    """Python's message for an unexpected keyword, with ``hint`` (what replaces ``name``) or
    else the nearest known keyword."""
    near = difflib.get_close_matches(name, list(known), n=1)
    tail = f": {hint}" if hint else f" (did you mean {near[0]!r}?)" if near else ""
    return f"{owner}() got an unexpected keyword argument {name!r}{tail}"


def explains_unknown_keywords(
    message: Callable[[str, Any, list[str]], str],
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Wrap a function, its signature kept (an ``async def`` stays one), so that a keyword it
    does not take is a ``TypeError`` saying ``message(name, value, keywords)``."""

    def decorate(fn: Callable[P, R]) -> Callable[P, R]:
        params: Mapping[str, inspect.Parameter] = inspect.signature(fn).parameters
        keywords = [n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]

        def check(kwargs: Mapping[str, Any]) -> None:
            for name, value in kwargs.items():
                if name not in params:
                    raise TypeError(message(name, value, keywords))

        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def checked_async(*args: P.args, **kwargs: P.kwargs) -> Any:
                check(kwargs)
                return await fn(*args, **kwargs)

            return checked_async  # type: ignore[return-value]

        @functools.wraps(fn)
        def checked(*args: P.args, **kwargs: P.kwargs) -> R:
            check(kwargs)
            return fn(*args, **kwargs)

        return checked

    return decorate

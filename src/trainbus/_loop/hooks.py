"""Inline hooks: functions run on the training thread at a point of the step with a mutable
:class:`StepContext`; their exceptions propagate."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeAlias

from .._exceptions import ConfigError
from .._hookpoints import HOOK_POINTS, HookPoint, StepContext

__all__ = ["HookFn", "HookHandle", "Hooks", "StepContext"]

_TIERS = ("core", "user", "global")


HookFn: TypeAlias = Callable[[StepContext], Any]


class HookHandle:
    """Returned by :meth:`Hooks.add`; ``remove()`` unregisters the hook."""

    def __init__(self, hooks: Hooks, point: HookPoint, entry: tuple[int, int, HookFn]) -> None:
        self._hooks, self._point, self._entry = hooks, point, entry

    def remove(self) -> None:
        """Unregister the hook. Idempotent."""
        self._hooks.discard(self._point, self._entry)


class Hooks:
    """The hook registry: per point, functions sorted by tier (core, user, global), then
    registration order. ``by_point`` is swapped whole on a change: one read is one view."""

    def __init__(self) -> None:
        self._entries: dict[HookPoint, list[tuple[int, int, HookFn]]] = {p: [] for p in HOOK_POINTS}
        self.by_point: dict[HookPoint, tuple[HookFn, ...]] = {p: () for p in HOOK_POINTS}
        self._seq = 0

    def add(self, point: HookPoint, fn: HookFn, *, tier: str = "user") -> HookHandle:
        """Register ``fn(ctx)`` at ``point``.

        Raises:
            ConfigError: unknown point or tier, or ``fn`` not callable.
        """
        if point not in HOOK_POINTS:
            raise ConfigError.invalid("point", point, "one of " + ", ".join(map(repr, HOOK_POINTS)))
        if tier not in _TIERS:
            raise ConfigError.invalid("tier", tier, f"one of {_TIERS}")
        if not callable(fn):
            raise ConfigError.invalid("fn", fn, "a callable taking the StepContext")
        self._seq += 1
        entry = (_TIERS.index(tier), self._seq, fn)
        self._entries[point].append(entry)
        self._rebuild(point)
        return HookHandle(self, point, entry)

    def discard(self, point: HookPoint, entry: tuple[int, int, HookFn]) -> None:
        """Unregister the hook ``entry`` (as :meth:`add` made it) at ``point``; idempotent."""
        if entry in self._entries[point]:
            self._entries[point].remove(entry)
            self._rebuild(point)

    def which(self, exc: BaseException) -> tuple[HookPoint, str] | None:
        """The point and name of the hook whose code is in ``exc``'s traceback, or None."""
        codes: dict[Any, tuple[HookPoint, str]] = {}
        for point, fns in self.by_point.items():
            for fn in fns:
                target = getattr(fn, "__func__", getattr(fn, "func", fn))
                code = getattr(target, "__code__", None)
                if code is None:
                    call = type(fn).__call__
                    code = getattr(call, "__code__", None)
                if code is not None:
                    codes.setdefault(code, (point, getattr(fn, "__qualname__", repr(fn))))
        tb = exc.__traceback__
        while tb is not None:
            found = codes.get(tb.tb_frame.f_code)
            if found is not None:
                return found
            tb = tb.tb_next
        return None

    def _rebuild(self, point: HookPoint) -> None:
        self.by_point = {**self.by_point, point: tuple(e[2] for e in sorted(self._entries[point]))}

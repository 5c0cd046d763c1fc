"""The callbacks added to a trainer: their subscriptions on the bus and their hooks."""

from __future__ import annotations

from .._bus import EventBus, Tier
from .._bus.subscriptions import Subscription
from .._exceptions import ConfigError
from .._loop import HookHandle, Hooks
from .._moved import lightning_method_hint
from ..callbacks._base import Callback

__all__ = ["AddedCallbacks", "hook_methods", "instance"]


def hook_methods(callback: Callback) -> dict[str, str]:
    """The callback's ``hook_*`` methods and their points, its ``on_*`` methods checked (a
    Lightning method name, ``on_train_batch_end``, refused naming what replaces it)."""
    cls = type(callback)
    try:
        return cls.methods()[1]
    except ConfigError:
        for name in dir(cls):
            hint = lightning_method_hint(name)
            if hint is not None and callable(getattr(cls, name)):
                raise ConfigError.invalid(f"{cls.__name__}.{name}", name, hint) from None
        raise


def instance(callback: Callback | type[Callback]) -> Callback:
    """The callback, a Callback class instantiated (else ``ConfigError``)."""
    is_class = isinstance(callback, type) and issubclass(callback, Callback)
    cb = callback() if is_class else callback  # type: ignore[operator]
    if not isinstance(cb, Callback):
        raise ConfigError.invalid("callbacks", callback, "Callback subclasses or instances")
    return cb


class AddedCallbacks:
    """The added callbacks, each with what adding it created on the bus and in the hooks (to
    undo it on removal)."""

    def __init__(self, bus: EventBus, hooks: Hooks) -> None:
        self._bus = bus
        self._hooks = hooks
        # id -> (the callback, its subscriptions, its hooks): what removing it undoes
        self._entries: dict[int, tuple[Callback, list[Subscription], list[HookHandle]]] = {}

    def __contains__(self, callback: object) -> bool:
        return id(callback) in self._entries

    @property
    def callbacks(self) -> tuple[Callback, ...]:
        """The added callbacks, in attachment order."""
        return tuple(entry[0] for entry in self._entries.values())

    def add(self, callback: Callback | type[Callback], tier: Tier) -> Callback:
        """Add a callback (``Trainer.add_callback``); the added instance."""
        cb = instance(callback)
        if id(cb) in self._entries:
            raise ConfigError.invalid("callback", cb, "a callback not added yet")
        if cb.stateful:
            key = cb.state_key
            for other, *_ in self._entries.values():
                if other.stateful and other.state_key == key:
                    raise ConfigError.invalid(
                        "state_key",
                        key,
                        f"a name no other stateful callback has: {other!r} "
                        f"and {cb!r} both save their state as {key!r}; pass state_key= to one",
                    )
        hooks_map = hook_methods(cb)
        bus = self._bus
        mark = len(bus.subscriptions)
        handles: list[HookHandle] = []
        with bus.tier(tier):
            cb.subscribe_to(bus)
        for name, point in sorted(hooks_map.items()):
            handles.append(self._hooks.add(point, getattr(cb, name), tier=tier))  # type: ignore[arg-type]
        self._entries[id(cb)] = (cb, list(bus.subscriptions[mark:]), handles)
        return cb

    def remove(self, callback: Callback) -> None:
        """Detach an added callback: dispose its subscriptions and remove its hooks."""
        entry = self._entries.pop(id(callback), None)
        if entry is None:
            raise ConfigError.invalid("callback", callback, "a callback added to this trainer")
        for sub in entry[1]:
            sub.dispose()
        for handle in entry[2]:
            handle.remove()

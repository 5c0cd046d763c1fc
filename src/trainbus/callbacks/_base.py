"""Class-based callbacks: ``on_<event>`` methods become subscribers and ``hook_<point>``
methods inline hooks, resolved once when added; process-wide ones form the "global" tier."""

from __future__ import annotations

import inspect
import re
import threading
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from pathlib import PurePath
from types import TracebackType
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Self

import torch

from .. import events as ev
from .._bus.subscriptions import OVERFLOWS, Overflow
from .._bus.watchdog import ERROR_POLICIES, ErrorPolicy
from .._exceptions import ConfigError
from .._hookpoints import HOOK_POINTS
from .._validate import check_bool, check_int, check_state_key

if TYPE_CHECKING:
    from .._bus import EventBus
    from .._loop.result import FitResult  # where it is defined: no circle through the trainer

__all__ = [
    "Callback",
    "GlobalCallbackHandle",
    "RunPlan",
    "SubscribeOptions",
    "global_callbacks",
    "register_global_callback",
]


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


EVENT_METHODS: dict[str, type[ev.BaseEvent]] = {
    f"on_{_snake(t.__name__)}": t for t in ev.EVENT_TYPES
}
EVENT_METHODS["on_event"] = ev.BaseEvent
HOOK_METHODS: dict[str, str] = {f"hook_{p}": p for p in HOOK_POINTS}


@dataclass(frozen=True, slots=True, kw_only=True)
class RunPlan:
    """What a ``fit()`` is about to do, as :meth:`Callback.check` sees it before it starts.

    Attributes:
        eval_metrics: Every key this run's evaluations can put in ``EvaluationEnded.metrics``
            (``val_loss``, ``val_<name>``, or ``<set>/loss``, ``<set>/<name>`` for named
            sets); empty without ``eval_data``.
        train_metrics: Every key ``MetricsLogged.metrics`` can carry (``loss``, ``lr``,
            ``steps_per_s``, ...).
        checkpoint_dir: Where the run saves checkpoints (None: ``SaveCheckpoint`` is refused).
        external_evaluations: An added callback publishes ``ExternalEvaluationEnded``
            (:class:`~trainbus.callbacks.EvaluateCheckpoints`): metrics whose names only its
            jobs know may come.
        config: The Trainer's plain settings (``max_epochs``, ``precision``...; devices and
            paths as strings), for loggers that record a run's configuration.
        sharded: The model is sharded (FSDP2 ``fully_shard``): checkpoints are folders.
    """

    eval_metrics: frozenset[str]
    train_metrics: frozenset[str]
    checkpoint_dir: str | None
    external_evaluations: bool = False
    config: Mapping[str, PlainValue] = field(default_factory=dict)
    sharded: bool = False


PlainValue = str | int | float | bool | None
"""A configuration value a tracking service stores as it is."""
_PLAIN_TYPES = frozenset({"int", "float", "str", "bool", "None", "Path"})


def plain_settings(settings: object) -> dict[str, PlainValue]:
    """A settings dataclass' plain fields, in order: paths and devices as strings, None only
    for a field of plain types (``max_steps=None``, not ``scheduler=None``)."""
    if not is_dataclass(settings) or isinstance(settings, type):
        raise TypeError(f"plain_settings() needs a dataclass instance, got {settings!r}")
    out: dict[str, PlainValue] = {}
    for f in fields(settings):
        value = getattr(settings, f.name)
        if value is None:
            # Only a field of plain types (``int | None``), its annotation a string or a type.
            text = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
            if all(part.strip() in _PLAIN_TYPES for part in str(text).split("|")):
                out[f.name] = None
        elif isinstance(value, str | int | float | bool):
            out[f.name] = value
        elif isinstance(value, PurePath | torch.device):
            out[f.name] = str(value)
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class SubscribeOptions:
    """How a :class:`Callback`'s ``on_*`` methods subscribe: the options of
    :meth:`EventBus.subscribe_async <trainbus.bus.EventBus.subscribe_async>`, same names and
    defaults (``on_error`` also for plain ``def on_*`` methods). See docs/bus.md.

    Args:
        on_error: ``"log"``, ``"stop"`` or ``"raise"`` (None: the bus' default).
        concurrency: Concurrent calls of each ``async def on_*`` method.
        buffer: Items each ``async def on_*`` method may have waiting (None: the bus').
        overflow: What a full buffer does (None: ``"block"`` for a decider, else
            ``"drop_oldest"``).
        decides: Barriers delivering an event to an ``async def on_*`` method wait for it.

    Raises:
        ConfigError: naming the field (``SubscribeOptions.overflow``...), the value and what
            is allowed.
    """

    on_error: ErrorPolicy | None = None
    concurrency: int = 1
    buffer: int | None = None
    overflow: Overflow | None = None
    decides: bool = False

    def __post_init__(self) -> None:
        if self.on_error is not None and self.on_error not in ERROR_POLICIES:
            raise ConfigError.invalid(
                "SubscribeOptions.on_error", self.on_error, f"None or one of {ERROR_POLICIES}"
            )
        check_int("SubscribeOptions.concurrency", self.concurrency, 1)
        check_int("SubscribeOptions.buffer", self.buffer, 1, optional=True)
        if self.overflow is not None and self.overflow not in OVERFLOWS:
            raise ConfigError.invalid(
                "SubscribeOptions.overflow", self.overflow, f"one of {OVERFLOWS}"
            )
        check_bool("SubscribeOptions.decides", self.decides)


# Class attributes of earlier versions -> the ``SubscribeOptions`` field each one became.
_FORMER_OPTIONS = {"error_policy": "on_error"} | {f.name: f.name for f in fields(SubscribeOptions)}


class Callback:
    """Base class for class-based callbacks. Subclass it and define the methods you need.

    Attributes:
        subscribe_options: How its ``on_*`` methods subscribe (:class:`SubscribeOptions`: the
            options of ``EventBus.subscribe_async``, with its defaults), a class attribute.
        state_key: The name of this callback's state in checkpoints (the class name until
            set); two stateful callbacks with one key in a Trainer are a ``ConfigError``.
        ranks: Where its ``on_*`` methods and ``setup`` pipelines run under torchrun: None
            (rank 0), ``"all"``, a rank or ranks; ``hook_*`` methods run on every rank.
    """

    subscribe_options: ClassVar[SubscribeOptions] = SubscribeOptions()
    _state_key: str | None = None
    ranks: int | Iterable[int] | Literal["all"] | None = None
    publishes: ClassVar[tuple[type[ev.BaseEvent], ...]] = ()
    """Event types this callback publishes itself (what :class:`RunPlan` tells the others)."""

    @property
    def state_key(self) -> str:
        """The name of its state in checkpoints: the one set, else the class name."""
        return self._state_key or type(self).__name__

    @state_key.setter
    def state_key(self, value: str | None) -> None:
        """Set the name (None: the class name).

        Raises:
            ConfigError: neither None nor a non-empty string.
        """
        self._state_key = check_state_key(value)

    @property
    def stateful(self) -> bool:
        """True when this callback's class overrides :meth:`state_dict`."""
        return type(self).state_dict is not Callback.state_dict

    def state_dict(self) -> dict[str, Any]:
        """The state to keep in checkpoints: tensors and plain containers only (what
        ``torch.load(weights_only=True)`` loads). Default: no state."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (called before ``FitStarted`` of a resumed
        run). Default: nothing to restore."""
        return None

    def check(self, plan: RunPlan) -> None:
        """Refuse a run this callback cannot work in (called on every rank before
        ``FitStarted``). Default: nothing to check.

        Raises:
            ConfigError: naming the option, its value and what this run allows.
        """
        return None

    def weights_at_end(self) -> str | None:
        """The checkpoint whose weights the model should hold when ``fit()`` returns (asked
        before :meth:`after_fit`; the first path given is loaded), or None. Default: None."""
        return None

    def after_fit(self, result: FitResult) -> None:
        """Called on every rank once a run that ended without an exception delivered every
        event, before ``fit()`` returns; it may raise to end the call (``trainer.result`` holds
        ``result``). Default: nothing.

        Args:
            result: The run's result.
        """
        return None

    def setup(self, bus: EventBus) -> None:
        """Build Rx pipelines on ``bus`` (once when added; disposed when removed)."""
        return None

    # Process-wide registration as a context manager: `with MyCallback(): trainer.fit_sync()`.
    def __enter__(self) -> Self:
        self._global_handle = register_global_callback(self)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        handle: GlobalCallbackHandle | None = getattr(self, "_global_handle", None)
        if handle is not None:
            handle.remove()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Refuse (``ConfigError``) a class attribute that ``subscribe_options`` replaced."""
        super().__init_subclass__(**kwargs)
        for name, replacement in _FORMER_OPTIONS.items():
            value = cls.__dict__.get(name)
            if value is not None and not callable(value):
                raise ConfigError(
                    f"{cls.__name__}.{name}={value!r}: a callback's subscription options are "
                    f"one class attribute now, subscribe_options = SubscribeOptions({replacement}="
                    f"{value!r})"
                )

    @classmethod
    def methods(cls) -> tuple[dict[str, type[ev.BaseEvent]], dict[str, str]]:
        """The ``on_*`` and ``hook_*`` methods this class defines, resolved and checked.

        Raises:
            ConfigError: a method named ``on_*`` / ``hook_*`` that matches no event or point.
        """
        subs: dict[str, type[ev.BaseEvent]] = {}
        hooks: dict[str, str] = {}
        for name in dir(cls):
            if name.startswith("on_") and callable(getattr(cls, name)):
                subs[name] = EVENT_METHODS.get(name) or _user_event(cls, name)
            elif name.startswith("hook_") and callable(getattr(cls, name)):
                if name not in HOOK_METHODS:
                    raise ConfigError.invalid(
                        f"{cls.__name__}.{name}", name, "one of " + ", ".join(sorted(HOOK_METHODS))
                    )
                hooks[name] = HOOK_METHODS[name]
        return subs, hooks

    def subscribe_to(self, bus: EventBus) -> None:
        """Subscribe its ``on_*`` methods (with its ``subscribe_options``) and call
        :meth:`setup`, on its ``ranks``.

        Raises:
            ConfigError: a misspelt ``on_*`` / ``hook_*`` method, or bad ``ranks``.
        """
        subs_map, _ = type(self).methods()
        options = self.subscribe_options
        if not isinstance(options, SubscribeOptions):
            raise ConfigError.invalid(
                f"{type(self).__name__}.subscribe_options",
                options,
                "a trainbus.callbacks.SubscribeOptions",
            )
        with bus.on_ranks(self.ranks):
            for name, event_type in sorted(subs_map.items()):
                method = getattr(self, name)
                label = f"{type(self).__name__}.{name}"
                if inspect.iscoroutinefunction(method):
                    bus.subscribe_async(
                        bus.stream(event_type), method, name=label, **asdict(options)
                    )
                else:
                    bus.subscribe(
                        bus.stream(event_type), method, on_error=options.on_error, name=label
                    )
            self.setup(bus)


def _user_event(cls: type, name: str) -> type[ev.BaseEvent]:
    """The user's ``BaseEvent`` subclass ``name`` names; else a ``ConfigError``."""
    found: dict[str, type[ev.BaseEvent]] = {}
    stack: list[type[ev.BaseEvent]] = [ev.BaseEvent]
    while stack:
        for sub in stack.pop().__subclasses__():
            stack.append(sub)
            if f"on_{_snake(sub.__name__)}" == name:
                found[f"{sub.__module__}.{sub.__qualname__}"] = sub
    if len(found) == 1:
        return next(iter(found.values()))
    if found:
        raise ConfigError.invalid(
            f"{cls.__name__}.{name}",
            name,
            "a method naming one event class; several match: "
            + ", ".join(sorted(found))
            + " (rename one, or subscribe with bus.stream(TheClass))",
        )
    removed = next((old for old in ev.REMOVED if f"on_{_snake(old)}" == name), None)
    if removed is not None:
        raise ConfigError.invalid(
            f"{cls.__name__}.{name}",
            name,
            f"an event's method; {removed} was removed: use {ev.REMOVED[removed]} "
            "(on_span_traced, with Trainer(trace=True))",
        )
    raise ConfigError.invalid(
        f"{cls.__name__}.{name}",
        name,
        "on_<event in snake_case>, e.g. on_step_ended, or of your own event class (a "
        "subclass of trainbus.events.BaseEvent, defined before the callback is added); "
        "known: " + ", ".join(sorted(EVENT_METHODS)),
    )


class GlobalCallbackHandle:
    """Returned by :func:`register_global_callback`; ``remove()`` unregisters."""

    def __init__(self, callback: Callback) -> None:
        self.callback = callback

    def remove(self) -> None:
        """Unregister the callback (idempotent). Runs already started keep it until they end."""
        with _LOCK:
            if self.callback in _GLOBAL:
                _GLOBAL.remove(self.callback)


_GLOBAL: list[Callback] = []
_LOCK = threading.Lock()


def register_global_callback(callback: Callback) -> GlobalCallbackHandle:
    """Add ``callback`` to every Trainer whose ``fit()`` starts from now on (global tier).

    Raises:
        ConfigError: ``callback`` is not a Callback instance.
    """
    if not isinstance(callback, Callback):
        raise ConfigError.invalid("callback", callback, "a trainbus.Callback instance")
    type(callback).methods()  # fail early on a misspelt on_/hook_ method
    with _LOCK:
        _GLOBAL.append(callback)
    return GlobalCallbackHandle(callback)


def global_callbacks() -> tuple[Callback, ...]:
    """The callbacks registered process-wide, in registration order."""
    with _LOCK:
        return tuple(_GLOBAL)

"""The event bus: a cheap publish on the training thread, batched dispatch on the event loop.

How an event travels::

    training thread                      event-loop thread (anyio task group of the bus)
    publish(e): queue.append(e) ──────►  poller: every flush_interval, if the queue is non-empty,
                (nothing else)           take the n queued events and dispatch them in ONE slice:
                                         for each event, for each matching root observer (core,
                                         then user, then global tier), call on_next. No await
                                         between events, unless a "block" async buffer is full.

Why batching: every wake-up of the loop thread costs a tiny-model training thread 55-240 µs of
wall time (the two threads hand the GIL over), about a whole 100 µs step. A poller that wakes at
most once per interval costs that once per ~20 ms instead of once per event (DESIGN.md).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, Literal, TypeVar, overload

import anyio
import structlog
from anyio.abc import TaskGroup
from reactivex import Observable, abc
from reactivex.disposable import Disposable

from . import commands as cmd
from . import events as ev
from ._barrier import BarrierMixin
from ._channel import CommandChannelMixin, CommandError, _AckObserver
from ._dispatch import DispatchMixin
from ._exceptions import ConfigError, SubscriberError
from ._failures import FailureMixin, name_of
from ._lifecycle import LifecycleMixin
from ._observable import BusObservable, CommandSink, normalize_observer
from ._scheduler import AnyioScheduler, ChainScheduler
from ._subscription import (
    OVERFLOWS,
    AsyncSubscription,
    ErrorPolicy,
    GuardedObserver,
    Overflow,
    Subscription,
)
from ._validate import check_int, check_number

__all__ = ["CommandError", "EventBus", "Tier"]

_E = TypeVar("_E", bound=ev.BaseEvent)
log = structlog.get_logger(__name__)

Tier = Literal["internal", "core", "user", "global"]
_TIER_ORDER = {"internal": 0, "core": 1, "user": 2, "global": 3}


class _Root:
    """One subscription at the top of a chain: the types it takes and the observer to feed."""

    __slots__ = ("observer", "order", "types")

    def __init__(self, types: tuple[type, ...], observer: abc.ObserverBase[Any], order: int):
        self.types = types
        self.observer = observer
        self.order = order


class EventBus(DispatchMixin, BarrierMixin, CommandChannelMixin, FailureMixin, LifecycleMixin):
    """The reactive bus between the training loop and its subscribers.

    Args:
        flush_interval: Seconds between two dispatches of the queue (the bound on delivery lag
            when the loop thread gets the GIL on time). Default 0.02, measured best here.
        max_queue: Published events that may wait undelivered before ``publish`` makes its
            thread wait for the dispatcher; bounds memory when a ``"block"`` subscriber stalls.
        close_timeout: Seconds closing waits for async subscribers to finish their buffers
            before cancelling them (what was cancelled is counted and logged).
        on_error: Default error policy of subscriptions made without one.
        scheduler: Scheduler handed to every subscription for time-based operators. Default: a
            new :class:`~trainbus._scheduler.AnyioScheduler` on the bus' loop. Tests pass a
            virtual-time scheduler (``trainbus.testing.VirtualTimeScheduler``).

    Raises:
        ConfigError: for an argument out of range.

    Use it as an async context manager: ``async with EventBus() as bus: ...``. A bus runs once.
    """

    def __init__(
        self,
        *,
        flush_interval: float = 0.02,
        max_queue: int = 65_536,
        close_timeout: float = 10.0,
        on_error: ErrorPolicy = "log",
        scheduler: abc.SchedulerBase | None = None,
    ) -> None:
        if (
            isinstance(flush_interval, bool)
            or not isinstance(flush_interval, int | float)
            or not (0 < flush_interval <= 10)
        ):
            raise ConfigError.invalid("flush_interval", flush_interval, "seconds in (0, 10]")
        check_int("max_queue", max_queue, 1)
        check_number("close_timeout", close_timeout)
        self._check_policy(on_error)
        if scheduler is not None and not isinstance(scheduler, abc.SchedulerBase):
            raise ConfigError.invalid("scheduler", scheduler, "a reactivex scheduler or None")
        self.flush_interval = float(flush_interval)
        self.max_queue = max_queue
        self.close_timeout = float(close_timeout)
        self.default_on_error: ErrorPolicy = on_error
        self._own_scheduler = scheduler is None
        self.scheduler: abc.SchedulerBase = scheduler or AnyioScheduler(self._scheduler_failed)
        # What chains get: timers on self.scheduler, "now" work inline (see ChainScheduler).
        self._chain_scheduler = ChainScheduler(self.scheduler)

        # The hand-off. deque.append/popleft are atomic under the GIL: no lock on the hot path.
        self._queue: deque[ev.BaseEvent] = deque()
        self._commands: deque[cmd.Command] = deque()
        self._room = threading.Event()  # set by the dispatcher after each drain

        self._roots: list[_Root] = []
        self._routes: dict[type, tuple[abc.ObserverBase[Any], ...]] = {}
        self.routes_version = 0
        """Bumped whenever a subscription comes or goes: a publisher caching :meth:`wants`
        answers re-reads them when this changes (one int compare per step)."""
        self._seq = 0
        self._tier: Tier = "user"
        self._subscriptions: list[Subscription] = []
        self._requests: dict[int, tuple[cmd.Command, anyio.Event, list[Any]]] = {}

        self._request_wake: anyio.Event | None = None
        self._barrier_pending: tuple[list[tuple[AsyncSubscription, int]], float] | None = None
        self._pressure = False
        self._close_deadline: float | None = None  # loop time by which closing gives up waiting
        self._delivered = 0
        self._failed = 0
        self._scheduler_failures = 0
        self._publisher_waits = 0
        self._fatal: SubscriberError | None = None
        self._state: Literal["new", "running", "closing", "closed"] = "new"
        self._loop_thread: int | None = None
        self._tg: TaskGroup | None = None

        self._events: BusObservable[ev.BaseEvent] = self._make_stream((ev.BaseEvent,))
        self.commands: CommandSink = CommandSink(self)
        """The back-channel as an Rx observer: ``pipeline.subscribe(bus.commands)``."""
        self._register_root((ev.CommandApplied,), _AckObserver(self), "internal")

    # ================================================================== publishing side
    def publish(self, event: ev.BaseEvent) -> None:
        """Queue ``event`` for delivery. Safe from any thread; never waits for subscribers.

        Cost on the calling thread: a type check and a deque append. It waits only when
        ``max_queue`` events are already waiting (a stalled ``"block"`` subscriber).

        Raises:
            ConfigError: ``event`` is not a trainbus event.
        """
        if not isinstance(event, ev.BaseEvent):
            raise ConfigError.invalid("event", event, "an instance of a trainbus event class")
        q = self._queue
        q.append(event)
        if len(q) > self.max_queue:
            self._wait_for_room()

    def wants(self, event_type: type[ev.BaseEvent]) -> bool:
        """True when some subscription would receive events of ``event_type``.

        The loop asks before building an event, so an event nobody listens to costs nothing.
        """
        routes = self._routes.get(event_type)
        if routes is None:
            routes = self._resolve(event_type)
        return bool(routes)

    def _wait_for_room(self) -> None:
        if self._state != "running" or threading.get_ident() == self._loop_thread:
            return  # never block the loop itself, nor a bus that is not dispatching
        self._publisher_waits += 1
        while len(self._queue) > self.max_queue and self._state == "running":
            self._room.clear()
            self._room.wait(self.flush_interval)

    # ================================================================== subscribing side
    @property
    def events(self) -> BusObservable[ev.BaseEvent]:
        """Every event, as a hot Observable whose subscribers run on the event-loop thread."""
        return self._events

    @overload
    def stream(self, event_type: type[_E], /) -> BusObservable[_E]: ...
    @overload
    def stream(self, *event_types: type[ev.BaseEvent]) -> BusObservable[ev.BaseEvent]: ...
    def stream(self, *event_types: type[ev.BaseEvent]) -> BusObservable[Any]:
        """Events of the given types (subclasses included), as a typed hot Observable.

        Subscribing registers demand, so :meth:`wants` turns true for those types.

        Raises:
            ConfigError: no type given, or one that is not a trainbus event class.
        """
        if not event_types:
            raise ConfigError.invalid("event_types", (), "at least one event class")
        for t in event_types:
            if not (isinstance(t, type) and issubclass(t, ev.BaseEvent)):
                raise ConfigError.invalid(
                    "event_types", t, "event classes from trainbus.events (e.g. ev.StepEnded)"
                )
        return self._make_stream(tuple(event_types))

    def _make_stream(self, types: tuple[type, ...]) -> BusObservable[Any]:
        def subscribe(observer: abc.ObserverBase[Any], _: Any = None) -> abc.DisposableBase:
            root = self._register_root(types, observer, self._tier)
            return Disposable(lambda: self._unregister_root(root))

        return BusObservable(self, Observable(subscribe))

    def subscribe(
        self,
        observable: Observable[Any],
        on_next: Callable[[Any], Any] | abc.ObserverBase[Any],
        *,
        on_error: ErrorPolicy | None = None,
        name: str | None = None,
    ) -> Subscription:
        """Subscribe a sync observer (function or Rx observer) under the bus' guard.

        Works with any Observable built from bus streams (``reactivex.merge(...)`` included):
        the bus scheduler is handed to its time-based operators.

        Raises:
            ConfigError: ``on_next`` is not callable, or an unknown ``on_error`` policy.
        """
        return BusObservable(self, observable).subscribe(on_next, policy=on_error, name=name)

    def subscribe_async(
        self,
        observable: Observable[Any],
        fn: Callable[[Any], Awaitable[Any]],
        *,
        concurrency: int = 1,
        buffer: int | None = None,
        overflow: Overflow = "block",
        on_error: ErrorPolicy | None = None,
        name: str | None = None,
    ) -> AsyncSubscription:
        """Run ``async def fn(item)`` for each item, in the bus' task group.

        Args:
            observable: A bus stream, possibly piped through operators.
            fn: An ``async def`` function of one item.
            concurrency: Worker tasks awaiting ``fn`` at once (order kept only with 1).
            buffer: Items that may wait; default 64 (``"latest"``: 1, and only 1 is allowed).
            overflow: ``"block"`` never drops (the bus waits, then the publisher);
                ``"drop_oldest"`` drops the oldest waiting item; ``"latest"`` keeps only the
                newest waiting item. Every drop is counted.
            on_error: Error policy for exceptions from ``fn`` (default: the bus').
            name: Name in logs and statistics (default: the function's qualified name).

        Returns:
            The subscription handle (dispose it to stop; ``statistics()`` for counters).

        Raises:
            ConfigError: for a non-callable ``fn`` or an argument out of range.
        """
        if not callable(fn):
            raise ConfigError.invalid("fn", fn, "an async function of one item")
        if not isinstance(concurrency, int) or concurrency < 1:
            raise ConfigError.invalid("concurrency", concurrency, "an int >= 1")
        if overflow not in OVERFLOWS:
            raise ConfigError.invalid("overflow", overflow, f"one of {OVERFLOWS}")
        if buffer is None:
            buffer = 1 if overflow == "latest" else 64
        if not isinstance(buffer, int) or buffer < 1:
            raise ConfigError.invalid("buffer", buffer, "an int >= 1")
        if overflow == "latest" and buffer != 1:
            raise ConfigError.invalid("buffer", buffer, "1 (or omitted) with overflow='latest'")
        policy = self._check_policy(on_error)
        self._check_open_for_subscribers()
        sub = AsyncSubscription(
            self,
            name or name_of(fn),
            fn,
            concurrency=concurrency,
            buffer=buffer,
            overflow=overflow,
            on_error=policy,
        )
        self._subscriptions.append(sub)
        if self._tg is not None:
            sub.start(self._tg)
        observer = _AsyncFeeder(sub)
        source = observable if isinstance(observable, BusObservable) else None
        wrapped = source or BusObservable(self, observable)
        sub.upstream = wrapped._subscribe_raw(observer)
        return sub

    def _subscribe_guarded(
        self,
        source: Observable[Any],
        observer: Any,
        on_error_cb: Any,
        on_completed: Any,
        *,
        policy: ErrorPolicy | None,
        name: str | None,
        scheduler: abc.SchedulerBase | None,
    ) -> Subscription:
        self._check_open_for_subscribers()
        on_next, on_error_cb, on_completed = normalize_observer(
            self, observer, on_error_cb, on_completed
        )
        sub = Subscription(self, name or name_of(on_next), self._check_policy(policy))
        self._subscriptions.append(sub)
        guard = GuardedObserver(sub, on_next, on_error_cb, on_completed)
        chain_scheduler = ChainScheduler(scheduler) if scheduler else self._chain_scheduler
        sub.upstream = source.subscribe(guard, scheduler=chain_scheduler)
        return sub

    # ------------------------------------------------------------------ routing
    def _register_root(
        self, types: tuple[type, ...], observer: abc.ObserverBase[Any], tier: Tier
    ) -> _Root:
        # Sorted by tier, then by order of subscription: core -> user -> global.
        self._seq += 1
        root = _Root(types, observer, _TIER_ORDER[tier] * 1_000_000_000 + self._seq)
        self._roots.append(root)
        self._roots.sort(key=lambda r: r.order)
        self._routes = {}
        self.routes_version += 1
        return root

    def _unregister_root(self, root: _Root) -> None:
        if root in self._roots:
            self._roots.remove(root)
            self._routes = {}
            self.routes_version += 1

    def _resolve(self, event_type: type) -> tuple[abc.ObserverBase[Any], ...]:
        observers = tuple(r.observer for r in self._roots if issubclass(event_type, r.types))
        routes = dict(self._routes)  # copy-on-write: a dispatch in progress keeps its view
        routes[event_type] = observers
        self._routes = routes
        return observers

    class _TierContext:
        def __init__(self, bus: EventBus, tier: Tier) -> None:
            self.bus, self.tier, self.previous = bus, tier, bus._tier

        def __enter__(self) -> None:
            self.previous, self.bus._tier = self.bus._tier, self.tier

        def __exit__(self, *exc: object) -> None:
            self.bus._tier = self.previous

    def tier(self, tier: Tier) -> EventBus._TierContext:
        """Subscriptions made inside ``with bus.tier("core"):`` are delivered in that tier.

        Every event reaches core subscribers first, then user ones, then global ones.
        """
        if tier not in _TIER_ORDER:
            raise ConfigError.invalid("tier", tier, f"one of {tuple(_TIER_ORDER)}")
        return EventBus._TierContext(self, tier)

    def __repr__(self) -> str:
        return f"<EventBus {self._state} queued={len(self._queue)}>"


class _AsyncFeeder(abc.ObserverBase[Any]):
    """Observer end of an async subscription: hands items to its buffer."""

    __slots__ = ("_sub",)

    def __init__(self, sub: AsyncSubscription) -> None:
        self._sub = sub

    def on_next(self, value: Any) -> None:
        self._sub.push(value)

    def on_error(self, error: Exception) -> None:
        self._sub.bus._subscriber_failed(self._sub, error, None, ended=True)
        self._sub.close_input()

    def on_completed(self) -> None:
        self._sub.close_input()

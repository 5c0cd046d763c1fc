"""The event bus: :class:`EventBus`, the users' face over parts that each own their state, and
:class:`LoopPort` (``bus.port()``), the training loop's (ARCHITECTURE.md, "Module map")."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Iterable
from contextlib import AbstractContextManager
from types import TracebackType
from typing import Any, Literal, Self, TypeVar, overload

from reactivex import Observable, Observer, abc
from reactivex.disposable import Disposable

from .. import commands as cmd
from .. import events as ev
from .._exceptions import ConfigError
from .._validate import (
    check_int,
    check_optional_seconds,
    explains_unknown_keywords,
    unknown_keyword_message,
)
from .commands import (
    At,
    CommandChannel,
    CommandError,
    CommandSink,
    DecisionStamp,
    DecisionSteps,
    Doorbell,
    Every,
    StepClock,
)
from .dispatch import (
    DEFAULT_BARRIERS,
    Barrier,
    PublishQueue,
    RouteTable,
    Tier,
    check_barriers,
)
from .lifecycle import DEFAULT_CLOSE_TIMEOUT, Lifecycle
from .scheduler import AnyioScheduler
from .subscriptions import (
    AsyncSubscription,
    BusObservable,
    BusStatistics,
    Overflow,
    RankFilter,
    Ranks,
    Subscription,
    SubscriptionSet,
    env_rank,
)
from .watchdog import (
    DEFAULT_WATCHDOG_S,
    ERROR_POLICIES,
    ErrorPolicy,
    FailureLedger,
    Watchdog,
    check_policy,
)

__all__ = ["CommandError", "EventBus", "LoopPort", "Tier"]

# Names of the earlier spelling -> what replaced each (an option, or a bus attribute).
_RENAMED_OPTIONS = {"scheduler": "rx_scheduler"}
_RENAMED_ATTRIBUTES = {
    "scheduler": "bus.rx_scheduler",
    "decides": "bus.declare_decision_steps(every=..., at=...)",
    "running": 'bus.state == "running"',
    "failure": "bus.port().failure (the loop's face)",
}


def _unknown_option(name: str, value: object, options: list[str]) -> str:
    new = _RENAMED_OPTIONS.get(name)
    hint = f"{name} is {new} now: EventBus({new}={value!r})" if new else None
    return unknown_keyword_message("EventBus", name, options, hint)


class LoopPort:
    """The loop's end of one bus (``bus.port()``): each name is the owning part's own method
    or state, bound once (each documented there). ``doorbell`` rings after every change the
    loop must act on: re-read the rest only when ``doorbell.rings`` grew.
    """

    def __init__(
        self,
        doorbell: Doorbell,
        queue: PublishQueue,
        routes: RouteTable,
        clock: StepClock,
        channel: CommandChannel,
        ledger: FailureLedger,
        barrier: Barrier,
        lifecycle: Lifecycle,
        subs: SubscriptionSet,
    ) -> None:
        self.publish = queue.publish
        self.wants = routes.wants
        self.demand = routes.demand
        self.doorbell = doorbell
        self.next_decision = clock.next_decision
        self.statistics = lifecycle.statistics
        self.has_commands = channel.has_commands
        self.poll_commands = channel.poll_commands
        self.withdraw = channel.withdraw
        self.resume_polls, self.end_polls = channel.resume_polls, channel.end_polls
        self.wait_for_room = subs.backpressure.wait_for_room
        self.wait_barrier = barrier.wait_barrier
        self.barrier_requested = barrier.requested
        self.request_cancel_pending = lifecycle.request_cancel_pending
        self._clock = clock
        self._ledger = ledger
        self._pressure = subs.backpressure

    @property
    def decision_steps(self) -> tuple[DecisionSteps, ...]:
        """Every declaration of decision steps."""
        return self._clock.decision_steps

    @property
    def failure(self) -> Exception | None:
        """The first failure of an ``on_error="raise"`` subscription."""
        return self._ledger.fatal

    @property
    def held(self) -> bool:
        """True while an ``overflow="block"`` buffer is over capacity."""
        return self._pressure.active


_E = TypeVar("_E", bound=ev.BaseEvent)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


class EventBus:
    """The reactive bus between the training loop and its subscribers.

    Args:
        flush_interval: Seconds between two dispatches of the queue (the bound on delivery lag).
        max_queue: Undelivered events past which ``publish`` makes its thread wait for the
            dispatcher (bounds memory when a subscriber stalls the event loop).
        close_timeout: Seconds closing (and a trainer call's end) waits for async subscribers
            before cancelling them, counted as lost work. None: no limit.
        on_error: Default error policy of subscriptions made without one.
        rx_scheduler: The Rx scheduler of every subscription's time-based operators. Default:
            an :class:`~trainbus.bus.AnyioScheduler` on the bus' loop.
        rank: This process' rank under torchrun (default: ``RANK``, else 0). Subscriptions run
            on rank 0 unless made with ``ranks=`` (docs/distributed.md).
        watchdog_s: Seconds a sync subscriber's call may block the event-loop thread before a
            warning names it (docs/reliability.md). None: no watchdog thread.
        barriers: Event types at which a training loop waits for their deciders (docs/bus.md,
            "Barriers").
        barrier_timeout: Seconds a training loop waits at one barrier (inf: no deadline).
        on_lost: What lost work does to a trainer's run: ``"warn"`` logs it; ``"raise"`` also
            raises :class:`~trainbus.LostWorkError` from ``fit()``.

    Raises:
        ConfigError: for an argument out of range.

    See docs/bus.md.
    """

    publish: Callable[[ev.BaseEvent], None]
    """Queue an event for delivery (:meth:`PublishQueue.publish`); safe from any thread."""
    wants: Callable[[type[ev.BaseEvent]], bool]
    """True when some subscription would receive events of the given type."""

    def __getattr__(self, name: str) -> Any:
        """An attribute of an earlier version: an ``AttributeError`` naming what replaced it."""
        new = _RENAMED_ATTRIBUTES.get(name)
        if new is None:
            raise AttributeError(f"'EventBus' object has no attribute {name!r}")
        raise AttributeError(f"bus.{name} is {new} now")

    @explains_unknown_keywords(_unknown_option)
    def __init__(
        self,
        *,
        flush_interval: float = 0.02,
        max_queue: int = 65_536,
        close_timeout: float | None = DEFAULT_CLOSE_TIMEOUT,
        on_error: ErrorPolicy = "log",
        rx_scheduler: abc.SchedulerBase | None = None,
        rank: int | None = None,
        watchdog_s: float | None = DEFAULT_WATCHDOG_S,
        barriers: Iterable[type[ev.BaseEvent]] = DEFAULT_BARRIERS,
        barrier_timeout: float = 60.0,
        on_lost: Literal["warn", "raise"] = "warn",
    ) -> None:
        if not (_is_number(flush_interval) and 0 < flush_interval <= 10):
            raise ConfigError.invalid("flush_interval", flush_interval, "seconds in (0, 10]")
        check_int("max_queue", max_queue, 1)
        if close_timeout is not None and not (
            _is_number(close_timeout) and 0 <= close_timeout < math.inf
        ):
            allowed = "None (wait for pending async work) or seconds >= 0"
            raise ConfigError.invalid("close_timeout", close_timeout, allowed)
        check_policy(on_error)
        if rx_scheduler is not None and not isinstance(rx_scheduler, abc.SchedulerBase):
            raise ConfigError.invalid("rx_scheduler", rx_scheduler, "a reactivex scheduler or None")
        self.flush_interval = float(flush_interval)
        self.max_queue = max_queue
        self.close_timeout = None if close_timeout is None else float(close_timeout)
        self.watchdog_s = check_optional_seconds("watchdog_s", watchdog_s)
        self.barriers: frozenset[type[ev.BaseEvent]] = check_barriers(barriers)
        if not (_is_number(barrier_timeout) and barrier_timeout > 0):  # inf: no deadline
            raise ConfigError.invalid("barrier_timeout", barrier_timeout, "seconds > 0")
        self.barrier_timeout = float(barrier_timeout)
        if on_lost not in ("warn", "raise"):
            allowed = "'warn' (log lost work and go on) or 'raise' (also raise LostWorkError)"
            if on_lost in ERROR_POLICIES:
                allowed += f"; {on_lost!r} is an error policy: it goes in on_error="
            raise ConfigError.invalid("on_lost", on_lost, allowed)
        self.on_lost: Literal["warn", "raise"] = on_lost
        ranks = RankFilter(env_rank() if rank is None else check_int("rank", rank, 0))
        bell = Doorbell()
        self._clock = clock = StepClock(bell)
        stamp = DecisionStamp()
        self._channel = channel = CommandChannel(stamp, bell)
        ledger = FailureLedger(on_error, channel.send, bell)
        own: AnyioScheduler | None = None
        if rx_scheduler is None:
            rx_scheduler = own = AnyioScheduler(ledger.count)
        self.rx_scheduler: abc.SchedulerBase = rx_scheduler
        self._routes = routes = RouteTable(bell)
        watchdog = Watchdog(self.watchdog_s)
        subs = SubscriptionSet(ledger, bell, stamp, watchdog, ranks, clock, rx_scheduler)
        self._subs = subs
        self._queue = queue = PublishQueue(max_queue, self.flush_interval, routes, ledger, stamp)
        self._barrier = barrier = Barrier(queue, subs, channel)
        self._lifecycle = lifecycle = Lifecycle(
            queue, routes, subs, channel, ledger, own, self.close_timeout, watchdog
        )
        self.publish = queue.publish
        self.wants = routes.wants
        self._port = LoopPort(bell, queue, routes, clock, channel, ledger, barrier, lifecycle, subs)

        self.commands: CommandSink = CommandSink(channel.send)
        """The back-channel as an Rx observer: ``pipeline.subscribe(bus.commands)``."""
        routes.register((ev.CommandApplied,), Observer(channel.acknowledge), "internal")

    def port(self) -> LoopPort:
        """The loop's face of this bus (:class:`~trainbus._bus.LoopPort`), for loop
        implementers; the same object for the bus' lifetime."""
        return self._port

    @property
    def rank(self) -> int:
        """This process' rank (0 on a single process)."""
        return self._subs.ranks.rank

    def on_ranks(self, ranks: Ranks) -> AbstractContextManager[None]:
        """Subscriptions made inside ``with bus.on_ranks("all"):`` without ``ranks=`` run on
        those ranks.

        Raises:
            ConfigError: ``ranks`` is not None, ``"all"``, a rank or an iterable of ranks.
        """
        return self._subs.ranks.default(ranks)

    @property
    def state(self) -> str:
        """``"new"``, ``"running"``, ``"suspended"`` (between two trainer calls), ``"closing"``
        or ``"closed"``."""
        return self._lifecycle.state

    @property
    def subscriptions(self) -> tuple[Subscription, ...]:
        """Every subscription made through this bus, in order (inactive ones included)."""
        return self._subs.all()

    def statistics(self) -> BusStatistics:
        """A frozen snapshot: published, delivered, dropped, failed, queue depth, and per
        subscription counters."""
        return self._lifecycle.statistics()

    @property
    def events(self) -> BusObservable[ev.BaseEvent]:
        """Every event, as a hot Observable whose subscribers run on the event-loop thread."""
        # Made at each call: a kept stream would be a reference cycle with its bus.
        return self._make_stream((ev.BaseEvent,))

    @overload
    def stream(
        self,
        event_type: type[_E],
        /,
        *,
        every_s: float | None = None,
        every_steps: int | None = None,
    ) -> BusObservable[_E]: ...
    @overload
    def stream(
        self,
        *event_types: type[ev.BaseEvent],
        every_s: float | None = None,
        every_steps: int | None = None,
    ) -> BusObservable[ev.BaseEvent]: ...
    def stream(
        self,
        *event_types: type[ev.BaseEvent],
        every_s: float | None = None,
        every_steps: int | None = None,
    ) -> BusObservable[Any]:
        """Events of the given types (subclasses included), as a typed hot Observable.

        Args:
            event_types: The event classes to receive.
            every_s: Sample by time: at most one event per ``every_s`` seconds (docs/bus.md).
            every_steps: Sample by step: only the events whose ``step`` is a multiple of it.

        Raises:
            ConfigError: no type given, one that is not a trainbus event class, a bad
                ``every_s`` or ``every_steps``, or both.
        """
        every_s = check_optional_seconds("every_s", every_s)
        if check_int("every_steps", every_steps, 1, optional=True) and every_s is not None:
            allowed = "None when every_s is given (one sampling, not two)"
            raise ConfigError.invalid("every_steps", every_steps, allowed)
        if not event_types:
            raise ConfigError.invalid("event_types", (), "at least one event class")
        for t in event_types:
            if not (isinstance(t, type) and issubclass(t, ev.BaseEvent)):
                raise ConfigError.invalid(
                    "event_types", t, "event classes from trainbus.events (e.g. ev.StepEnded)"
                )
        return self._make_stream(tuple(event_types), every_s, every_steps)

    def _make_stream(
        self,
        types: tuple[type, ...],
        every_s: float | None = None,
        every_steps: int | None = None,
    ) -> BusObservable[Any]:
        routes = self._routes

        def subscribe(observer: abc.ObserverBase[Any], _: Any = None) -> abc.DisposableBase:
            root = routes.register(types, observer, every_s=every_s, every_steps=every_steps)
            return Disposable(lambda: routes.unregister(root))

        # Decision steps only count on streams that can carry the per-step events.
        per_step = any(issubclass(e, types) for e in (ev.StepEnded, ev.MetricsLogged))
        return BusObservable(self._subs, Observable(subscribe), per_step=per_step)

    def subscribe(
        self,
        observable: Observable[Any],
        on_next: Callable[[Any], Any] | abc.ObserverBase[Any],
        *,
        on_error: ErrorPolicy | None = None,
        name: str | None = None,
        ranks: Ranks = None,
        on_completed: Callable[[], Any] | None = None,
    ) -> Subscription:
        """Subscribe a sync observer (function or Rx observer) under the bus' guard.

        Args:
            observable: A bus stream, possibly piped or merged (docs/bus.md, "Streams").
            on_next: A function of one item, or an Rx observer (``bus.commands`` included).
            on_error: The error policy: what a failure of ``on_next`` does (``"log"``,
                ``"stop"``, ``"raise"``; default: the bus').
            name: Name in logs and statistics (default: the function's qualified name).
            ranks: Where it runs under torchrun (default rank 0; ``"all"``, a rank or ranks).
            on_completed: Called when the stream completes (the bus closes).

        Returns:
            The subscription handle (dispose it to stop; ``statistics()`` for counters).

        Raises:
            ConfigError: ``on_next`` is not callable or is ``async def`` (use
                :meth:`subscribe_async`), or an unknown ``on_error`` policy.
        """
        source = self._wrap(observable)
        return self._subs.subscribe(source, on_next, None, on_completed, on_error, name, ranks)

    def _wrap(self, observable: Observable[Any]) -> BusObservable[Any]:
        if isinstance(observable, BusObservable):
            return observable
        if not isinstance(observable, Observable):
            raise ConfigError.invalid(
                "observable",
                getattr(observable, "__qualname__", observable),
                "a stream (bus.stream(T), bus.events, piped or merged), given first: "
                "bus.subscribe(stream, fn) / bus.subscribe_async(stream, fn)",
            )
        return BusObservable(self._subs, observable)

    def subscribe_async(
        self,
        observable: Observable[Any],
        fn: Callable[[Any], Awaitable[Any]],
        *,
        concurrency: int = 1,
        buffer: int | None = None,
        overflow: Overflow | None = None,
        on_error: ErrorPolicy | None = None,
        name: str | None = None,
        decides: bool = False,
        ranks: Ranks = None,
    ) -> AsyncSubscription:
        """Run ``async def fn(item)`` for each item, in the bus' task group.

        Args:
            observable: A bus stream, possibly piped through operators.
            fn: An async function of one item (docs/bus.md, "Async subscribers").
            concurrency: Worker tasks awaiting ``fn`` at once (order kept only with 1).
            buffer: Items that may wait; default 64 (``"latest"``: 1, and only 1 is allowed).
            overflow: What a full buffer does: ``"drop_oldest"``, ``"latest"`` or ``"block"``
                (docs/bus.md); default ``"block"`` for a decider, else ``"drop_oldest"``.
            on_error: Error policy for exceptions from ``fn`` (default: the bus').
            name: Name in logs and statistics (default: the function's qualified name).
            decides: True when ``fn``'s commands must land on the step they were decided for:
                barriers that deliver it an item wait for it (docs/bus.md).
            ranks: Where it runs under torchrun (default rank 0; ``"all"``, a rank or ranks).

        Returns:
            The subscription handle (dispose it to stop; ``statistics()`` for counters).

        Raises:
            ConfigError: for an ``fn`` that is not an async function, a non-bool ``decides`` or
                an argument out of range.
            BusClosedError: the bus is closed.
        """
        return self._subs.subscribe_async(
            self._wrap(observable),
            fn,
            concurrency=concurrency,
            buffer=buffer,
            overflow=overflow,
            on_error=on_error,
            name=name,
            decides=decides,
            ranks=ranks,
        )

    def declare_decision_steps(
        self, *, every: int | None = None, at: int | Iterable[int] | None = None
    ) -> abc.DisposableBase:
        """Declare that a pipeline the bus cannot see into (a ``reactivex.merge``) decides at
        these steps (docs/events.md, "When a command takes effect").

        Args:
            every: Decide at every multiple of this step count.
            at: Decide at this step, or at each of these steps.

        Returns:
            A disposable: ``.dispose()`` removes the declaration.

        Raises:
            ConfigError: neither given, or a value out of range.
        """
        steps_: list[DecisionSteps] = []
        if every is not None:
            steps_.append(Every(check_int("every", every, 1)))
        if at is not None:
            steps = list(at) if isinstance(at, Iterable) else [at]
            steps_.extend(At(check_int("at", k, 0)) for k in steps)
        if not steps_:
            raise ConfigError.invalid("every", None, "a step count >= 1, or at=step(s)")
        return self._clock.declare(*steps_)

    def tier(self, tier: Tier) -> AbstractContextManager[None]:
        """Subscriptions made inside ``with bus.tier("core"):`` are delivered in that tier
        (core first, then user, then global).

        Raises:
            ConfigError: ``tier`` is not one of internal, core, user, global.
        """
        return self._routes.tier(tier)

    def flush(self) -> None:
        """Deliver every queued event now, on the calling thread.

        Raises:
            BusClosedError: called from another thread while the bus runs.
        """
        self._queue.flush()

    async def wait_delivered(
        self, timeout: float | None = None, event: ev.BaseEvent | None = None
    ) -> bool:
        """Deliver everything queued, then wait for the async subscriptions that received
        something from ``event`` (or from anything) to finish it.

        Args:
            timeout: Seconds to wait for the async subscribers (None: no limit).
            event: An already published event.

        Returns:
            True when everything finished, False when the timeout expired first.
        """
        return await self._barrier.wait_delivered(timeout, event)

    def cancel_pending(self) -> dict[str, int]:
        """Cancel every async subscriber's pending work now, and what they receive later,
        counted as lost work. Event-loop thread only.

        Returns:
            Items pending per subscription when cancelled (only those that had any).
        """
        return self._lifecycle.cancel_pending()

    def send(self, command: cmd.Command) -> None:
        """Put ``command`` on the back-channel. Safe from any thread; never blocks. Between
        calls it is dropped and logged, not carried into the next call (docs/bus.md).

        Raises:
            ConfigError: ``command`` is not a trainbus command.
            BusClosedError: the bus has closed (after the run): no loop would apply it.
        """
        self._channel.send(command)

    async def request(self, command: cmd.Command) -> ev.BaseEvent:
        """Send ``command`` and wait until the loop applies it.

        Returns:
            The event the command produced (``CheckpointSaved`` for ``SaveCheckpoint``,
            ``EvaluationEnded`` for ``Evaluate``), else its ``CommandApplied``.

        Raises:
            ConfigError: ``command`` is not a trainbus command.
            CommandError: the loop could not apply it (the cause is attached).
            BusClosedError: the bus closed, or the call ended, before the command was
                applied; no call is running.
        """
        return await self._channel.request(command)

    async def __aenter__(self) -> Self:
        await self._lifecycle.open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        await self._lifecycle.end(close=True, raise_fatal=exc_type is None)
        return None

    async def suspend(self, *, raise_fatal: bool = True) -> None:
        """Stop running until the next ``async with bus`` (or trainer call), streams open.

        Args:
            raise_fatal: Raise a ``"raise"`` subscription's failure (False while another
                exception propagates); either way it is cleared for the next run.

        Raises:
            Exception: ``raise_fatal`` and a subscription with ``on_error="raise"`` failed:
                the subscriber's own exception.
        """
        await self._lifecycle.end(close=False, raise_fatal=raise_fatal)

    def __repr__(self) -> str:
        return f"<EventBus {self._lifecycle.state} queued={len(self._queue)}>"

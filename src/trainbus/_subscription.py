"""Subscription records: the guarded observer every bus subscription ends in, async workers.

Every subscription made through the bus gets a :class:`Subscription` record that counts what it
received, dropped and failed, and that is also the ``Disposable`` the subscribe call returns.
Counters are plain ints touched only on the event-loop thread, so they need no lock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

import anyio
from anyio.abc import TaskGroup
from reactivex import abc

if TYPE_CHECKING:
    from ._bus import EventBus

__all__ = [
    "AsyncSubscription",
    "BusStatistics",
    "ErrorPolicy",
    "Overflow",
    "Subscription",
    "SubscriptionStatistics",
]

ErrorPolicy: TypeAlias = Literal["log", "stop", "raise"]
"""What a subscriber's exception does: log it and go on; also send ``StopTraining``; fail the
run (``SubscriberError`` from ``fit()`` / from closing the bus)."""
Overflow: TypeAlias = Literal["block", "drop_oldest", "latest"]
"""What an async subscription does when its buffer is full: make the bus wait (nothing is ever
dropped); drop the oldest waiting item; keep only the newest waiting item."""
ERROR_POLICIES: tuple[str, ...] = ("log", "stop", "raise")
OVERFLOWS: tuple[str, ...] = ("block", "drop_oldest", "latest")


@dataclass(frozen=True, slots=True, kw_only=True)
class SubscriptionStatistics:
    """A snapshot of one subscription's counters."""

    name: str
    kind: Literal["sync", "async"]
    active: bool
    received: int
    """Items that reached the subscription (after its operators)."""
    delivered: int
    """Items handed to the subscriber's function."""
    completed: int
    """Calls of the function that returned or raised (async: finished awaits)."""
    failed: int
    dropped: int
    """Items discarded by the overflow policy (async only)."""
    queued: int
    """Items waiting in the buffer (async only)."""
    in_flight: int
    cancelled: int
    """Items waiting or running when the bus closed past its timeout, then cancelled."""
    last_error: str | None


@dataclass(frozen=True, slots=True, kw_only=True)
class BusStatistics:
    """A snapshot of the whole bus."""

    published: int
    """Events accepted by ``publish`` (delivered plus still queued)."""
    delivered: int
    """Events taken off the queue and dispatched to every matching subscription."""
    queue_depth: int
    dropped: int
    failed: int
    cancelled: int
    publisher_waits: int
    """Times a publishing thread waited because the queue was full (``max_queue``)."""
    subscriptions: tuple[SubscriptionStatistics, ...]


class Subscription(abc.DisposableBase):
    """Handle of a bus subscription: dispose it to unsubscribe; read its ``statistics()``."""

    kind: Literal["sync", "async"] = "sync"

    def __init__(self, bus: EventBus, name: str, on_error: ErrorPolicy) -> None:
        self.bus = bus
        self.name = name
        self.on_error = on_error
        self.active = True
        self.received = 0
        self.completed = 0
        self.failed = 0
        self.dropped = 0
        self.cancelled = 0
        self.last_error: str | None = None
        self.stop_sent = False
        self.upstream: abc.DisposableBase | None = None

    @property
    def delivered(self) -> int:
        return self.received - self.dropped

    def dispose(self) -> None:
        """Unsubscribe. Idempotent."""
        self.active = False
        if self.upstream is not None:
            self.upstream.dispose()

    def statistics(self) -> SubscriptionStatistics:
        """A frozen snapshot of this subscription's counters."""
        return SubscriptionStatistics(
            name=self.name,
            kind=self.kind,
            active=self.active,
            received=self.received,
            delivered=self.delivered,
            completed=self.completed,
            failed=self.failed,
            dropped=self.dropped,
            queued=self.queued,
            in_flight=self.in_flight,
            cancelled=self.cancelled,
            last_error=self.last_error,
        )

    @property
    def queued(self) -> int:
        return 0

    @property
    def in_flight(self) -> int:
        return 0

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} active={self.active}>"


class GuardedObserver(abc.ObserverBase[Any]):
    """The observer at the end of every bus subscription: counts, and isolates failures.

    RxPY re-raises an observer's exception into the ``on_next`` that called it, which would
    reach the publisher's dispatch; here it is reported to the bus instead, under the
    subscription's policy, and the subscription keeps receiving. ``on_error`` means an operator
    upstream failed and Rx has ended the chain: it is reported the same way unless the user gave
    an ``on_error`` callback.
    """

    __slots__ = ("_on_completed", "_on_error", "_on_next", "_sub")

    def __init__(
        self,
        sub: Subscription,
        on_next: Callable[[Any], Any] | None,
        on_error: Callable[[Exception], Any] | None,
        on_completed: Callable[[], Any] | None,
    ) -> None:
        self._sub = sub
        self._on_next = on_next
        self._on_error = on_error
        self._on_completed = on_completed

    def on_next(self, value: Any) -> None:
        sub = self._sub
        sub.received += 1
        if self._on_next is None:
            sub.completed += 1
            return
        try:
            self._on_next(value)
        except Exception as exc:
            sub.bus._subscriber_failed(sub, exc, value)
        sub.completed += 1

    def on_error(self, error: Exception) -> None:
        sub = self._sub
        sub.active = False
        if self._on_error is None:
            sub.bus._subscriber_failed(sub, error, None, ended=True)
            return
        sub.failed += 1
        sub.last_error = repr(error)
        # Counted on the bus too: its ``failed`` is the total over subscriptions, even when the
        # user's on_error callback handles the error (it still ended the chain).
        sub.bus._failed += 1
        try:
            self._on_error(error)
        except Exception as exc:
            sub.bus._subscriber_failed(sub, exc, None, ended=True)

    def on_completed(self) -> None:
        sub = self._sub
        sub.active = False
        if self._on_completed is not None:
            try:
                self._on_completed()
            except Exception as exc:
                sub.bus._subscriber_failed(sub, exc, None, ended=True)


class AsyncSubscription(Subscription):
    """An ``async def fn(item)`` fed from a bounded buffer by ``concurrency`` worker tasks.

    The observer side (``push``) runs on the event-loop thread inside the bus' dispatch and never
    awaits. With ``overflow="block"`` a full buffer takes one item over capacity and raises the
    bus' pressure flag; the dispatcher then awaits :meth:`wait_for_room` before it dispatches the
    next event, so nothing is dropped and memory stays bounded (the publishing thread in turn
    waits when the bus queue reaches ``max_queue``).
    """

    kind = "async"

    def __init__(
        self,
        bus: EventBus,
        name: str,
        fn: Callable[[Any], Awaitable[Any]],
        *,
        concurrency: int,
        buffer: int,
        overflow: Overflow,
        on_error: ErrorPolicy,
    ) -> None:
        super().__init__(bus, name, on_error)
        self.fn = fn
        self.concurrency = concurrency
        self.capacity = buffer
        self.overflow = overflow
        self.buffer: deque[Any] = deque()
        self.started = 0
        self.running = 0
        self.input_closed = False
        self.scope: anyio.CancelScope | None = None
        self._ready: anyio.Event | None = None
        self._room: anyio.Event | None = None
        self._progress: anyio.Event | None = None
        self._finished: anyio.Event | None = None

    # ------------------------------------------------------------------ counters
    @property
    def delivered(self) -> int:
        return self.started

    @property
    def queued(self) -> int:
        return len(self.buffer)

    @property
    def in_flight(self) -> int:
        return self.running

    @property
    def settled(self) -> int:
        """Items that need no more work: dropped, finished or cancelled."""
        return self.dropped + self.completed + self.cancelled

    @property
    def finished(self) -> bool:
        return self._finished is not None and self._finished.is_set()

    @property
    def over_capacity(self) -> bool:
        return len(self.buffer) > self.capacity

    # ------------------------------------------------------------------ observer side
    def push(self, item: Any) -> None:
        """Accept one item from the observable (loop thread, never awaits)."""
        self.received += 1
        if self.finished:
            # Cancelled at close (past close_timeout) while the drain went on: no worker will
            # run this item, so it is counted, not buffered where nobody would ever look.
            self.cancelled += 1
            return
        buf = self.buffer
        if len(buf) >= self.capacity and self.overflow != "block":
            buf.popleft()
            self.dropped += 1
        buf.append(item)
        if len(buf) > self.capacity:
            self.bus._pressure = True
        if self._ready is not None:
            self._ready.set()

    def close_input(self) -> None:
        """No more items will come: workers finish the buffer and exit."""
        self.input_closed = True
        if self._ready is not None:
            self._ready.set()

    def dispose(self) -> None:
        super().dispose()
        self.close_input()

    # ------------------------------------------------------------------ worker side
    def start(self, tg: TaskGroup) -> None:
        """Start the workers in the bus' task group (called once the bus runs)."""
        self._ready = anyio.Event()
        self._finished = anyio.Event()
        self.scope = anyio.CancelScope()
        tg.start_soon(self._run, name=f"trainbus-subscriber:{self.name}")

    async def _run(self) -> None:
        assert self.scope is not None and self._finished is not None
        try:
            with self.scope:
                async with anyio.create_task_group() as tg:
                    for _ in range(self.concurrency):
                        tg.start_soon(self._worker)
        finally:
            # Whatever is left was cancelled by the close timeout.
            self.cancelled += len(self.buffer) + self.running
            self.buffer.clear()
            self.running = 0
            self.active = False
            self._notify(self._room)
            self._notify(self._progress)
            self._finished.set()

    async def _worker(self) -> None:
        buf = self.buffer
        while True:
            while not buf:
                if self.input_closed:
                    return
                assert self._ready is not None
                if self._ready.is_set():
                    self._ready = anyio.Event()
                await self._ready.wait()
            item = buf.popleft()
            if len(buf) <= self.capacity:
                self._notify(self._room)
            self.started += 1
            self.running += 1
            try:
                await self.fn(item)
            except Exception as exc:
                self.bus._subscriber_failed(self, exc, item)
            # Not in a ``finally``: an item whose await is cancelled (close timeout) did not
            # complete; it stays counted in ``running``, which _run adds to ``cancelled``.
            self.running -= 1
            self.completed += 1
            self._notify(self._progress)

    @staticmethod
    def _notify(event: anyio.Event | None) -> None:
        if event is not None:
            event.set()

    async def wait_for_room(self) -> None:
        """Wait until the buffer is back within capacity (``overflow="block"``)."""
        while self.over_capacity and not self.finished:
            if self._room is None or self._room.is_set():
                self._room = anyio.Event()
            await self._room.wait()

    async def wait_settled(self, target: int) -> None:
        """Wait until ``target`` items have been dropped, finished or cancelled."""
        while self.settled < target and not self.finished:
            # Waiters share one event, so a second waiter never strands the first.
            if self._progress is None or self._progress.is_set():
                self._progress = anyio.Event()
            await self._progress.wait()

    async def wait_finished(self) -> None:
        """Wait until every worker has exited."""
        if self._finished is not None:
            await self._finished.wait()

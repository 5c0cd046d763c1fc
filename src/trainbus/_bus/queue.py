"""The publish queue: a cheap hand-off on the publishing thread, one dispatch slice on the loop.

How an event travels::

    training thread                      event-loop thread (anyio task group of the bus)
    publish(e): queue.append(e) ──────►  poller: every flush_interval, if the queue is non-empty,
                (nothing else)           take the n queued events and dispatch them in ONE slice:
                                         for each event, for each matching root observer (core,
                                         then user, then global tier), call on_next. No await
                                         between events, ever: a full "block" async buffer
                                         takes the item and pushes back on the training loop
                                         (pressure.py), not on dispatch.

Why batching: every wake-up of the loop thread costs a tiny-model training thread 55-240 µs of
wall time (the two threads hand the GIL over), about a whole 100 µs step. A poller that wakes at
most once per interval costs that once per ~20 ms instead of once per event (DESIGN.md).

Idle poller: after a few intervals with nothing published the poller parks (no more timed
wake-ups, so a run with no subscriber, or only subscribers of rare events, pays no GIL hand-over
for it) and the next ``publish`` wakes it once: a flag read on the hot path, and a non-blocking
call into the event loop only on the first event after a quiet spell. The flag is raised before
the poller's last look at the queue, so an event appended in between is never stranded; a
backstop timeout bounds the park anyway.

Where events are freed: not on the loop thread. A dispatched event goes to :class:`Spent`, and
the next ``publish`` frees it on the publishing thread, because freeing a tensor releases the GIL
(see ``spent.py``).

Back-pressure: past ``max_queue`` undelivered events the publishing thread waits (a
``threading.Event`` the dispatcher sets after each drain), so a dispatcher that cannot keep up
(a slow sync subscriber holds the event-loop thread) bounds memory instead of losing events.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable

import anyio
import anyio.lowlevel

from .. import events as ev
from .._exceptions import BusClosedError, ConfigError
from .clock import DecisionStamp
from .failures import FailureLedger
from .routes import RouteTable
from .spent import Spent

__all__ = ["PublishQueue"]


class _ClosedQueue(deque[ev.BaseEvent]):
    """The queue of a closed bus: appending raises ``BusClosedError``."""

    def append(self, event: ev.BaseEvent) -> None:
        raise BusClosedError(
            f"publish({type(event).__name__}) after the bus closed: nothing would deliver it"
        )


class PublishQueue:
    """The event queue between publishers and the loop thread, and its dispatch.

    Args:
        max_queue: Undelivered events past which ``publish`` waits for the dispatcher.
        flush_interval: Seconds a waiting publisher sleeps between checks for room.
        routes: Where each event type goes.
        ledger: Counts an observer that raised past RxPY into the dispatch.
        stamp: Told the step of each event dispatched (what ``bus.send`` stamps on commands).
        spent: Where dispatched events wait to be freed by the next publish (``spent.py``).

    Derived events: an event a subscriber publishes on the loop thread while the slice
    dispatches (``MemoryMonitor`` answering ``StepEnded``) is delivered right after the event
    being dispatched, before the next queued one, so causality holds and an already queued
    ``FitEnded`` stays the last event delivered.
    """

    def __init__(
        self,
        *,
        max_queue: int,
        flush_interval: float,
        routes: RouteTable,
        ledger: FailureLedger,
        stamp: DecisionStamp | None = None,
        spent: Spent | None = None,
    ) -> None:
        # The hand-off. deque.append/popleft are atomic under the GIL: no lock on the hot path.
        self._events: deque[ev.BaseEvent] = deque()
        self._max_queue = max_queue
        self._flush_interval = flush_interval
        self._routes = routes
        self._ledger = ledger
        self._room = threading.Event()  # set by the dispatcher after each drain
        self._running = False
        self._loop_thread: int | None = None
        self._delivered = 0
        self._publisher_waits = 0
        self._stamp = stamp or DecisionStamp()
        # True while a slice dispatches; publish reads it (one attribute) and only then asks
        # which thread it runs on. Events from the loop thread meanwhile go to _derived.
        self._dispatching = False
        self._dispatch_thread: int | None = None
        self._derived: deque[ev.BaseEvent] = deque()
        # Dispatched events, freed by the next publish (spent.py). Only while the bus runs: a
        # flush on the publishing thread itself has nobody to hand them to.
        self._spent = Spent() if spent is None else spent
        # The parked poller (see wait_published): publish reads ``parked`` once per event.
        self.parked = False
        self._unpark_event: anyio.Event | None = None
        self._call_soon: Callable[[Callable[[], None]], None] | None = None

    # ================================================================== publishing side
    def publish(self, event: ev.BaseEvent) -> None:
        """Queue ``event`` for delivery. Safe from any thread; never waits for subscribers.

        Cost on the calling thread: a type check and a deque append. It waits only when
        ``max_queue`` events are already waiting (the dispatcher cannot keep up).

        Raises:
            ConfigError: ``event`` is not a trainbus event.
            BusClosedError: the bus has closed.
        """
        if not isinstance(event, ev.BaseEvent):
            raise ConfigError.invalid("event", event, "an instance of a trainbus event class")
        if self._dispatching and threading.get_ident() == self._dispatch_thread:
            self._derived.append(event)  # published by a subscriber: delivered right after
            return
        q = self._events
        q.append(event)
        if self._spent:  # free here what the loop thread is done with (spent.py)
            self._spent.clear()
        if self.parked:  # the first event after a quiet spell: wake the poller, once
            self._wake_poller()
        if len(q) > self._max_queue:
            self._wait_for_room()

    def _wake_poller(self) -> None:
        self.parked = False
        call_soon = self._call_soon
        if call_soon is not None:
            try:
                call_soon(self._unpark)
            except RuntimeError:  # the loop has closed (trio: RunFinishedError, a RuntimeError)
                pass

    def _unpark(self) -> None:
        event = self._unpark_event
        if event is not None:
            event.set()

    def _wait_for_room(self) -> None:
        if not self._running or threading.get_ident() == self._loop_thread:
            return  # never block the loop itself, nor a bus that is not dispatching
        self._publisher_waits += 1
        while len(self._events) > self._max_queue and self._running:
            self._room.clear()
            self._room.wait(self._flush_interval)

    # ================================================================== counters
    def __len__(self) -> int:
        return len(self._events)

    def __bool__(self) -> bool:
        return bool(self._events)

    def index(self, event: ev.BaseEvent) -> int | None:
        """Position of ``event`` (by identity) in the queue, or None."""
        return next((i for i, e in enumerate(self._events) if e is event), None)

    def first_is(self, event: ev.BaseEvent) -> bool:
        """True when ``event`` (by identity) is next to be dispatched."""
        q = self._events
        return bool(q) and q[0] is event

    @property
    def delivered(self) -> int:
        """Events taken off the queue and dispatched."""
        return self._delivered

    @property
    def publisher_waits(self) -> int:
        """Times a publishing thread waited for room."""
        return self._publisher_waits

    @property
    def loop_thread(self) -> int | None:
        """The thread that dispatches while the bus runs (None otherwise)."""
        return self._loop_thread

    # ================================================================== lifecycle
    def open(self, loop_thread: int) -> None:
        """The bus runs, dispatching on ``loop_thread``: publishers may wait for room."""
        self._running = True
        self._loop_thread = loop_thread
        self._call_soon = _threadsafe_call_soon()

    def suspend(self) -> None:
        """The bus stopped dispatching until it opens again: ``publish`` keeps queueing (as
        before the first open), publishers no longer wait for room."""
        self._running = False
        self._loop_thread = None
        self._call_soon = None
        self.parked = False
        self._room.set()

    def begin_close(self) -> None:
        """The bus is closing: publishers no longer wait."""
        self._running = False
        self._room.set()

    def close(self) -> None:
        """The bus closed: from now on ``publish`` raises. Its append lands on a queue that
        refuses it, which costs the hot path nothing (no state check per publish)."""
        self._running = False
        self._events = _ClosedQueue(self._events)
        self._spent.clear()
        self._room.set()
        self._loop_thread = None

    # ================================================================== dispatch side
    def dispatch(self, n: int) -> int:
        """Deliver up to ``n`` queued events. Loop thread.

        One slice: no await between events. Events published by subscribers during the slice
        (on this thread) are delivered right after the event that caused them, and do not count
        against ``n``. Returns how many queued events were delivered.
        """
        popleft = self._events.popleft
        table = self._routes
        derived = self._derived
        stamp = self._stamp
        keep = self._spent.append if self._running else None
        done = 0
        # Re-entrant (a subscriber calling flush()): the outer slice keeps its flag.
        outer = self._dispatching
        if not outer:
            # The loop thread while the bus runs; the caller of flush() before it does.
            self._dispatch_thread = stamp.loop_thread = threading.get_ident()
        self._dispatching = True
        try:
            while done < n:
                event = popleft()
                done += 1
                stamp.step = event.step
                stamp.event_id = id(event)
                # table.cache is re-read per event: a subscriber may subscribe during the slice.
                observers = table.cache.get(type(event))
                if observers is None:
                    observers = table.resolve(type(event))
                for observer in observers:
                    try:
                        observer.on_next(event)
                    except Exception as exc:  # an operator that raised past RxPY: isolated
                        self._ledger.chain_failed(observer, exc, event)
                if keep is not None:  # freed by the next publish, not here (spent.py)
                    keep(event)
                if derived:  # one truthiness test per event when nobody derives events
                    self._deliver_derived()
        finally:
            self._dispatching = outer
            if not outer:
                stamp.step = None
        self._delivered += done
        return done

    def _deliver(self, event: ev.BaseEvent) -> None:
        """Deliver one event to its observers (what the slice inlines per event)."""
        table = self._routes
        # table.cache is re-read per event: a subscriber may subscribe during the slice.
        observers = table.cache.get(type(event))
        if observers is None:
            observers = table.resolve(type(event))
        for observer in observers:
            try:
                observer.on_next(event)
            except Exception as exc:  # an operator that raised past RxPY: still isolated
                self._ledger.chain_failed(observer, exc, event)

    def _deliver_derived(self) -> None:
        """Deliver the events subscribers published during the last delivery, oldest first
        (what they in turn publish joins the end: still after its cause)."""
        derived, stamp = self._derived, self._stamp
        while derived:
            event = derived.popleft()
            stamp.step = event.step
            stamp.event_id = id(event)
            self._deliver(event)
            self._delivered += 1
            if self._running:
                self._spent.append(event)

    async def drain(self, limit: int | None = None) -> None:
        """Deliver queued events (all of them, or ``limit``), never waiting for a subscriber.

        No await inside: a drain is one slice, atomic with respect to other tasks (async so
        callers keep one shape whether they wait afterwards or not)."""
        q = self._events
        remaining = len(q) if limit is None else limit
        while q and remaining > 0:
            remaining -= self.dispatch(min(remaining, len(q)))
            if limit is None:
                remaining = len(q)
        self._room.set()

    async def wait_published(self, backstop: float) -> None:
        """Park until something is published, or ``backstop`` seconds. Loop thread, poller only.

        ``parked`` is raised before the queue is looked at: a publisher that appends after the
        look sees the flag and wakes this wait; one that appended before it is seen here.
        """
        if self._call_soon is None:  # no way to be woken: keep the plain interval
            await anyio.sleep(self._flush_interval)
            return
        event = self._unpark_event = anyio.Event()
        self.parked = True
        try:
            if not self._events:
                with anyio.move_on_after(backstop):
                    await event.wait()
        finally:
            self.parked = False
            self._unpark_event = None

    def flush(self) -> None:
        """Deliver every queued event now, on the calling thread (the loop thread if running).

        Like every dispatch, it never waits for a subscriber: a full ``"block"`` buffer takes
        every item beyond its capacity (the training loop waits for it at its next poll point).
        Use ``await wait_delivered()`` to deliver and wait for async subscribers.

        Raises:
            BusClosedError: called from another thread while the bus runs.
        """
        if self._loop_thread is not None and threading.get_ident() != self._loop_thread:
            raise BusClosedError(
                "flush() runs on the bus' event-loop thread; from another thread (a hook on "
                "the training thread included) use anyio.from_thread.run(bus.wait_delivered, "
                "token=token), the token taken on that loop by anyio.lowlevel.current_token()"
            )
        q = self._events
        while q:
            self.dispatch(len(q))
        self._room.set()


def _threadsafe_call_soon() -> Callable[[Callable[[], None]], None] | None:
    """A non-blocking way to run a callable on the running event loop from any thread.

    ``anyio.from_thread.run_sync`` waits for the result (~19 µs and a GIL round trip); a
    publisher only needs to post a wake-up. None when the backend offers neither way (the
    poller then never parks).
    """
    native = anyio.lowlevel.current_token().native_token
    if isinstance(native, asyncio.AbstractEventLoop):
        loop = native

        def call_soon(fn: Callable[[], None]) -> None:
            loop.call_soon_threadsafe(fn)

        return call_soon
    run_sync_soon = getattr(native, "run_sync_soon", None)  # trio's TrioToken
    return run_sync_soon if callable(run_sync_soon) else None

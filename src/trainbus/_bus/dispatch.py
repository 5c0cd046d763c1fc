"""Dispatch: the route table of *roots* (the top of each chain: the types it takes and its
observer, by tier), the publish queue (a deque append on the training thread, dispatched in one
slice per ``flush_interval`` on the event-loop thread), and the barriers (docs/bus.md).
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal, get_args

import anyio
import anyio.lowlevel
from reactivex import abc

from .. import events as ev
from .._exceptions import BusClosedError, ConfigError
from .._log import get_logger
from .commands import CommandChannel, DecisionStamp, Doorbell
from .scheduler import TaskSet
from .subscriptions import AsyncSubscription, Subscription, SubscriptionSet
from .watchdog import FailureLedger

__all__ = [
    "DEFAULT_BARRIERS",
    "Barrier",
    "PublishQueue",
    "RouteTable",
    "Tier",
    "check_barriers",
]

log = get_logger(__name__)

_IDLE_TICKS = 3
"""Empty flush intervals after which the poller parks until the next publish."""
_PARK_BACKSTOP = 1.0
"""Seconds a parked poller waits at most (a safety net: a publish wakes it at once)."""


# ================================================================== the route table
Tier = Literal["internal", "core", "user", "global"]
TIER_ORDER = {tier: i for i, tier in enumerate(get_args(Tier))}


@dataclass(slots=True, eq=False)
class Root:
    """One root: the types it takes and the observer to feed (or its :class:`Sampled` gate)."""

    types: tuple[type, ...]
    observer: abc.ObserverBase[Any]
    tier: int


class Demand:
    """What the subscriptions of one event type take: every event (``each``), a sample
    (``sampled``: ask :meth:`takes`), or nothing. Written by the :class:`RouteTable` on the
    event-loop thread, read by the publisher."""

    __slots__ = ("_at", "_every_s", "_periods", "_timed", "each", "sampled")

    def __init__(self) -> None:
        self.each = False
        self.sampled = False
        self._at = math.inf
        self._every_s = math.inf
        self._periods: tuple[int, ...] = ()
        self._timed = False  # the last yes was a time gate's: built() moves its due time

    def takes(self, step: int, now: float) -> bool:
        """True when some subscription takes the event of ``step`` stamped ``now``; a yes to
        a time gate moves its due time on at once (no other is built meanwhile)."""
        if self.each:
            return True
        if now >= self._at:
            self._at = now + self._every_s
            self._timed = True
            return True
        for n in self._periods:
            if step % n == 0:
                return True
        return False

    def built(self, at: float) -> None:
        """The event :meth:`takes` said yes to is stamped ``at`` (a time gate's next is due
        from there)."""
        if self._timed:
            self._timed = False
            self._at = at + self._every_s

    def update(self, each: bool, gates: list[Sampled], *, passed: bool = False) -> None:
        """Set from the type's roots (``passed``: a gate passed one; the due time only moves
        on)."""
        exact = min((g.next_at for g in gates), default=math.inf)
        self._at = max(exact, self._at) if passed else exact
        self._every_s = min((g.every_s for g in gates if g.every_s is not None), default=math.inf)
        self._periods = tuple(sorted({g.every_steps for g in gates if g.every_steps}))
        self.sampled = not each and bool(gates)
        self.each = each


class Sampled(abc.ObserverBase[Any]):
    """The gate of a sampled root (``bus.stream(every_s=, every_steps=)``); tells ``passed``
    of a pass, and of the first refusal since."""

    __slots__ = ("_observer", "_passed", "_told", "every_s", "every_steps", "next_at")

    def __init__(
        self,
        observer: abc.ObserverBase[Any],
        every_s: float | None,
        every_steps: int | None,
        passed: Callable[[bool], None],
    ) -> None:
        self._observer = observer
        self._passed = passed
        self._told = False  # the table was told of a refusal since the last pass
        self.every_s = every_s
        self.every_steps = every_steps
        self.next_at = -math.inf if every_s is not None else math.inf

    def on_next(self, value: Any) -> None:
        if self.every_steps is not None:
            if value.step % self.every_steps == 0:
                self._observer.on_next(value)
            return
        assert self.every_s is not None
        t = value.time
        if t < self.next_at:
            if not self._told:
                self._told = True
                self._passed(False)
            return
        self.next_at = t + self.every_s
        self._told = False
        self._passed(True)
        self._observer.on_next(value)

    def on_error(self, error: Exception) -> None:
        self._observer.on_error(error)

    def on_completed(self) -> None:
        self._observer.on_completed()


class RouteTable:
    """Roots by tier, the per-type route cache, and the demand of each type asked about."""

    def __init__(self, doorbell: Doorbell) -> None:
        self._doorbell = doorbell
        self._roots: list[Root] = []
        # Event type -> observers, in delivery order; replaced on change (copy-on-write).
        self._cache: dict[type, tuple[abc.ObserverBase[Any], ...]] = {}
        self._tier: Tier = "user"  # of the roots registered now
        self._demands: dict[type, Demand] = {}  # for the types a publisher asked about

    def wants(self, event_type: type) -> bool:
        """True when some root would receive events of ``event_type``."""
        return bool(self.routes(event_type))

    def demand(self, event_type: type) -> Demand:
        """The :class:`Demand` of ``event_type`` (the same object for the table's lifetime)."""
        demand = self._demands.get(event_type)
        if demand is None:
            demand = self._demands[event_type] = Demand()
            self._update_demands()
        return demand

    def _update_demands(self, passed: bool = False) -> None:
        for event_type, demand in self._demands.items():
            roots = self.routes(event_type)
            gates = [o for o in roots if isinstance(o, Sampled)]
            demand.update(len(gates) < len(roots), gates, passed=passed)

    def routes(self, event_type: type) -> tuple[abc.ObserverBase[Any], ...]:
        """The observers ``event_type`` goes to, in delivery order (cached)."""
        observers = self._cache.get(event_type)
        if observers is None:
            observers = tuple(r.observer for r in self._roots if issubclass(event_type, r.types))
            # Copy-on-write: a dispatch in progress keeps its view.
            self._cache = {**self._cache, event_type: observers}
        return observers

    def register(
        self,
        types: tuple[type, ...],
        observer: abc.ObserverBase[Any],
        tier: Tier | None = None,
        *,
        every_s: float | None = None,
        every_steps: int | None = None,
    ) -> Root:
        """Add a root in ``tier`` (default: the current one), sampled by every_s or every_steps."""
        if every_s is not None or every_steps is not None:
            observer = Sampled(observer, every_s, every_steps, self._update_demands)
        root = Root(types, observer, TIER_ORDER[tier or self._tier])
        self._roots.append(root)
        self._roots.sort(key=lambda r: r.tier)  # stable: in order of subscription within a tier
        self._changed()
        return root

    def unregister(self, root: Root) -> None:
        """Remove ``root`` (idempotent)."""
        if root in self._roots:
            self._roots.remove(root)
            self._changed()

    def _changed(self) -> None:
        self._cache = {}
        self._update_demands()
        self._doorbell.ring()  # after the change: the loop that hears it re-reads its demand

    def observers(self) -> list[abc.ObserverBase[Any]]:
        """Every root observer, in delivery order (a copy: closing completes them)."""
        return [r.observer for r in self._roots]

    def tier(self, tier: Tier) -> AbstractContextManager[None]:
        """:meth:`EventBus.tier`."""
        if tier not in TIER_ORDER:
            raise ConfigError.invalid("tier", tier, f"one of {tuple(TIER_ORDER)}")
        return self._in_tier(tier)

    @contextmanager
    def _in_tier(self, tier: Tier) -> Iterator[None]:
        previous, self._tier = self._tier, tier
        try:
            yield
        finally:
            self._tier = previous


# ================================================================== the publish queue
class _ClosedQueue(deque[ev.BaseEvent]):
    """The queue of a closed bus: appending raises ``BusClosedError``."""

    def append(self, event: ev.BaseEvent) -> None:
        raise BusClosedError(
            f"publish({type(event).__name__}) after the bus closed: nothing would deliver it"
        )


class PublishQueue:
    """The event queue between publishers and the loop thread, and its dispatch."""

    def __init__(
        self,
        max_queue: int,
        flush_interval: float,
        routes: RouteTable,
        ledger: FailureLedger,
        stamp: DecisionStamp,
    ) -> None:
        # The hand-off. deque.append/popleft are atomic under the GIL: no lock on the hot path.
        self._events: deque[ev.BaseEvent] = deque()
        self._max_queue = max_queue
        self.flush_interval = flush_interval
        self._routes = routes
        self._ledger = ledger
        self._room = threading.Event()  # set by the dispatcher after each drain
        self._loop_thread: int | None = None  # while the bus runs (dispatches)
        self.delivered = 0
        self.publisher_waits = 0
        self._stamp = stamp
        # True while a slice dispatches: what its thread publishes meanwhile goes to _derived.
        self._dispatching = False
        self._derived: deque[ev.BaseEvent] = deque()
        # The parked poller (see run): publish reads ``parked`` once per event.
        self.parked = False
        self._wake: Callable[[], object] = lambda: None

    def publish(self, event: ev.BaseEvent) -> None:
        """Queue ``event`` for delivery (any thread); waits while ``max_queue`` events wait.

        Raises:
            ConfigError: ``event`` is not a trainbus event.
            BusClosedError: the bus has closed.
        """
        if not isinstance(event, ev.BaseEvent):
            raise ConfigError.invalid("event", event, "an instance of a trainbus event class")
        if self._dispatching and threading.get_ident() == self._stamp.loop_thread:
            self._derived.append(event)  # published by a subscriber: delivered right after
            return
        q = self._events
        q.append(event)
        if self.parked:  # the first event after a quiet spell: wake the poller, once
            self.parked = False
            with contextlib.suppress(RuntimeError):  # anyio's RunFinishedError
                self._wake()
        if len(q) > self._max_queue:
            self._wait_for_room()

    def _wait_for_room(self) -> None:
        if self._loop_thread in (None, threading.get_ident()):
            return  # never block the loop itself, nor a bus that is not dispatching
        self.publisher_waits += 1
        while len(self._events) > self._max_queue and self._loop_thread is not None:
            self._room.clear()
            self._room.wait(self.flush_interval)

    def __len__(self) -> int:
        return len(self._events)

    def index(self, event: ev.BaseEvent) -> int | None:
        return next((i for i, e in enumerate(self._events) if e is event), None)

    def open(self, loop_thread: int) -> None:
        """The bus runs, dispatching on ``loop_thread``: publishers may wait for room."""
        self._loop_thread = loop_thread

    def stop(self, *, close: bool = False) -> None:
        """Stop dispatching until :meth:`open`; with ``close``, for good (``publish`` raises:
        an append that refuses, no check per publish)."""
        self._loop_thread = None
        if close:
            self._events = _ClosedQueue(self._events)
        self._room.set()

    def drain(self, limit: int | None = None) -> None:
        """Deliver the queued events (or the first ``limit``) in one slice on this thread;
        what subscribers publish meanwhile is delivered right after its cause."""
        q = self._events
        if limit is not None:
            self._dispatch(min(limit, len(q)))
        while limit is None and q:
            self._dispatch(len(q))
        self._room.set()

    def _dispatch(self, n: int) -> None:
        popleft, derived, stamp = self._events.popleft, self._derived, self._stamp
        # Re-entrant (a subscriber calling flush()): the outer slice keeps its flag.
        outer = self._dispatching
        if not outer:
            stamp.loop_thread = threading.get_ident()
        self._dispatching = True
        try:
            for _ in range(n):
                self._deliver(popleft())
                while derived:  # what those publish in turn joins the end: after its cause
                    self._deliver(derived.popleft())
        finally:
            self._dispatching = outer
            if not outer:
                stamp.step = None

    def _deliver(self, event: ev.BaseEvent) -> None:
        self._stamp.step = event.step
        self._stamp.event_id = id(event)
        # Re-read per event: a subscriber may subscribe during the slice.
        for observer in self._routes.routes(type(event)):
            try:
                observer.on_next(event)
            except Exception as exc:  # an operator that raised past RxPY: isolated
                self._ledger.operator_failed(observer, exc, event)
        self.delivered += 1

    async def run(self) -> None:
        """The poller: drain once per ``flush_interval``; after ``_IDLE_TICKS`` empty ones, park
        until a publish wakes it (each wake costs the training thread a GIL hand-over)."""
        token = anyio.lowlevel.current_token()
        empty = 0
        while True:
            if empty < _IDLE_TICKS:
                await anyio.sleep(self.flush_interval)
            else:
                unparked = anyio.Event()
                run_soon = token.backend_class.run_sync_soon
                self._wake = partial(run_soon, unparked.set, (), token.native_token)
                self.parked = True  # before the queue is looked at: a later append sees it
                try:
                    with anyio.move_on_after(_PARK_BACKSTOP):
                        if not self._events:
                            await unparked.wait()
                finally:
                    self.parked = False
            if self._events:
                empty = 0
                self.drain(limit=len(self._events))
            else:
                empty += 1

    def flush(self) -> None:
        """:meth:`EventBus.flush`."""
        if self._loop_thread is not None and threading.get_ident() != self._loop_thread:
            raise BusClosedError(
                "flush() runs on the bus' event-loop thread; from another thread (a hook on "
                "the training thread included) use anyio.from_thread.run(bus.wait_delivered, "
                "token=token), the token taken on that loop by anyio.lowlevel.current_token()"
            )
        self.drain()


# ================================================================== barriers
BarrierStatus = Literal["done", "timeout", "request"]

DEFAULT_BARRIERS: tuple[type[ev.BaseEvent], ...] = (ev.EvaluationEnded, ev.EpochEnded)
"""The events the loop waits at unless ``EventBus(barriers=...)`` says otherwise."""
BARRIER_TYPES: tuple[type[ev.BaseEvent], ...] = (
    ev.StepEnded,
    ev.MetricsLogged,
    ev.EvaluationEnded,
    ev.EpochEnded,
)
"""Events followed by a poll point: the only ones a barrier can make decisions exact on."""


def check_barriers(value: object) -> frozenset[type[ev.BaseEvent]]:
    """``EventBus(barriers=)``: an iterable of classes of :data:`BARRIER_TYPES`."""
    if not isinstance(value, Iterable) or isinstance(value, str):
        raise ConfigError.invalid("barriers", value, "an iterable of event classes")
    found = tuple(value)
    for b in found:
        if b not in BARRIER_TYPES:
            raise ConfigError.invalid(
                "barriers",
                b,
                "event classes followed by a poll point: "
                + ", ".join(t.__name__ for t in BARRIER_TYPES),
            )
    return frozenset(found)


_ANNOUNCE_AFTER = 0.5
"""Seconds barriers waited on a subscription (one wait, or all of them) after which a warning
names it."""
_REASON = (
    "it was made with decides=True and received this barrier's event: training waits until "
    "it has finished what it received, so that its commands apply before the next step"
)
_SYNC_FLOOR = 0.001
"""Seconds a sync subscription's calls ran in one barrier wait from which they are charged to
it (below: the delivery every barrier makes, not a backlog)."""
_SYNC_REASON = (
    "a sync subscriber runs on the event-loop thread, and a barrier delivers every queued event "
    "before training goes on: training waited for this subscriber's backlog"
)
_SYNC_REMEDIES = (
    "make it async def (await the slow call, or anyio.to_thread.run_sync), or sample at the "
    "stream: bus.stream(T, every_steps=n) / bus.stream(T, every_s=x); EventBus(barriers=...) "
    "names the events the loop waits at"
)
_REMEDIES = (
    "decides=False (the default) when its commands need not land on this step (an async "
    "subscriber that only posts, uploads or logs never holds training); a faster fn; "
    "EventBus(barrier_timeout=...) bounds each wait; EventBus(barriers=...) names the events "
    "the loop waits at"
)


class Barrier:
    """``wait_delivered`` and the loop's barrier, which a ``request()`` on ``channel``
    interrupts."""

    def __init__(
        self, queue: PublishQueue, subscriptions: SubscriptionSet, channel: CommandChannel
    ) -> None:
        self._queue = queue
        self._subscriptions = subscriptions
        self._channel = channel
        # A wait interrupted by a request: its targets and deadline, resumed by the next call.
        self._pending: tuple[list[tuple[AsyncSubscription, int]], float] | None = None
        self._waited: dict[int, float] = {}  # seconds barriers waited per subscription
        self._busy_mark: dict[int, float] | None = None  # sync run times when a wait began

    def requested(self) -> None:
        """The training thread is about to wait at a barrier (its thread): from now on, what
        the sync subscribers run holds it, and is charged to them."""
        self._busy_mark = self._busy_now()

    def _busy_now(self) -> dict[int, float]:
        return {id(s): s.busy_s for s in self._subscriptions.all() if s.kind == "sync"}

    def _charge_sync(self) -> None:
        """Charge each sync subscription that ran ``_SYNC_FLOOR`` or more since the mark its
        run time (the barrier waited for it); name one that held training long enough."""
        mark, now = self._busy_mark or {}, self._busy_now()
        for sub in self._subscriptions.all():
            ran = now.get(id(sub), 0.0) - mark.get(id(sub), 0.0)
            if ran >= _SYNC_FLOOR:
                self._charge(sub, ran, _SYNC_REASON, _SYNC_REMEDIES)
        self._busy_mark = now  # a resumed wait charges from here

    async def wait_delivered(
        self, timeout: float | None = None, event: ev.BaseEvent | None = None
    ) -> bool:
        """:meth:`EventBus.wait_delivered` (``event`` is found by identity in the queue)."""
        deadline = anyio.current_time() + (math.inf if timeout is None else timeout)
        targets = self._deliver(event)
        return await self._wait_targets(targets, deadline, timeout, barrier=False) == "done"

    def _deliver(self, event: ev.BaseEvent | None) -> list[tuple[AsyncSubscription, int]]:
        """Deliver everything queued: the async subscriptions that received ``event`` (None:
        anything delivered now), with how many items they had received then."""
        asyncs = self._subscriptions.asyncs()
        q = self._queue
        if event is not None:
            # What was published before the barrier event is delivered but not waited for.
            before_event = q.index(event)
            if before_event is None:
                # The poller already dispatched it: each subscription noted which event fed
                # its last item (the loop publishes nothing while it waits here).
                q.drain()
                fed = [(s, s.received_from(id(event))) for s in asyncs]
                return [(s, n) for s, n in fed if n is not None]
            if before_event:
                q.drain(limit=before_event)
        before = {id(s): s.received for s in asyncs}
        first = event is not None and q.index(event) == 0
        q.drain(limit=1 if first else None)
        targets = [(s, s.received) for s in asyncs if s.received > before[id(s)]]
        q.drain()
        return targets

    async def _wait_targets(
        self,
        targets: list[tuple[AsyncSubscription, int]],
        deadline: float,
        timeout: float | None,
        *,
        barrier: bool,
    ) -> BarrierStatus:
        """Wait until every target has settled its items, the deadline passes or, at the
        loop's ``barrier`` (which charges and names the slow ones), a ``request()`` arrives."""
        status: BarrierStatus = "done"
        start = anyio.current_time()
        # Only those not settled yet are waited for (and charged).
        waiting = [(sub, n) for sub, n in targets if sub.settled < n and not sub.finished]
        unsettled = {id(sub) for sub, _ in waiting}
        wake = self._channel.arm_wake()
        # A race, each task ending by its own scope (TaskSet): the first outcome wins.
        async with anyio.create_task_group() as tg:
            tasks = TaskSet(tg)

            def finish(outcome: BarrierStatus) -> None:
                nonlocal status
                if not tasks.stopped:
                    status = outcome
                    tasks.stop()

            async def settle_one(sub: AsyncSubscription, target: int) -> None:
                await sub.wait_settled(target)
                unsettled.discard(id(sub))
                if barrier:
                    self._charge(sub, anyio.current_time() - start)
                if not unsettled:
                    finish("done")

            async def interrupted() -> None:
                await wake.wait()
                finish("request")

            async def timer() -> None:
                await anyio.sleep_until(deadline)
                finish("timeout")

            async def announce() -> None:
                # Said while training waits, not after.
                await anyio.sleep(_ANNOUNCE_AFTER)
                for sub, _ in waiting:
                    if id(sub) in unsettled:
                        sub.announce_wait(_REASON, _REMEDIES)

            if waiting:
                for sub, target in waiting:
                    tasks.start_soon(settle_one, sub, target)
                if barrier:
                    tasks.start_soon(interrupted)
                    tasks.start_soon(announce)
                if deadline < math.inf:
                    tasks.start_soon(timer)
        self._channel.disarm_wake()
        if barrier:
            elapsed = anyio.current_time() - start
            for sub, _ in waiting:
                if id(sub) in unsettled:  # timed out or interrupted: charged up to now
                    self._charge(sub, elapsed)
        if status == "timeout":
            log.warning("barrier_timeout", timeout=timeout, waiting=[s.name for s, _ in targets])
        return status

    def _charge(
        self, sub: Subscription, seconds: float, reason: str = _REASON, remedies: str = _REMEDIES
    ) -> None:
        """Add ``seconds`` to what ``sub`` held training; many short waits add up to a warning."""
        sub.waited_s += seconds  # what the user reads (back-pressure's waits included)
        self._waited[id(sub)] = self._waited.get(id(sub), 0.0) + seconds
        if self._waited[id(sub)] >= _ANNOUNCE_AFTER:
            sub.announce_wait(reason, remedies)

    async def wait_barrier(
        self, timeout: float, event: ev.BaseEvent | None, resume: bool
    ) -> BarrierStatus:
        """Deliver, then wait for the deciders that received ``event`` (None: anything
        delivered now): ``"done"``, ``"timeout"`` or ``"request"`` (the loop applies it, then
        resumes the same wait with ``resume=True``)."""
        if self._busy_mark is None:  # a wait the training thread did not announce
            self._busy_mark = self._busy_now()
        if resume and self._pending is not None:
            targets, deadline = self._pending
            self._queue.drain()  # delivers the CommandApplied the requester is waiting for
        else:
            deadline = anyio.current_time() + timeout
            targets = [(s, n) for s, n in self._deliver(event) if s.decides]
        self._pending = None
        if self._channel.request_waiting():
            status: BarrierStatus = "request"
        else:
            status = await self._wait_targets(targets, deadline, timeout, barrier=True)
        self._charge_sync()
        if status == "request":
            self._pending = (targets, deadline)
        else:
            self._busy_mark = None
        return status

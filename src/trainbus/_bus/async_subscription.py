"""Async subscriptions: an ``async def fn(item)`` fed from a bounded buffer by worker tasks.

The observer side (:class:`AsyncFeeder`, then :meth:`AsyncSubscription.push`) runs on the
event-loop thread inside the bus' dispatch slice and never awaits; the workers run in the bus'
task group. What the buffer does when full is the subscription's :data:`Overflow` policy; no
policy ever makes the dispatcher wait (a ``"block"`` buffer pushes back on the training thread
through :class:`~trainbus._bus.pressure.Backpressure`). Others wait on it: the barrier with
:meth:`~AsyncSubscription.wait_settled`, the bus' close with
:meth:`~AsyncSubscription.wait_finished`.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, Literal, TypeAlias

import anyio
from reactivex import abc

from .._log import get_logger
from .clock import DecisionStamp
from .failures import ErrorPolicy, FailureLedger
from .pressure import Backpressure
from .spent import Spent
from .subscriptions import Subscription
from .tasks import TaskSet

__all__ = ["DEFAULT_OVERFLOW", "OVERFLOWS", "AsyncFeeder", "AsyncSubscription", "Overflow"]

log = get_logger(__name__)

DROP_REMEDIES = (
    "a larger buffer=, a higher concurrency=, overflow='block' (training then waits for it, "
    "said and counted), or sample at the stream: bus.stream(T, every_steps=n) / "
    "bus.stream(T, every_s=x)"
)

Overflow: TypeAlias = Literal["block", "drop_oldest", "latest"]
"""What an async subscription does when its buffer is full: ``"block"`` takes the item and
makes the training thread wait at its next poll point until there is room (nothing is ever
dropped; training goes at the subscriber's pace); ``"drop_oldest"`` drops the oldest waiting
item; ``"latest"`` keeps only the newest waiting item. Drops are counted as lost work."""
OVERFLOWS: tuple[str, ...] = ("block", "drop_oldest", "latest")
DEFAULT_OVERFLOW: Overflow = "drop_oldest"
"""The default: a slow subscriber never holds training back; what it cannot keep up with is
dropped oldest first, counted, and reported as lost work (``FitResult.lost_work``)."""


class AsyncSubscription(Subscription):
    """An ``async def fn(item)`` fed from a bounded buffer by ``concurrency`` worker tasks.

    The observer side (``push``) runs on the event-loop thread inside the bus' dispatch and never
    awaits. With ``overflow="block"`` a full buffer takes the item over capacity and signals
    ``backpressure``: the dispatcher goes on delivering to everyone (this buffer included), and
    the training loop waits at its next poll point until the buffer is back within capacity,
    so nothing is dropped and memory stays bounded by the buffer plus one step's (or one
    evaluation round's) events.
    """

    kind = "async"

    def __init__(
        self,
        ledger: FailureLedger,
        name: str,
        fn: Callable[[Any], Awaitable[Any]],
        *,
        concurrency: int,
        buffer: int,
        overflow: Overflow,
        on_error: ErrorPolicy | None,
        backpressure: Backpressure,
        decides: bool = False,
        spent: Spent | None = None,
        stamp: DecisionStamp | None = None,
    ) -> None:
        super().__init__(ledger, name, on_error)
        self.fn = fn
        # Items done with (run or dropped) are freed by the next publish, not here (spent.py).
        # Without a bus' deque (a bare subscription): one that keeps nothing, freed at once.
        self._spent = Spent(maxlen=0) if spent is None else spent
        self.decides = decides
        """Whether its commands must land on the step they were decided for: the step clock
        declares its schedules, and every barrier that delivers it an item waits for it; no
        other async subscription is ever waited for (see ``EventBus.subscribe_async``)."""
        self.concurrency = concurrency
        self.capacity = buffer
        self.overflow = overflow
        self.buffer: deque[Any] = deque()
        self.started = 0
        self.running = 0
        self.input_closed = False
        self._backpressure = backpressure
        self._workers: TaskSet | None = None
        self._cancelling = False  # cancel() came: the workers stop (when they start)
        self._ready: anyio.Event | None = None
        self._first_at: float | None = None  # monotonic time of the first item (for rates())
        # Which dispatched event pushed the last item, and the count after it (received_from).
        self._stamp = stamp or DecisionStamp()
        self._source = 0
        self._source_count = 0
        self._progress: anyio.Event | None = None
        self._finished: anyio.Event | None = None
        self._suspending = False

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

    @property
    def pending(self) -> int:
        """Items waiting or running: the work a close waits for."""
        return len(self.buffer) + self.running

    def received_from(self, event_id: int) -> int | None:
        """When the last item this subscription received came from the dispatched event with
        ``id() == event_id``: how many items it had received then; else None."""
        return self._source_count if self._source == event_id else None

    def rates(self) -> tuple[float, float]:
        """(items finished per second, items received per second) since its first item."""
        if self._first_at is None:
            return 0.0, 0.0
        span = max(time.monotonic() - self._first_at, 1e-9)
        return self.completed / span, self.received / span

    # ------------------------------------------------------------------ observer side
    def push(self, item: Any) -> None:
        """Accept one item from the observable (loop thread, never awaits)."""
        self.received += 1
        self._source = self._stamp.event_id
        self._source_count = self.received
        if self._first_at is None:
            self._first_at = time.monotonic()
        if self.finished:
            # Cancelled at close (past close_timeout) while the drain went on: no worker will
            # run this item, so it is counted, not buffered where nobody would ever look.
            self.cancelled += 1
            return
        buf = self.buffer
        if len(buf) >= self.capacity and self.overflow != "block":
            self._spent.append(buf.popleft())
            self.dropped += 1
            if self.dropped == 1 and self.overflow == "drop_oldest":
                self._announce_drops()
        buf.append(item)
        if len(buf) > self.capacity:
            self._backpressure.signal(self)
        if self._ready is not None:
            self._ready.set()

    def _announce_drops(self) -> None:
        """Say, at its first drop, that this subscription has begun dropping (once: the end
        of the run reports how many). ``"latest"`` drops by design and is not announced."""
        done_rate, in_rate = self.rates()
        log.warning(
            "subscriber_dropping",
            subscription=self.name,
            buffer=self.capacity,
            rate_per_s=round(done_rate, 3),
            events_per_s=round(in_rate, 3),
            action="its oldest waiting items are dropped from now on, counted as lost work "
            "(FitResult.lost_work, bus_closed_with_lost_work at the end)",
            remedies=DROP_REMEDIES,
        )

    def close_input(self) -> None:
        """No more items will come: workers finish the buffer and exit."""
        self.input_closed = True
        if self._ready is not None:
            self._ready.set()

    def dispose(self) -> None:
        super().dispose()
        self.close_input()

    # ------------------------------------------------------------------ worker side
    def start(self, tasks: TaskSet) -> None:
        """Start the workers among the bus' tasks (called once the bus runs)."""
        self._ready = anyio.Event()
        self._finished = anyio.Event()
        self._cancelling = False
        self._suspending = False
        self._workers = None
        tasks.start_soon(self._run, name=f"trainbus-subscriber:{self.name}")

    def suspend(self) -> None:
        """The bus suspends (its task group stops): the workers end, the subscription stays
        active and starts again when the bus opens again. Anything still buffered or in
        flight then (past the close timeout) counts as cancelled."""
        self._suspending = True
        self.cancel()

    def cancel(self) -> None:
        """Cancel the workers (close timeout, ``cancel_pending``); what they held and whatever
        arrives later is counted as cancelled."""
        # Each worker ends by its own scope (tasks.py); _run then ends as they have.
        self._cancelling = True
        if self._workers is not None:
            self._workers.stop()

    async def _run(self) -> None:
        assert self._finished is not None
        try:
            async with anyio.create_task_group() as tg:
                workers = self._workers = TaskSet(tg)
                if self._cancelling:
                    workers.stop()
                for _ in range(self.concurrency):
                    workers.start_soon(self._worker)
        finally:
            # Whatever is left was cancelled by the close timeout.
            self.cancelled += len(self.buffer) + self.running
            self.buffer.clear()
            self.running = 0
            if not self._suspending:
                self.active = False
            self._backpressure.relieve(self)
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
                self._backpressure.relieve(self)
            self.started += 1
            self.running += 1
            # A command sent while running the item is stamped with the item's step.
            step = getattr(item, "step", None)
            token = DecisionStamp.item(step if type(step) is int else None)
            try:
                await self.fn(item)
            except Exception as exc:
                self.fail(exc, item)
            finally:
                DecisionStamp.done(token)
            # Not in a ``finally``: an item whose await is cancelled (close timeout) did not
            # complete; it stays counted in ``running``, which _run adds to ``cancelled``.
            self.running -= 1
            self.completed += 1
            self._spent.append(item)
            del item  # the spent deque holds the last reference: freed by the next publish
            self._notify(self._progress)

    @staticmethod
    def _notify(event: anyio.Event | None) -> None:
        if event is not None:
            event.set()

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


class AsyncFeeder(abc.ObserverBase[Any]):
    """Observer end of an async subscription: hands items to its buffer."""

    __slots__ = ("_sub",)

    def __init__(self, sub: AsyncSubscription) -> None:
        self._sub = sub

    def on_next(self, value: Any) -> None:
        self._sub.push(value)

    def on_error(self, error: Exception) -> None:
        self._sub.fail(error, None, ended=True)
        self._sub.close_input()

    def on_completed(self) -> None:
        self._sub.close_input()

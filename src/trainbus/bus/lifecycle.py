"""Opening and closing the bus, its poller, and its statistics.

Opening starts the bus' task group: the scheduler's timer task (when the bus made its own
scheduler), the async subscribers' workers and the poller that drains the queue every
``flush_interval``. Closing delivers every event published before the close, completes every
stream (so buffering operators emit what they hold), waits for async subscribers within
``close_timeout``, cancels what is left and reports it.

Between the two a bus may *suspend*: a trainer call that found the bus not running opened it
for itself, and at its end the bus delivers what the call published, fires the timers that
are pending (so a ``buffer_with_time`` window emits its partial batch), waits for the async
subscribers to finish what they hold (within ``close_timeout``), and stops its task group; the
streams stay open, and the next call opens the bus again with the same subscribers.
"""

from __future__ import annotations

import threading
from typing import Literal

import anyio
from anyio.abc import TaskGroup

from .._exceptions import BusClosedError
from .._log import get_logger
from .channel import CommandChannel
from .failures import FailureLedger
from .queue import PublishQueue
from .registry import SubscriptionSet
from .routes import RouteTable
from .scheduler import AnyioScheduler
from .statistics import BusStatistics

__all__ = ["Lifecycle", "State"]

log = get_logger(__name__)

State = Literal["new", "running", "suspended", "closing", "closed"]

_IDLE_TICKS = 3
"""Empty flush intervals after which the poller parks until the next publish."""
_PARK_BACKSTOP = 1.0
"""Seconds a parked poller waits at most (a safety net: a publish wakes it at once)."""


class Lifecycle:
    """The bus' state (new, running, suspended, closing, closed) and its task group.

    Args:
        queue, routes, subscriptions, channel, ledger: The bus' parts.
        own_scheduler: The scheduler to run in the task group (the bus made it), or None.
        flush_interval: Seconds between two drains of the queue.
        close_timeout: Seconds closing waits for async subscribers before cancelling them.
    """

    def __init__(
        self,
        *,
        queue: PublishQueue,
        routes: RouteTable,
        subscriptions: SubscriptionSet,
        channel: CommandChannel,
        ledger: FailureLedger,
        own_scheduler: AnyioScheduler | None,
        flush_interval: float,
        close_timeout: float,
    ) -> None:
        self._queue = queue
        self._routes = routes
        self._subscriptions = subscriptions
        self._channel = channel
        self._ledger = ledger
        self._own_scheduler = own_scheduler
        self._flush_interval = flush_interval
        self._close_timeout = close_timeout
        self._state: State = "new"
        self._tg: TaskGroup | None = None
        # Counters at the last suspend: each suspend reports what its run lost, not the total.
        self._reported: dict[str, int] = {}
        self._reported_failed = 0
        self._reported_dropped = 0

    @property
    def state(self) -> State:
        """new, running, suspended (between two trainer calls), closing or closed."""
        return self._state

    async def open(self) -> None:
        """Start the task group, the scheduler, the async workers and the poller (a new bus,
        or a suspended one again).

        Raises:
            BusClosedError: the bus runs already, or closed (a closed bus stays closed).
        """
        if self._state not in ("new", "suspended"):
            raise BusClosedError(f"the EventBus is {self._state}: it cannot be opened again; "
                                 "a closed bus stays closed, create a new one")  # fmt: skip
        self._state = "running"
        self._queue.open(threading.get_ident())
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg = tg
        if self._own_scheduler is not None:
            await tg.start(self._own_scheduler.run)
        self._subscriptions.start(tg)
        tg.start_soon(self._poll, name="trainbus-bus-poller")

    async def _poll(self) -> None:
        interval = self._flush_interval
        q = self._queue
        # Each wake of this thread costs a tiny-model training thread a GIL hand-over (55-240
        # µs): after _IDLE_TICKS empty intervals the poller parks until the next publish (which
        # wakes it at once) instead of waking every interval for nothing.
        empty = 0
        while True:
            if empty < _IDLE_TICKS:
                await anyio.sleep(interval)
            else:
                await q.wait_published(_PARK_BACKSTOP)
            if q:
                empty = 0
                await q.drain(limit=len(q))
            else:
                empty += 1

    async def suspend(self, *, raise_fatal: bool) -> None:
        """Deliver, fire pending timers, wait for the async subscribers (within
        ``close_timeout``, then cancel what they still run), stop the task group; keep the
        streams and subscriptions for the next :meth:`open`.

        Args:
            raise_fatal: Raise the ``"raise"`` policy's failure, if any, once suspended (it is
                then cleared: the next call starts without it).

        Raises:
            SubscriberError: ``raise_fatal`` and a subscription with ``on_error="raise"`` failed.
        """
        assert self._tg is not None
        try:
            with anyio.CancelScope(shield=True):
                await self._settle()
        finally:
            self._state = "suspended"
            self._queue.suspend()
            self._subscriptions.suspend()
            self._tg.cancel_scope.cancel()
            await self._tg.__aexit__(None, None, None)
            self._tg = None
            self._report_run()
        fatal = self._ledger.take_fatal()
        if raise_fatal and fatal is not None:
            raise fatal

    async def _settle(self) -> None:
        deadline = anyio.current_time() + self._close_timeout
        self._queue.begin_suspend(deadline)
        await self._queue.drain()
        if self._own_scheduler is not None:
            # A call's end is a window's end: buffer_with_time emits its partial batch now,
            # not at the next call (the next window's timer is due then).
            self._own_scheduler.fire_pending()
            await self._queue.drain()
        asyncs = [sub for sub in self._subscriptions.asyncs() if sub.active]
        with anyio.move_on_at(deadline):
            for sub in asyncs:
                await sub.wait_settled(sub.received)

    def _report_run(self) -> None:
        stats = self.statistics()
        cancelled = {}
        for sub in stats.subscriptions:
            new = sub.cancelled - self._reported.get(sub.name, 0)
            if new:
                cancelled[sub.name] = new
            self._reported[sub.name] = sub.cancelled
        failed = stats.failed - self._reported_failed
        dropped = stats.dropped - self._reported_dropped
        self._reported_failed, self._reported_dropped = stats.failed, stats.dropped
        if cancelled or failed:
            log.warning("bus_suspended_with_losses", cancelled=cancelled, failed=failed,
                        dropped=dropped, close_timeout=self._close_timeout)  # fmt: skip
        elif dropped:
            log.info("bus_suspended", dropped=dropped)

    async def close(self, *, raise_fatal: bool) -> None:
        """Deliver, complete, wait (within ``close_timeout``), cancel, report; then stop.

        Args:
            raise_fatal: Raise the ``"raise"`` policy's failure, if any, once closed.

        Raises:
            SubscriberError: ``raise_fatal`` and a subscription with ``on_error="raise"`` failed.
        """
        assert self._tg is not None
        try:
            # Shielded: even when the caller is cancelled, what was published is delivered.
            with anyio.CancelScope(shield=True):
                await self._close()
        finally:
            self._state = "closed"
            self._queue.close()
            self._tg.cancel_scope.cancel()
            await self._tg.__aexit__(None, None, None)
            self._channel.release_waiters()
        fatal = self._ledger.fatal
        if raise_fatal and fatal is not None:
            raise fatal

    async def _close(self) -> None:
        self._state = "closing"
        self._subscriptions.close()
        self._channel.close()
        # One budget for the whole close, the drain included (see relieve_pressure).
        deadline = anyio.current_time() + self._close_timeout
        self._queue.begin_close(deadline)
        await self._queue.drain()
        # Completing the roots lets buffering operators (buffer_with_time, ...) emit what they
        # hold, so a batched logger loses nothing at the end of a run.
        for observer in self._routes.observers():
            try:
                observer.on_completed()
            except Exception as exc:
                self._ledger.completion_failed(observer, exc)
        await self._queue.drain()
        asyncs = self._subscriptions.asyncs()
        for sub in asyncs:
            sub.close_input()
        with anyio.move_on_at(deadline):
            for sub in asyncs:
                await sub.wait_finished()
        for sub in asyncs:
            if not sub.finished:
                sub.cancel()
        for sub in asyncs:
            await sub.wait_finished()
        self._channel.warn_unapplied()
        cancelled = {s.name: s.cancelled for s in asyncs if s.cancelled}
        stats = self.statistics()
        if cancelled or stats.failed:
            log.warning(
                "bus_closed_with_losses",
                cancelled=cancelled,
                failed=stats.failed,
                dropped=stats.dropped,
            )
        elif stats.dropped:
            # Drops are what "drop_oldest"/"latest" subscriptions asked for: counted, not alarming.
            log.info("bus_closed", dropped=stats.dropped)

    def statistics(self) -> BusStatistics:
        """A frozen snapshot: published, delivered, dropped, failed, queue depth, and per
        subscription counters."""
        subs = self._subscriptions.statistics()
        depth = len(self._queue)
        delivered = self._queue.delivered
        return BusStatistics(
            published=delivered + depth,
            delivered=delivered,
            queue_depth=depth,
            dropped=sum(s.dropped for s in subs),
            failed=self._ledger.failed,
            cancelled=sum(s.cancelled for s in subs),
            publisher_waits=self._queue.publisher_waits,
            subscriptions=subs,
        )

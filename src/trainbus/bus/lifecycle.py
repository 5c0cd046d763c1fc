"""Opening and closing the bus, its poller, and its statistics.

Opening starts the bus' task group: the scheduler's timer task (when the bus made its own
scheduler), the async subscribers' workers and the poller that drains the queue every
``flush_interval``. Closing delivers every event published before the close, completes every
stream (so buffering operators emit what they hold), waits for async subscribers (with a
notice naming what is pending and for whom; for ever unless ``close_timeout`` is set, or until
``EventBus.cancel_pending()``), cancels what is left and reports every lost item.
"""

from __future__ import annotations

import math
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
from .watchdog import Watchdog

__all__ = ["Lifecycle", "State"]

log = get_logger(__name__)

State = Literal["new", "running", "closing", "closed"]

_IDLE_TICKS = 3
"""Empty flush intervals after which the poller parks until the next publish."""
_PARK_BACKSTOP = 1.0
"""Seconds a parked poller waits at most (a safety net: a publish wakes it at once)."""


class Lifecycle:
    """The bus' state (new, running, closing, closed) and its task group.

    Args:
        queue, routes, subscriptions, channel, ledger: The bus' parts.
        own_scheduler: The scheduler to run in the task group (the bus made it), or None.
        flush_interval: Seconds between two drains of the queue.
        close_timeout: Seconds closing waits for async subscribers before cancelling them
            (None: as long as they take).
        watchdog: Watches the event-loop thread while the bus runs (started at open, stopped
            and joined at close), or None.
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
        close_timeout: float | None,
        watchdog: Watchdog | None = None,
    ) -> None:
        self._queue = queue
        self._routes = routes
        self._subscriptions = subscriptions
        self._channel = channel
        self._ledger = ledger
        self._own_scheduler = own_scheduler
        self._flush_interval = flush_interval
        self._close_timeout = close_timeout
        self._watchdog = watchdog
        self._state: State = "new"
        self._tg: TaskGroup | None = None

    @property
    def state(self) -> State:
        """new, running, closing or closed."""
        return self._state

    async def open(self) -> None:
        """Start the task group, the scheduler, the async workers and the poller.

        Raises:
            BusClosedError: the bus ran already (a bus runs once).
        """
        if self._state != "new":
            raise BusClosedError("an EventBus runs once; create a new one")
        self._state = "running"
        self._queue.open(threading.get_ident())
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg = tg
        if self._own_scheduler is not None:
            await tg.start(self._own_scheduler.run)
        self._subscriptions.start(tg)
        tg.start_soon(self._poll, name="trainbus-bus-poller")
        if self._watchdog is not None:  # last: nothing after it can fail and leave it running
            self._watchdog.start(threading.get_ident())

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
            if self._watchdog is not None:
                self._watchdog.stop()
            self._queue.close()
            self._tg.cancel_scope.cancel()
            await self._tg.__aexit__(None, None, None)
            self._channel.seal()
            self._channel.release_waiters()
        fatal = self._ledger.fatal
        if raise_fatal and fatal is not None:
            raise fatal

    async def _close(self) -> None:
        self._state = "closing"
        self._subscriptions.close()
        self._channel.close()
        # One budget for the whole close (None: no limit; cancel_pending() ends the wait).
        timeout = self._close_timeout
        deadline = anyio.current_time() + (math.inf if timeout is None else timeout)
        self._queue.begin_close()
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
        pending = self._subscriptions.pending()
        if pending:
            # Visible: a close that waits for a slow service is not a hang.
            log.warning("bus_close_waiting", pending=pending, close_timeout=timeout,
                        action="waiting for them" if timeout is None else
                        f"waiting up to {timeout:g} s, then cancelling",
                        hint="EventBus.cancel_pending() cancels them now (counted as lost "
                        "work); Trainer(close_timeout=...) bounds the wait")  # fmt: skip
        with anyio.move_on_at(deadline):
            for sub in asyncs:
                await sub.wait_finished()
        for sub in asyncs:
            if not sub.finished:
                sub.cancel()
        for sub in asyncs:
            await sub.wait_finished()
        self._channel.warn_unapplied()
        stats = self.statistics()
        lost = {s.name: s.lost for s in stats.subscriptions if s.lost}
        if lost:
            log.warning(
                "bus_closed_with_lost_work",
                lost_work=sum(x.total for x in lost.values()),
                lost={name: {"dropped": x.dropped, "cancelled": x.cancelled, "failed": x.failed}
                      for name, x in lost.items()},
                dropped=stats.dropped,
                cancelled=stats.cancelled,
                failed=stats.failed,
            )  # fmt: skip

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

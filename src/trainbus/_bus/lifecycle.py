"""Opening, suspending and closing the bus (docs/bus.md, "Lifecycle"), its poller, and its
statistics.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Awaitable, Callable
from typing import Literal

import anyio

from .._exceptions import BusClosedError
from .._log import get_logger
from .commands import CommandChannel
from .dispatch import PublishQueue, RouteTable
from .scheduler import AnyioScheduler, TaskSet
from .subscriptions import BusStatistics, LostWork, SubscriptionSet
from .watchdog import FailureLedger, Watchdog

__all__ = ["DEFAULT_CLOSE_TIMEOUT", "Lifecycle"]

log = get_logger(__name__)

State = Literal["new", "running", "suspended", "closing", "closed"]

DEFAULT_CLOSE_TIMEOUT = 300.0
"""Seconds a close or a call's end waits for pending async work by default: long enough for a
real upload, short enough that a hung one cannot hold a job's machines for hours."""

_CANCEL_POLL = 0.1
"""Seconds between two looks at a cancel request while a call's end or a close waits."""
_NOTICE_AFTER = 1.0
"""Seconds a call's end or a close waits for async subscribers before it says so."""
_NOTICE_EVERY = 30.0
"""Seconds between two ``bus_close_waiting`` warnings, at most (a tenth of ``close_timeout``)."""
_WARN_AFTER = 5.0
"""Seconds of a wait after which ``bus_close_waiting`` is a warning (the first: info)."""
_LOST = ("dropped", "cancelled", "failed")


class Lifecycle:
    """The bus' state and its task group: the poller, the async workers, and the scheduler's
    timer task when the bus made its own (``own_scheduler``)."""

    def __init__(
        self,
        queue: PublishQueue,
        routes: RouteTable,
        subscriptions: SubscriptionSet,
        channel: CommandChannel,
        ledger: FailureLedger,
        own_scheduler: AnyioScheduler | None,
        close_timeout: float | None,
        watchdog: Watchdog,
    ) -> None:
        self._queue = queue
        self._routes = routes
        self._subscriptions = subscriptions
        self._channel = channel
        self._ledger = ledger
        self._own_scheduler = own_scheduler
        self._close_timeout = close_timeout
        self._watchdog = watchdog
        self.state: State = "new"
        self._tasks: TaskSet | None = None  # the poller, the scheduler's timer, async workers
        # The task group is entered through this stack, so that a cancellation at any await
        # of open() unwinds it in open() itself (the caller's cancel scopes stay nested).
        self._stack: contextlib.AsyncExitStack | None = None
        # Lost work at the last suspend: each suspend reports what its call lost, not the total.
        self._reported: dict[str, LostWork] = {}
        self._cancel_requested = False

    async def open(self) -> None:
        """Start the task group (a new bus, or a suspended one again); a bus that runs or
        closed raises BusClosedError."""
        if self.state not in ("new", "suspended"):
            raise BusClosedError(
                f"the EventBus is {self.state}: it cannot be opened again; "
                "a closed bus stays closed, create a new one"
            )
        previous = self.state
        self.state = "running"
        self._channel.resume_polls()
        self._queue.open(threading.get_ident())
        self._stack = stack = contextlib.AsyncExitStack()
        try:
            tg = await stack.enter_async_context(anyio.create_task_group())
            tasks = self._tasks = TaskSet(tg)
            if self._own_scheduler is not None:
                tasks.start_soon(self._own_scheduler.run)
            self._subscriptions.start(tasks)
            tasks.start_soon(self._queue.run, name="trainbus-bus-poller")
            # A checkpoint, as every async call is: one cancelled already (a deadline passed)
            # stops here, and the bus stays as it was.
            await anyio.lowlevel.checkpoint()
        except BaseException:
            # Cancelled (or failed) half-way: stop what started; the bus stays as it was.
            self.state = previous
            await self._stop_task_group(closing=False)
            raise
        # Last: nothing after it can fail and leave it running.
        self._watchdog.start(threading.get_ident())

    async def _stop_task_group(self, *, closing: bool) -> None:
        """Stop the watchdog, the dispatching, the async workers and the task group."""
        self._watchdog.stop()
        self._queue.stop(close=closing)
        if closing:
            self._subscriptions.cancel_pending()
        else:
            self._subscriptions.suspend()
        stack, tasks = self._stack, self._tasks
        self._stack, self._tasks = None, None
        if tasks is not None:
            # The async workers first: a scope around them cancelled while they end would make
            # their own scopes let it through.
            with anyio.CancelScope(shield=True):
                for sub in self._subscriptions.asyncs():
                    await sub.wait_finished()
            # Each task ends by its own scope (TaskSet: no reference cycle on asyncio).
            tasks.stop()
        if stack is not None:
            await stack.aclose()

    async def end(self, *, close: bool, raise_fatal: bool) -> None:
        """Suspend (:meth:`EventBus.suspend`) or close; with ``raise_fatal``, raise a
        ``"raise"`` subscription's failure (a suspend clears it either way)."""
        assert self._tasks is not None
        try:
            # Shielded: what was published is delivered even when the caller is cancelled.
            with anyio.CancelScope(shield=True):
                await self._wind_down(close)
        finally:
            self.state = "closed" if close else "suspended"
            await self._stop_task_group(closing=close)
            if close:
                self._channel.seal()
            self._report_lost()
        fatal = self._ledger.fatal if close else self._ledger.take_fatal()
        if raise_fatal and fatal is not None:
            raise fatal

    async def _wind_down(self, close: bool) -> None:
        deadline = anyio.current_time() + (
            math.inf if self._close_timeout is None else self._close_timeout
        )
        if close:
            self.state = "closing"
            self._subscriptions.close()
            self._channel.close()
            self._queue.stop()
        self._queue.drain()
        if close:
            # Completing the roots lets buffering operators emit what they hold.
            for observer in self._routes.observers():
                try:
                    observer.on_completed()
                except Exception as exc:
                    self._ledger.operator_failed(observer, exc)
        elif self._own_scheduler is not None:
            # A call's end is a window's end: buffer_with_time emits its partial batch now.
            self._own_scheduler.fire_pending()
        self._queue.drain()
        # Commands sent after the last poll point are not carried into the next call; a
        # request() waiting now raises BusClosedError instead of holding this wait.
        self._channel.end_polls()
        asyncs = [sub for sub in self._subscriptions.asyncs() if close or sub.active]
        if close:
            for sub in asyncs:
                sub.on_completed()

        async def wait() -> None:
            for sub in asyncs:
                start = anyio.current_time()
                waits = sub.pending > 0  # only a wait for work counts (end_waited_s)
                try:
                    await (sub.wait_finished() if close else sub.wait_settled(sub.received))
                finally:
                    if waits:
                        sub.end_waited_s += anyio.current_time() - start

        try:
            await self._wait_pending(wait, deadline)
        finally:
            self._channel.drop_unapplied()  # sent (not requested) while they finished

    async def _wait_pending(self, wait: Callable[[], Awaitable[None]], deadline: float) -> None:
        """Await ``wait()`` until ``deadline``, or until :meth:`request_cancel_pending`."""

        async def on_request() -> None:
            # A flag, polled: a signal handler on any thread may set it (not an anyio.Event).
            while not self._cancel_requested:  # noqa: ASYNC110
                await anyio.sleep(_CANCEL_POLL)
            self.cancel_pending()

        start = anyio.current_time()
        timeout = self._close_timeout
        every = _NOTICE_EVERY if timeout is None else max(min(_NOTICE_EVERY, timeout / 10), 0.01)

        async def notice() -> None:
            # Only a wait that lasts is announced, and again while it lasts.
            await anyio.sleep(min(_NOTICE_AFTER, every))
            said = False  # the first is info (the documented wait); a wait that lasts warns
            while True:
                pending = self._subscriptions.pending()
                now = anyio.current_time()
                if pending:
                    (log.warning if said else log.info)(
                        "bus_close_waiting",
                        pending=pending,
                        close_timeout=timeout,
                        waited_s=round(now - start, 3),
                        action="waiting for them"
                        if timeout is None
                        else f"waiting {max(deadline - now, 0.0):.3g} s more, then cancelling them",
                        hint="EventBus.cancel_pending() (or Ctrl-C) cancels them now, counted "
                        "as lost work; EventBus(close_timeout=...) bounds the wait",
                    )
                    if not said:  # the first warning soon after: at the default level, it is
                        said = True  # the first thing a user sees of the wait
                        await anyio.sleep(min(_WARN_AFTER - _NOTICE_AFTER, every))
                        continue
                await anyio.sleep(every)

        async with anyio.create_task_group() as tg:
            tasks = TaskSet(tg)
            tasks.start_soon(on_request)
            tasks.start_soon(notice)
            try:
                with anyio.move_on_at(deadline):
                    await wait()
            finally:
                tasks.stop()  # they end by their own scopes (TaskSet)
        self._cancel_requested = False  # answered, or nothing was left to cancel

    def request_cancel_pending(self) -> None:
        """Ask a waiting call's end or close to cancel the pending async work (a flag: safe
        from any thread and a signal handler)."""
        self._cancel_requested = True

    def cancel_pending(self) -> dict[str, int]:
        """:meth:`EventBus.cancel_pending`."""
        pending = self._subscriptions.cancel_pending()
        if pending:
            log.warning("bus_pending_cancelled", cancelled=pending)
        return pending

    def _report_lost(self) -> None:
        """Log what the subscribers lost since the last report (a call's end, or the close)."""
        totals: dict[str, LostWork] = {}  # by name: subscriptions may share one (two lambdas)
        for sub in self.statistics().subscriptions:
            totals[sub.name] = totals.get(sub.name, LostWork()) + sub.lost_work
        lost: dict[str, dict[str, int]] = {}
        for name, now in totals.items():
            before = self._reported.get(name, LostWork())
            self._reported[name] = now
            grown = {kind: getattr(now, kind) - getattr(before, kind) for kind in _LOST}
            if any(grown.values()):
                lost[name] = grown
        if lost:
            sums = {kind: sum(x[kind] for x in lost.values()) for kind in _LOST}
            log.warning(
                "bus_closed_with_lost_work", total=sum(sums.values()), lost_work=lost, **sums
            )

    def statistics(self) -> BusStatistics:
        """:meth:`EventBus.statistics`."""
        subs = tuple(s.statistics() for s in self._subscriptions.all())
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

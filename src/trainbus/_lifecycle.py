"""Opening and closing the bus, and its statistics (part of EventBus).

Closing delivers every event published before the close, completes every stream (so buffering
operators emit what they hold), waits for async subscribers within ``close_timeout``, cancels
what is left and reports it.
"""

from __future__ import annotations

import threading
from collections import deque
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, Self

import anyio
import structlog
from anyio.abc import TaskGroup

from . import commands as cmd
from . import events as ev
from ._exceptions import BusClosedError, SubscriberError
from ._failures import name_of
from ._scheduler import AnyioScheduler
from ._subscription import AsyncSubscription, BusStatistics, Subscription

if TYPE_CHECKING:
    from reactivex import abc

    from ._bus import _Root

__all__ = ["LifecycleMixin"]


class _ClosedQueue(deque[ev.BaseEvent]):
    """The queue of a closed bus: appending raises ``BusClosedError``."""

    def append(self, event: ev.BaseEvent) -> None:
        raise BusClosedError(
            f"publish({type(event).__name__}) after the bus closed: nothing would deliver it"
        )

log = structlog.get_logger("trainbus._bus")


class LifecycleMixin:
    """``async with bus``, the poller, ``statistics()``."""

    _state: Literal["new", "running", "closing", "closed"]
    _loop_thread: int | None
    _tg: TaskGroup | None
    _own_scheduler: bool
    scheduler: abc.SchedulerBase
    _subscriptions: list[Subscription]
    _roots: list[_Root]
    _queue: deque[ev.BaseEvent]
    _commands: deque[cmd.Command]
    _requests: dict[int, Any]
    _room: threading.Event
    _fatal: SubscriberError | None
    _close_deadline: float | None
    _delivered: int
    _failed: int
    _publisher_waits: int
    flush_interval: float
    close_timeout: float

    if TYPE_CHECKING:

        async def _drain(self, limit: int | None = None) -> None: ...  # provided by EventBus

    def _check_open_for_subscribers(self) -> None:
        if self._state in ("closing", "closed"):
            raise BusClosedError("the bus is closed; subscribe before it closes")

    @property
    def running(self) -> bool:
        """True between entering and leaving ``async with bus``."""
        return self._state == "running"

    async def __aenter__(self) -> Self:
        if self._state != "new":
            raise BusClosedError("an EventBus runs once; create a new one")
        self._state = "running"
        self._loop_thread = threading.get_ident()
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg = tg
        if self._own_scheduler:
            assert isinstance(self.scheduler, AnyioScheduler)
            await tg.start(self.scheduler.run)
        for sub in self._subscriptions:
            if isinstance(sub, AsyncSubscription) and sub.active:
                sub.start(tg)
        tg.start_soon(self._poll, name="trainbus-bus-poller")
        return self

    async def _poll(self) -> None:
        interval = self.flush_interval
        q = self._queue
        while True:
            await anyio.sleep(interval)
            if q:
                await self._drain(limit=len(q))

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        assert self._tg is not None
        try:
            # Shielded: even when the caller is cancelled, what was published is delivered.
            with anyio.CancelScope(shield=True):
                await self._close()
        finally:
            self._state = "closed"
            # From now on publish() raises: its append lands on a queue that refuses it, which
            # costs the hot path nothing (no state check per publish).
            undelivered = list(self._queue)
            self._queue = _ClosedQueue(undelivered)
            self._room.set()
            self._tg.cancel_scope.cancel()
            await self._tg.__aexit__(None, None, None)
            self._loop_thread = None
            for _, done, _slot in list(self._requests.values()):
                done.set()
        if exc_type is None and self._fatal is not None:
            raise self._fatal
        return None

    async def _close(self) -> None:
        self._state = "closing"
        # One budget for the whole close, the drain included (see _relieve_pressure).
        self._close_deadline = deadline = anyio.current_time() + self.close_timeout
        await self._drain()
        # Completing the roots lets buffering operators (buffer_with_time, ...) emit what they
        # hold, so a batched logger loses nothing at the end of a run.
        for root in list(self._roots):
            try:
                root.observer.on_completed()
            except Exception as exc:
                self._failed += 1
                log.error("subscriber_failed", subscription=name_of(root.observer), exc_info=exc)
        await self._drain()
        asyncs = [s for s in self._subscriptions if isinstance(s, AsyncSubscription)]
        for sub in asyncs:
            sub.close_input()
        with anyio.move_on_at(deadline):
            for sub in asyncs:
                await sub.wait_finished()
        for sub in asyncs:
            if not sub.finished and sub.scope is not None:
                sub.scope.cancel()
        for sub in asyncs:
            await sub.wait_finished()
        if self._commands:
            # Sent after the loop's last poll point: say so rather than drop them silently.
            log.warning("commands_not_applied", commands=[repr(c) for c in self._commands])
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
        subs = tuple(s.statistics() for s in self._subscriptions)
        depth = len(self._queue)
        return BusStatistics(
            published=self._delivered + depth,
            delivered=self._delivered,
            queue_depth=depth,
            dropped=sum(s.dropped for s in subs),
            failed=self._failed,
            cancelled=sum(s.cancelled for s in subs),
            publisher_waits=self._publisher_waits,
            subscriptions=subs,
        )

    @property
    def subscriptions(self) -> tuple[Subscription, ...]:
        """Every subscription made through this bus, in order (inactive ones included)."""
        return tuple(self._subscriptions)

"""Dispatch: the loop thread's side of the hand-off (part of EventBus).

The queue is drained in one slice, event by event, each to the root observers its type routes
to (core, then user, then global), with no await between events unless a ``"block"`` async
buffer is over capacity (back-pressure). A root observer that raises past RxPY is still isolated.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import TYPE_CHECKING, Any

import anyio

from . import events as ev
from ._exceptions import BusClosedError
from ._subscription import AsyncSubscription, Subscription

if TYPE_CHECKING:
    from reactivex import abc

__all__ = ["DispatchMixin"]


class DispatchMixin:
    """``flush`` and the drain the poller, barriers and close share."""

    _queue: deque[ev.BaseEvent]
    _routes: dict[type, tuple[abc.ObserverBase[Any], ...]]
    _subscriptions: list[Subscription]
    _pressure: bool
    _delivered: int
    _room: threading.Event
    _close_deadline: float | None
    _loop_thread: int | None

    if TYPE_CHECKING:

        def _resolve(self, event_type: type) -> tuple[abc.ObserverBase[Any], ...]: ...

        def _chain_failed(self, observer: Any, exc: Exception, event: ev.BaseEvent) -> None: ...

    def _dispatch(self, n: int) -> int:
        """Deliver up to ``n`` queued events; stop early under block pressure. Loop thread."""
        popleft = self._queue.popleft
        done = 0
        while done < n:
            event = popleft()
            done += 1
            observers = self._routes.get(type(event))
            if observers is None:
                observers = self._resolve(type(event))
            for observer in observers:
                try:
                    observer.on_next(event)
                except Exception as exc:  # an operator that raised past RxPY: still isolated
                    self._chain_failed(observer, exc, event)
            if self._pressure:
                break
        self._delivered += done
        return done

    async def _drain(self, limit: int | None = None) -> None:
        """Deliver queued events (all of them, or ``limit``), honouring block pressure."""
        q = self._queue
        remaining = len(q) if limit is None else limit
        while q and remaining > 0:
            # Pressure is checked before dispatching too: when two drains run at once (the
            # poller and close, or wait_delivered), the second must not push one more item into
            # a "block" buffer that is already over capacity.
            if self._pressure:
                await self._relieve_pressure()
            remaining -= self._dispatch(min(remaining, len(q)))
            if self._pressure:
                await self._relieve_pressure()
            if limit is None:
                remaining = len(q)
        self._room.set()

    async def _relieve_pressure(self) -> None:
        for sub in self._subscriptions:
            if isinstance(sub, AsyncSubscription) and sub.over_capacity:
                if self._close_deadline is None:
                    await sub.wait_for_room()
                    continue
                # Closing: a "block" subscriber stalled on a full buffer must not hold the rest
                # of the drain (and close itself) forever. Past close_timeout it is cancelled,
                # like any async subscriber still busy then; its items count as cancelled.
                with anyio.move_on_at(self._close_deadline):
                    await sub.wait_for_room()
                if sub.over_capacity and sub.scope is not None:
                    sub.scope.cancel()
                    await sub.wait_finished()
        self._pressure = False

    def flush(self) -> None:
        """Deliver every queued event now, on the calling thread (the loop thread if running).

        A full ``"block"`` buffer cannot be waited for here (this is synchronous): it takes
        every item this flush hands it, beyond its capacity, and its workers catch up later.
        Use ``await wait_delivered()`` to deliver with back-pressure and wait.

        Raises:
            BusClosedError: called from another thread while the bus runs.
        """
        if self._loop_thread is not None and threading.get_ident() != self._loop_thread:
            raise BusClosedError(
                "flush() runs on the bus' event-loop thread; from another thread use "
                "anyio.from_thread.run(bus.wait_delivered)"
            )
        while self._queue:
            self._dispatch(len(self._queue))
        self._pressure = False
        self._room.set()

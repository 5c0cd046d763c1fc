"""The event loop's runtime: the reactivex schedulers on anyio (never RxPY's default
``threading.Timer``, which would run subscribers off the loop), and the background tasks.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeAlias, TypeVar

import anyio
import anyio.from_thread
import anyio.lowlevel
from anyio.abc import TaskGroup, TaskStatus
from reactivex import abc, typing
from reactivex.disposable import SingleAssignmentDisposable
from reactivex.scheduler import CurrentThreadScheduler
from reactivex.scheduler.periodicscheduler import PeriodicScheduler

from .._log import get_logger

__all__ = ["AnyioScheduler", "ChainScheduler", "TaskSet"]


# ================================================================== the Rx scheduler
_TState = TypeVar("_TState")
log = get_logger(__name__)


# A scheduled action: the action, its state, and the disposable handed back (disposed: cancelled).
_Item: TypeAlias = tuple[Any, Any, SingleAssignmentDisposable]


class AnyioScheduler(PeriodicScheduler):
    """Schedules reactivex actions on the anyio event loop that runs :meth:`run` (one timer
    task over a heap), from any thread and before the loop runs. ``now`` is the wall clock, as
    for every reactivex 6 scheduler; delays run on the loop's clock. An action that raises is
    logged and reported to ``on_failure``; it never stops the timer task.

    Args:
        on_failure: Called with the exception of an action that raised.
    """

    def __init__(self, on_failure: Callable[[BaseException], None] | None = None) -> None:
        super().__init__()
        self._heap: list[tuple[float, int, _Item]] = []
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self._wake: anyio.Event | None = None
        self._token: anyio.lowlevel.EventLoopToken | None = None
        self._thread: int | None = None
        # Loop clock minus time.monotonic() (trio's clock has a random offset), for times read
        # off the loop thread.
        self._offset = 0.0
        self._on_failure = on_failure

    def schedule(
        self, action: typing.ScheduledAction[_TState], state: _TState | None = None
    ) -> abc.DisposableBase:
        """Run ``action`` as soon as the loop gets to it."""
        return self._push(0.0, action, state)

    def schedule_relative(
        self,
        duetime: typing.RelativeTime,
        action: typing.ScheduledAction[_TState],
        state: _TState | None = None,
    ) -> abc.DisposableBase:
        """Run ``action`` after ``duetime`` (seconds or ``timedelta``)."""
        return self._push(max(0.0, self.to_seconds(duetime)), action, state)

    def schedule_absolute(
        self,
        duetime: typing.AbsoluteTime,
        action: typing.ScheduledAction[_TState],
        state: _TState | None = None,
    ) -> abc.DisposableBase:
        """Run ``action`` at wall-clock time ``duetime``."""
        delay = (self.to_datetime(duetime) - self.now).total_seconds()
        return self._push(max(0.0, delay), action, state)

    def _clock(self) -> float:
        if self._thread == threading.get_ident():
            return anyio.current_time()
        return time.monotonic() + self._offset

    def _push(self, delay: float, action: Any, state: Any) -> abc.DisposableBase:
        disposable = SingleAssignmentDisposable()
        with self._lock:
            due = self._clock() + delay
            first = not self._heap or due < self._heap[0][0]
            heapq.heappush(self._heap, (due, next(self._seq), (action, state, disposable)))
        if first:
            self._wake_timer()
        return disposable

    def _wake_timer(self) -> None:
        wake = self._wake
        if wake is None:
            return  # not running yet: run() reads the heap when it starts
        if self._thread == threading.get_ident():
            wake.set()
        elif self._token is not None:
            try:
                # _set_wake reads the event on the loop thread: one read here may be stale.
                anyio.from_thread.run_sync(self._set_wake, token=self._token)
            except anyio.RunFinishedError:
                pass

    def _set_wake(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Run due actions until cancelled. Started by the bus in its task group."""
        self._token = anyio.lowlevel.current_token()
        offset = anyio.current_time() - time.monotonic()
        with self._lock:
            # Actions scheduled before the loop ran were timed with the old offset.
            shift = offset - self._offset
            self._heap = [(due + shift, seq, item) for due, seq, item in self._heap]
            heapq.heapify(self._heap)
            self._offset = offset
        self._thread = threading.get_ident()
        self._wake = anyio.Event()
        task_status.started()
        try:
            while True:
                with self._lock:
                    now = anyio.current_time()
                    due_items: list[_Item] = []
                    while self._heap and self._heap[0][0] <= now:
                        due_items.append(heapq.heappop(self._heap)[2])
                    delay = self._heap[0][0] - now if self._heap else None
                for item in due_items:
                    self._invoke(item)
                if due_items:
                    await anyio.lowlevel.checkpoint()
                    continue
                wake = self._wake = anyio.Event()
                with anyio.move_on_after(delay):  # None: until woken
                    await wake.wait()
        finally:
            self._wake = None
            self._thread = None

    def fire_pending(self) -> None:
        """Run every action scheduled so far now, whenever it was due (a trainer call's end
        closes the time windows); actions these schedule wait for their own time."""
        with self._lock:
            items = [entry[2] for entry in sorted(self._heap)]
            self._heap = []
        for item in items:
            self._invoke(item)

    def _invoke(self, item: _Item) -> None:
        action, state, disposable = item
        if disposable.is_disposed:
            return
        try:
            disposable.disposable = self.invoke_action(action, state)
        except Exception as exc:
            log.error("scheduled_action_failed", exc_info=exc)
            if self._on_failure is not None:
                self._on_failure(exc)

    @property
    def pending(self) -> int:
        """Actions waiting in the heap (cancelled ones included until they come due)."""
        return len(self._heap)


class ChainScheduler(PeriodicScheduler):
    """The scheduler a bus subscription hands its chain: timed work on ``timed`` (the bus' Rx
    scheduler), work for "now" on the calling thread's trampoline, RxPY's default (so
    ``reactivex.merge`` subscribes within the ``subscribe`` call, as in plain RxPY)."""

    def __init__(self, timed: abc.SchedulerBase) -> None:
        super().__init__()
        self.timed = timed

    @property
    def now(self) -> Any:
        return self.timed.now

    def schedule(
        self, action: typing.ScheduledAction[_TState], state: _TState | None = None
    ) -> abc.DisposableBase:
        return CurrentThreadScheduler.singleton().schedule(action, state)

    def schedule_relative(
        self,
        duetime: typing.RelativeTime,
        action: typing.ScheduledAction[_TState],
        state: _TState | None = None,
    ) -> abc.DisposableBase:
        return self.timed.schedule_relative(duetime, action, state)

    def schedule_absolute(
        self,
        duetime: typing.AbsoluteTime,
        action: typing.ScheduledAction[_TState],
        state: _TState | None = None,
    ) -> abc.DisposableBase:
        return self.timed.schedule_absolute(duetime, action, state)

    def schedule_periodic(
        self,
        period: typing.RelativeTime,
        action: typing.ScheduledPeriodicAction[_TState],
        state: _TState | None = None,
    ) -> abc.DisposableBase:
        if isinstance(self.timed, abc.PeriodicSchedulerBase):
            return self.timed.schedule_periodic(period, action, state)
        return super().schedule_periodic(period, action, state)


# ================================================================== background tasks
class TaskSet:
    """Tasks started in ``tg``, each in its own cancel scope; :meth:`stop` ends them quietly,
    so the group exits without cancelling (a cancelled group leaves, on asyncio, a
    ``CancelledError`` in a reference cycle holding a dropped Trainer)."""

    def __init__(self, tg: TaskGroup) -> None:
        self._tg = tg
        self._scopes: list[anyio.CancelScope] = []
        self.stopped = False
        """Whether :meth:`stop` was called (a task started later stops at its first await)."""
        self._token = anyio.lowlevel.current_token()
        self._thread = threading.get_ident()

    def on_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Call ``fn(*args)`` on the tasks' event-loop thread and return its result."""
        if threading.get_ident() == self._thread:
            return fn(*args)
        return anyio.from_thread.run_sync(fn, *args, token=self._token)

    def start_soon(
        self, fn: Callable[..., Awaitable[Any]], *args: Any, name: str | None = None
    ) -> None:
        """Start ``fn(*args)`` as a task of the group, in its own cancel scope."""
        scope = anyio.CancelScope()
        if self.stopped:
            scope.cancel()
        self._scopes.append(scope)
        self._tg.start_soon(_in_scope, scope, fn, args, name=name)

    def stop(self) -> None:
        """Cancel every task's own scope: each ends at its next await, as a normal return
        (idempotent; safe from one of the tasks)."""
        self.stopped = True
        scopes, self._scopes = self._scopes, []
        for scope in scopes:
            scope.cancel()


async def _in_scope(
    scope: anyio.CancelScope, fn: Callable[..., Awaitable[Any]], args: tuple[Any, ...]
) -> None:
    with scope:
        await fn(*args)

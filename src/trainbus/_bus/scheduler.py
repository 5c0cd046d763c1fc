"""The event loop's runtime: the reactivex scheduler on anyio, and the background tasks.

A reactivex scheduler that runs scheduled actions on an anyio event loop (asyncio or trio).

RxPY's time-based operators (``throttle_first``, ``buffer_with_time``, ``debounce``, ``sample``)
fall back to ``TimeoutScheduler``, a ``threading.Timer`` per action, which would run subscribers
off the event loop and race with the bus. The bus hands this scheduler to every subscription, so
those operators run on the loop thread like everything else.

One timer task serves the whole scheduler: due actions sit in a heap and the task sleeps until
the earliest is due (or until woken by an earlier one). That costs a heap push per scheduled
action instead of a task per action, which matters for ``debounce`` on a per-step stream.
``now`` is the wall clock, as for every reactivex 6 scheduler; delays run on the loop's clock.

Background tasks that stop without leaving their cancellation behind.

Every background task trainbus starts (the bus' poller, timer and async workers, a barrier's
waiters, the watcher of a call's cancellation) runs in a :class:`TaskSet`: in its own cancel
scope, inside the task, which :meth:`TaskSet.stop` cancels. The task then ends *normally* (its
own scope catches the cancellation) and the task group around it exits without cancelling
anything.

Why not ``tg.cancel_scope.cancel()``: on asyncio, anyio's task group keeps the
``CancelledError`` of a child task that ended cancelled in a local of its ``task_done``
callback, whose frame that exception's traceback holds (anyio 4.16): a reference cycle. It
holds the task's frames, and through ``f_back`` the frames of the thread's whole stack at that
moment (the caller's ``asyncio.run(main())`` included), with all their locals, until the next
garbage-collector pass: a dropped Trainer's model, optimizer and data stayed in memory.
A cancellation from outside (the caller's ``move_on_after``) still reaches the tasks as anyio
delivers it.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio
import anyio.from_thread
import anyio.lowlevel
from anyio.abc import TaskGroup, TaskStatus
from reactivex import abc, typing
from reactivex.disposable import Disposable, SingleAssignmentDisposable
from reactivex.scheduler import CurrentThreadScheduler
from reactivex.scheduler.periodicscheduler import PeriodicScheduler

from .._log import get_logger

__all__ = ["AnyioScheduler", "ChainScheduler", "TaskSet"]


# ================================================================== the Rx scheduler
_TState = TypeVar("_TState")
log = get_logger(__name__)


class _Item:
    __slots__ = ("action", "cancelled", "disposable", "state")

    def __init__(self, action: Any, state: Any) -> None:
        self.action = action
        self.state = state
        self.cancelled = False
        self.disposable = SingleAssignmentDisposable()


class AnyioScheduler(PeriodicScheduler):
    """Schedules reactivex actions on the anyio event loop that runs :meth:`run`.

    Actions may be scheduled before the loop runs (they wait in the heap) and from any thread
    (a foreign thread wakes the loop through anyio's thread portal). An action that raises is
    reported to ``on_failure`` and logged; it never stops the timer task.

    Args:
        on_failure: Called with the exception of an action that raised (the bus passes its
            failure ledger's).
    """

    def __init__(self, on_failure: Callable[[BaseException], None] | None = None) -> None:
        super().__init__()
        self._heap: list[tuple[float, int, _Item]] = []
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self._wake: anyio.Event | None = None
        self._token: anyio.lowlevel.EventLoopToken | None = None
        self._thread: int | None = None
        # Loop clock minus time.monotonic(): trio's clock carries a random offset, so a time read
        # off the loop thread is rebased with the offset measured when run() started.
        self._offset = 0.0
        self._on_failure = on_failure

    # ------------------------------------------------------------------ scheduling
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
        item = _Item(action, state)
        with self._lock:
            due = self._clock() + delay
            first = not self._heap or due < self._heap[0][0]
            heapq.heappush(self._heap, (due, next(self._seq), item))
        if first:
            self._wake_timer()

        def cancel() -> None:
            item.cancelled = True
            item.disposable.dispose()

        return Disposable(cancel)

    def _wake_timer(self) -> None:
        wake = self._wake
        if wake is None:
            return  # not running yet: run() reads the heap when it starts
        if self._thread == threading.get_ident():
            wake.set()
        elif self._token is not None:
            try:
                # _set_wake reads the event on the loop thread when it runs. An event read here
                # may already be replaced: the timer makes a fresh one each round, right after
                # it found the heap empty, and setting the stale one would strand this action.
                anyio.from_thread.run_sync(self._set_wake, token=self._token)
            except anyio.RunFinishedError:
                pass

    def _set_wake(self) -> None:
        if self._wake is not None:
            self._wake.set()

    # ------------------------------------------------------------------ the timer task
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
                if delay is None:
                    await wake.wait()
                else:
                    with anyio.move_on_after(delay):
                        await wake.wait()
        finally:
            self._wake = None
            self._thread = None

    def fire_pending(self) -> None:
        """Run every action scheduled so far now, whenever it was due (the bus calls it on
        the loop thread when a trainer call ends, so time windows close with the call).
        Actions these schedule wait for their own time."""
        with self._lock:
            items = [entry[2] for entry in sorted(self._heap)]
            self._heap = []
        for item in items:
            self._invoke(item)

    def _invoke(self, item: _Item) -> None:
        if item.cancelled:
            return
        try:
            item.disposable.disposable = self.invoke_action(item.action, item.state)
        except Exception as exc:
            log.error("scheduled_action_failed", exc_info=exc)
            if self._on_failure is not None:
                self._on_failure(exc)

    @property
    def pending(self) -> int:
        """Actions waiting in the heap (cancelled ones included until they come due)."""
        return len(self._heap)


class ChainScheduler(PeriodicScheduler):
    """The scheduler a bus subscription hands its chain: timed work on ``timed``, "now" inline.

    Timed work (``schedule_relative`` / ``_absolute`` / ``_periodic``, ``now``) goes to
    ``timed``: the bus' Rx scheduler, on the event loop (or virtual time in tests). Work scheduled
    for "now" runs on the calling thread's trampoline, RxPY's own default: ``reactivex.merge``,
    ``from_iterable``, ``start_with`` ... subscribe and emit within the ``subscribe`` call, as in
    plain RxPY. Handed the bus' Rx scheduler instead, they would defer a merged pipeline's
    subscription to the loop's next round (in virtual time, to the next advance): its streams
    would miss what is delivered meanwhile, ``wants()`` would not see them, and they would
    register outside the ``bus.tier(...)`` in force.
    """

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
    """Tasks started in ``tg``, each in its own cancel scope; :meth:`stop` ends them quietly.

    Args:
        tg: The task group the tasks run in (it waits for them when its block ends). Made on
            the event loop that runs it, as the task group itself.
    """

    def __init__(self, tg: TaskGroup) -> None:
        self._tg = tg
        self._scopes: list[anyio.CancelScope] = []
        self._stopped = False
        self._token = anyio.lowlevel.current_token()
        self._thread = threading.get_ident()

    def on_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Call ``fn(*args)`` on the tasks' event-loop thread: at once when called there;
        from another thread (a hook on the training thread, a user's thread) through anyio's
        portal, waiting for it. What makes anyio objects (events, tasks) must run there.

        Returns:
            What ``fn`` returned.
        """
        if threading.get_ident() == self._thread:
            return fn(*args)
        return anyio.from_thread.run_sync(fn, *args, token=self._token)

    @property
    def stopped(self) -> bool:
        """Whether :meth:`stop` was called (a task started later stops at its first await)."""
        return self._stopped

    def _scope(self) -> anyio.CancelScope:
        scope = anyio.CancelScope()
        if self._stopped:
            scope.cancel()
        self._scopes.append(scope)
        return scope

    def start_soon(
        self, fn: Callable[..., Awaitable[Any]], *args: Any, name: str | None = None
    ) -> None:
        """Start ``fn(*args)`` as a task of the group, in its own cancel scope."""
        self._tg.start_soon(_in_scope, self._scope(), fn, args, name=name)

    async def start(
        self, fn: Callable[..., Awaitable[Any]], *args: Any, name: str | None = None
    ) -> Any:
        """Start ``fn(*args, task_status=...)`` and wait until it calls ``started()``.

        Returns:
            What ``fn`` passed to ``task_status.started()``.
        """
        return await self._tg.start(_started_in_scope, self._scope(), fn, args, name=name)

    def stop(self) -> None:
        """Cancel every task's own scope: each ends at its next await, as a normal return.
        Idempotent; safe from one of the tasks (it ends at its next await, if any)."""
        self._stopped = True
        scopes, self._scopes = self._scopes, []
        for scope in scopes:
            scope.cancel()


async def _in_scope(
    scope: anyio.CancelScope, fn: Callable[..., Awaitable[Any]], args: tuple[Any, ...]
) -> None:
    with scope:
        await fn(*args)


async def _started_in_scope(
    scope: anyio.CancelScope,
    fn: Callable[..., Awaitable[Any]],
    args: tuple[Any, ...],
    *,
    task_status: TaskStatus[Any] = anyio.TASK_STATUS_IGNORED,
) -> None:
    with scope:
        await fn(*args, task_status=task_status)

"""Background tasks that stop without leaving their cancellation behind.

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

import threading
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel
from anyio.abc import TaskGroup, TaskStatus

__all__ = ["TaskSet"]


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

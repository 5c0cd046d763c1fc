"""How long a Trainer's bus runs, and the blocking portal its sync twins run through
(docs/trainer.md, "One Trainer, many calls")."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio
import anyio.from_thread
from anyio.from_thread import BlockingPortal

from .._bus import EventBus
from .._exceptions import ConfigError, TrainbusError
from .calls import TrainingThread, unboxed

__all__ = ["DURING_FIT", "BusHolder"]

BACKENDS = ("asyncio", "trio")
DURING_FIT = (
    "; during fit(), evaluate or save with a command: trainer.bus.send(commands.Evaluate()) "
    "or SaveCheckpoint() (await trainer.bus.request(...) from an async subscriber waits for it)"
)

_T = TypeVar("_T")


async def _captured(fn: Callable[[], Awaitable[_T]]) -> tuple[bool, Any]:
    try:
        return True, await fn()
    except (Exception, KeyboardInterrupt) as exc:  # raised again on the caller's thread
        # (a second Ctrl-C's abort too: out of the portal's task it would end its event loop
        # with an exception group printed at shutdown)
        return False, exc


def portal_call(portal: BlockingPortal, fn: Callable[[], Awaitable[_T]]) -> _T:
    """``portal.call(fn)``, raising on the caller's thread (anyio's portal holds an exception
    in a reference cycle, which would keep the Trainer alive until a gc pass)."""
    return unboxed(portal.call(_captured, fn))  # type: ignore[no-any-return]


class BusHolder:
    """How a Trainer holds its bus across calls and the portal of its sync twins; the
    training ``thread`` ends when the bus closes."""

    def __init__(self, bus: EventBus, thread: TrainingThread) -> None:
        self._bus = bus
        self._thread = thread
        self._portal: BlockingPortal | None = None
        self._backend = "asyncio"
        self._stack: contextlib.ExitStack | None = None

    @property
    def closed(self) -> bool:
        """Whether the bus closed (``close()``, the end of ``with`` / ``async with``)."""
        return self._bus.state in ("closing", "closed")

    def check_open(self, call: str) -> None:
        """Raises ``TrainbusError`` naming ``call`` when the bus closed."""
        if self.closed:
            raise TrainbusError(
                f"{call}: this Trainer is closed (trainer.close() or the end of its `with` / "
                "`async with` block completed its bus); build a new Trainer (to continue "
                "training: fit(resume='latest'))"
            )

    def _check_enter(self, block: str) -> None:
        self.check_open(block)
        if self._bus.state == "running" or self._portal is not None:
            raise TrainbusError(f"{block}: its bus runs already (an enclosing `with` or "
                                "`async with`); enter it once")  # fmt: skip

    def enter(self) -> None:
        """``with trainer:``: start the portal every sync call of the block runs through."""
        self._check_enter("with trainer")
        stack = contextlib.ExitStack()
        self._portal = stack.enter_context(anyio.from_thread.start_blocking_portal("asyncio"))
        self._stack, self._backend = stack, "asyncio"

    def close(self) -> None:
        """Close the bus, stop the ``with`` block's portal and end the training thread."""
        try:
            self._close()
        finally:
            self._end_thread()

    def _end_thread(self) -> None:
        if self.closed:
            self._thread.close()

    def _close(self) -> None:
        stack, portal = self._stack, self._portal
        if stack is not None and portal is not None:
            self._stack = self._portal = None
            with stack:
                if self._bus.state == "running":  # a call interrupted here runs on: cancel it
                    with contextlib.suppress(RuntimeError):
                        portal.call(portal.stop, True)
                elif not self.closed:
                    portal.call(self._run_to_close)
        if self._bus.state == "running":
            raise TrainbusError("close(): the bus runs in an event loop (`async with trainer` "
                                "or `async with trainer.bus`); leave that block, which closes "
                                "it, or `await trainer.aclose()` after it")  # fmt: skip
        if not self.closed:
            with anyio.from_thread.start_blocking_portal(self._backend) as temporary:
                temporary.call(self._run_to_close)

    def call(self, fn: Callable[[], Awaitable[_T]], backend: str, name: str) -> _T:
        """``fn()`` (a trainer call) through the ``with trainer:`` portal, or one of its own."""
        if backend not in BACKENDS:
            raise ConfigError.invalid("backend", backend, f"one of {BACKENDS}")
        if self._portal is not None:
            if backend != self._backend:
                raise ConfigError.invalid("backend", backend, f"{self._backend!r}, the backend "
                                          "`with trainer:` runs")  # fmt: skip
            return portal_call(self._portal, fn)
        if self._bus.state == "running":
            raise TrainbusError(
                f"{name}_sync(): the trainer's bus runs in an event loop already (a fit() "
                "running, `async with trainer` or `async with trainer.bus`); there, `await "
                f"trainer.{name}(...)`{DURING_FIT}"
            )
        self.check_open(f"{name}()")
        self._backend = backend  # close() closes the bus on the backend it ran on
        with anyio.from_thread.start_blocking_portal(backend) as portal:
            return portal_call(portal, fn)

    async def aenter(self) -> None:
        self._check_enter("async with trainer")
        await self._bus.__aenter__()

    async def aexit(self, exc_type: type[BaseException] | None) -> None:
        try:
            await self._bus.__aexit__(exc_type, None, None)
        finally:
            self._end_thread()

    async def aclose(self) -> None:
        """Close a bus that does not run, then end the training thread. Idempotent."""
        if self.closed:
            self._end_thread()
            return
        if self._bus.state == "running" or self._portal is not None:
            raise TrainbusError("aclose(): the bus runs in a `with` or `async with` block; "
                                "leaving it closes the bus")  # fmt: skip
        try:
            await self._run_to_close()
        finally:
            self._end_thread()

    async def _run_to_close(self) -> None:
        async with self._bus:
            pass

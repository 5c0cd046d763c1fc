"""What every driver (``trainbus launch``, :mod:`trainbus.ray`) does alike: the user's callbacks
on the driver's bus, the run's link and token, a graceful stop on a signal, how the workers
ended."""

from __future__ import annotations

import abc
import secrets
import signal
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from functools import partial
from typing import Any, Generic, TypeVar

import anyio
import anyio.abc

from . import commands as cmd
from ._bus import EventBus
from ._distributed.driver_link import DriverLink
from ._exceptions import ConfigError, LaunchError
from ._log import get_logger
from ._signals import OnSignal, check_on_signal, not_ignored
from ._trainer.added import hook_methods, instance
from ._validate import check_int, check_seconds, unknown_keyword_message
from .callbacks._base import Callback

__all__ = [
    "DriverBase",
    "add_driver_callback",
    "unknown_launcher_keyword",
]

log = get_logger(__name__)

R = TypeVar("R")


def add_driver_callback(bus: EventBus, callback: Callback | type[Callback]) -> None:
    """Subscribe a callback's ``on_*`` methods (and its ``setup``) to a driver's bus;
    ``ConfigError`` for one with ``hook_*`` methods (they run on the workers' training thread)."""
    cb = instance(callback)
    hooks_map = hook_methods(cb)
    if hooks_map:
        raise ConfigError.invalid(
            "callbacks",
            cb,
            "callbacks without hook_* methods (hooks change the step on the "
            f"training thread, which is in the workers: {sorted(hooks_map)})",
        )
    cb.subscribe_to(bus)


def unknown_launcher_keyword(owner: str) -> Callable[[str, Any, list[str]], str]:
    """The message for an unknown keyword of a launcher (``handle_signals``: ``on_signal``)."""

    def message(name: str, value: Any, known: list[str]) -> str:
        hint = None
        if name == "handle_signals":
            hint = "on_signal=None (no handler)" if value is False else "on_signal='return'"
        return unknown_keyword_message(owner, name, known, hint)

    return message


class DriverBase(abc.ABC, Generic[R]):
    """The part of a launcher that does not depend on how the workers run: the bus, the link
    to rank 0, the signals. A subclass runs them in :meth:`launch`, ends them in
    :meth:`_abort`."""

    def __init__(
        self,
        *,
        callbacks: Iterable[Callback | type[Callback]],
        setup: Callable[[EventBus], Any] | None,
        bus: EventBus | None,
        stop_timeout: float,
        keep_events: int,
        on_signal: OnSignal | None,
    ) -> None:
        if setup is not None and not callable(setup):
            raise ConfigError.invalid("setup", setup, "None or a function of the bus")
        self.stop_timeout = check_seconds("stop_timeout", stop_timeout)
        self.keep_events = check_int("keep_events", keep_events, 0)
        self.on_signal = check_on_signal(on_signal)
        self.bus = bus if bus is not None else EventBus()
        for cb in callbacks:
            add_driver_callback(self.bus, cb)
        if setup is not None:
            setup(self.bus)
        self._token = secrets.token_urlsafe(32)
        self._link: DriverLink | None = None
        self._signal: int | None = None  # the first signal the driver received
        self._stop_reason: str | None = None

    @property
    def refused(self) -> int:
        """Links refused so far (wrong token, or a second link)."""
        return 0 if self._link is None else self._link.refused

    @property
    def stop_reason(self) -> str | None:
        """Why the workers stopped: their own ``FitEnded.stop_reason`` once it arrived, else
        the reason this driver asked them to stop with (``"signal"``), else None."""
        ended = None if self._link is None else self._link.ended
        if ended is not None and ended.reason != "completed":
            return ended.stop_reason or self._stop_reason
        return self._stop_reason

    def stop(self, reason: str = "requested") -> None:
        """Ask the workers to stop gracefully: ``StopTraining(reason)`` to rank 0 (applied by
        every rank at the next sync point). Safe from the event loop only."""
        self._stop_reason = reason
        self.bus.send(cmd.StopTraining(reason=reason))

    def run(self, *, backend: str = "asyncio") -> R:
        """Synchronous twin of :meth:`launch`: ``anyio.run(self.launch, backend=backend)``."""
        return anyio.run(self.launch, backend=backend)

    @abc.abstractmethod
    async def launch(self) -> R:
        """Start the workers, serve rank 0's link, and wait until they end."""

    def _open_link(self, *, relink: bool = False) -> DriverLink:
        """The run's link; ``LaunchError`` on a second launch."""
        if self._link is not None:
            raise LaunchError(f"a {type(self).__name__} launches once; build a new one")
        self._link = DriverLink(self.bus, self._token, keep_events=self.keep_events, relink=relink)
        return self._link

    def _serve(
        self,
        tg: anyio.abc.TaskGroup,
        link: DriverLink,
        serve: Callable[[DriverLink], Coroutine[Any, Any, None]],
        send: Callable[[bytes], Awaitable[None]],
    ) -> None:
        """Start the transport's ``serve``, the commands' forwarding (a driver subscriber that
        fails the run stops the workers) and, on the main thread, the signal watcher."""
        tg.start_soon(serve, link)
        on_failure = partial(tg.start_soon, self._abort_after, self.stop_timeout)
        tg.start_soon(partial(link.forward, send, on_failure=on_failure))
        if self.on_signal is not None and threading.current_thread() is threading.main_thread():
            tg.start_soon(self._watch_signals, tg)

    async def _drain(self, link: DriverLink, tg: anyio.abc.TaskGroup) -> None:
        """The workers are done: take the last events still in transit, deliver, stop serving."""
        if link.linked:
            await link.wait_unlinked(5)
        await self.bus.wait_delivered(5)
        tg.cancel_scope.cancel()

    def _outcome(self) -> dict[str, Any]:
        """The fields a :class:`~trainbus.LaunchResult` and a ``LaunchError`` share."""
        link = self._link
        assert link is not None
        return {
            "events": link.events,
            "received": link.received,
            "last_event": link.last_event,
            "stop_reason": self.stop_reason,
            "signal": self._signal,
            "ending": None if link.ended is None else link.ended.ending,
        }

    def _so_far(self) -> str:
        """``after N events from rank 0 (last: X at step S)``."""
        assert self._link is not None
        last = self._link.last_event
        name = type(last).__name__ if last else None
        return (
            f"after {self._link.received} events from rank 0 (last: {name} at step "
            f"{last.step if last else '?'})"
        )

    def _raise_if_interrupted(self) -> None:
        """What ``on_signal="raise"`` raises once the workers stopped after a signal."""
        if self._signal is None or self.on_signal != "raise":
            return
        signum = signal.Signals(self._signal)
        note = f"trainbus: {signum.name} stopped the workers gracefully; on_signal='return' returns"
        exc = KeyboardInterrupt() if signum == signal.SIGINT else SystemExit(128 + int(signum))
        exc.add_note(note + " the LaunchResult instead")
        raise exc

    async def _watch_signals(self, tg: anyio.abc.TaskGroup) -> None:
        """The first signal stops the workers gracefully (ended after ``stop_timeout``); a
        second one, or one before rank 0 linked, ends them at once."""
        signums = not_ignored()  # an ignored one stays ignored (a script's background job)
        if not signums:
            await anyio.sleep_forever()
        with anyio.open_signal_receiver(*signums) as signals:
            async for signum in signals:
                if self._signal is None:
                    self._signal = int(signum)
                if self._stop_reason == "signal" or self._link is None or not self._link.linked:
                    log.warning("launch_aborted", signal=signum)
                    self._stop_reason = "signal"
                    await self._abort()
                    continue
                log.warning("launch_stopping", signal=signum, timeout=self.stop_timeout)
                self.stop("signal")
                tg.start_soon(self._abort_after, self.stop_timeout)

    async def _abort_after(self, seconds: float) -> None:
        await anyio.sleep(seconds)
        await self._abort()

    @abc.abstractmethod
    async def _abort(self) -> None:
        """End the workers now (each launcher ends its own kind of worker)."""

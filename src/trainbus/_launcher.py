"""The launchers: a training script under torchrun (or, in :mod:`trainbus.ray`, Ray's workers),
its rank 0 linked to this process' bus, where the subscribers run (docs/distributed.md, "The
launcher")."""

from __future__ import annotations

import abc
import contextlib
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Generic, TypeVar

import anyio
import anyio.abc

from . import commands as cmd
from . import events as ev
from ._bus import EventBus
from ._distributed.driver_link import DriverLink
from ._distributed.protocol import ADDR_ENV, TOKEN_ENV
from ._distributed.socket_link import SocketDriver
from ._exceptions import ConfigError, LaunchError
from ._log import get_logger
from ._signals import OnSignal, check_on_signal, not_ignored
from ._trainer.added import hook_methods, instance
from ._validate import check_int, check_seconds, explains_unknown_keywords, unknown_keyword_message
from .callbacks._base import Callback

__all__ = [
    "DriverBase",
    "LaunchResult",
    "Launcher",
    "add_driver_callback",
    "launch",
    "unknown_launcher_keyword",
]

log = get_logger(__name__)
R = TypeVar("R")

_TORCHRUN_ADDRESSING = (
    "--master_port",
    "--master-port",
    "--master_addr",
    "--master-addr",
    "--rdzv",
    "--standalone",
    "--nnodes",
)

# torchrun's failure summary on stderr: one block per failed rank, the first failure last,
# under "Root Cause"; a rank line pairs only with the exitcode line right under it.
_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)\s*$")
_EXITCODE = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)\b")
_ROOT = re.compile(r"^\s*Root Cause\b")
_SIGNALS = {s.value: s.name for s in signal.Signals}


@dataclass(frozen=True, slots=True, kw_only=True)
class RankExit:
    """One failed rank, as torchrun reported it (a negative ``exitcode``: killed by that
    signal; ``root_cause``: the first failure, not a rank torchrun stopped)."""

    rank: int
    local_rank: int
    exitcode: int
    root_cause: bool

    @property
    def signal(self) -> str | None:
        """The name of the signal that killed it (``"SIGKILL"``), or None."""
        return _SIGNALS.get(-self.exitcode) if self.exitcode < 0 else None

    def describe(self) -> str:
        """``rank 1 exited with code -9 (SIGKILL)``."""
        name = f" ({self.signal})" if self.signal else ""
        return f"rank {self.rank} exited with code {self.exitcode}{name}"


class RankExits:
    """Reads torchrun's standard error line by line and keeps every rank's failure block."""

    def __init__(self) -> None:
        self._exits: list[RankExit] = []
        self._pending: tuple[int, int] | None = None
        self._in_root = False

    def feed(self, line: str) -> None:
        """Read one line of torchrun's standard error (with or without its newline)."""
        if _ROOT.match(line):
            self._in_root = True
            return
        rank = _RANK.match(line)
        if rank:
            self._pending = (int(rank.group(1)), int(rank.group(2)))
            return
        pending, self._pending = self._pending, None
        code = _EXITCODE.match(line)
        if pending is not None and code:
            self._exits.append(
                RankExit(
                    rank=pending[0],
                    local_rank=pending[1],
                    exitcode=int(code.group(1)),
                    root_cause=self._in_root,
                )
            )

    @property
    def exits(self) -> tuple[RankExit, ...]:
        """Every failed rank torchrun reported, in its order (the root cause last)."""
        return tuple(self._exits)

    @property
    def root_cause(self) -> RankExit | None:
        """torchrun's ``Root Cause`` block, else the only block, else None."""
        roots = [e for e in self._exits if e.root_cause]
        if roots:
            return roots[-1]
        return self._exits[0] if len(self._exits) == 1 else None


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchResult:
    """How a launch ended (returned when torchrun exited 0); its fields are
    :class:`~trainbus.LaunchError`'s of the same names.

    Attributes:
        returncode: torchrun's exit status (0).
        events: The last events rank 0 streamed (oldest first; at most ``keep_events``).
        received: How many events rank 0 streamed in all.
        last_event: The last of them (``FitEnded`` for a run that ended normally).
        stop_reason: The workers' ``FitEnded.stop_reason`` when they stopped, else None.
        ending: How rank 0's run ended (:class:`~trainbus.events.Ending`), None when its
            ``FitEnded`` never arrived.
        signal: The signal the driver received (SIGINT or SIGTERM), None: none.
    """

    returncode: int
    events: tuple[ev.BaseEvent, ...]
    received: int
    last_event: ev.BaseEvent | None
    stop_reason: str | None = None
    ending: ev.Ending | None = None
    signal: int | None = None


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
    """What every launcher (torchrun's, Ray's) does alike: the driver's bus, the link to rank
    0 and its token, the signals; a subclass runs the workers in :meth:`launch`."""

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


class Launcher(DriverBase[LaunchResult]):
    """Runs ``script`` under torchrun; rank 0's events feed this process' :attr:`bus`.

    Args:
        script: The training script (a path; run as ``torchrun ... script args``).
        *args: The script's arguments.
        nproc_per_node: Worker processes (torchrun's ``--nproc_per_node``).
        torchrun_args: More torchrun options; without an addressing one ``--standalone`` is
            added (a free port).
        callbacks: Callbacks set up on the driver's bus (instances or classes).
        setup: A function of the bus, called once before the launch (subscriptions, operators).
        bus: The driver's bus (default: a new :class:`~trainbus.EventBus`).
        stop_timeout: Seconds from a Ctrl-C's ``StopTraining`` to terminating the workers.
        connect_timeout: Seconds a connection has to present the token.
        keep_events: How many of the last events a result or error carries.
        python: The interpreter running torchrun (default: this one).
        on_signal: As the Trainer's: SIGINT/SIGTERM on the main thread stop the workers
            gracefully; then ``"return"`` (default) returns the :class:`LaunchResult` (its
            ``signal`` set), ``"raise"`` raises ``KeyboardInterrupt`` for SIGINT,
            ``SystemExit(143)`` for SIGTERM. None: no handler.

    Raises:
        ConfigError: a bad argument, naming it.
        TypeError: an unknown keyword (``handle_signals``: naming ``on_signal``).
    """

    @explains_unknown_keywords(unknown_launcher_keyword("Launcher"))
    def __init__(
        self,
        script: str | os.PathLike[str],
        *args: str,
        nproc_per_node: int = 1,
        torchrun_args: Sequence[str] = (),
        callbacks: Iterable[Callback | type[Callback]] = (),
        setup: Callable[[EventBus], Any] | None = None,
        bus: EventBus | None = None,
        stop_timeout: float = 60.0,
        connect_timeout: float = 10.0,
        keep_events: int = 100,
        python: str | None = None,
        on_signal: OnSignal | None = "return",
    ) -> None:
        path = Path(script)
        if not path.is_file():
            raise ConfigError.invalid("script", os.fspath(script), "an existing Python file")
        self.script = path
        if not all(isinstance(a, str) for a in args):
            raise ConfigError.invalid("args", args, "strings (the script's command line)")
        self.args = tuple(args)
        self.nproc_per_node = check_int("nproc_per_node", nproc_per_node, 1)
        if isinstance(torchrun_args, str) or not all(isinstance(a, str) for a in torchrun_args):
            raise ConfigError.invalid("torchrun_args", torchrun_args, "a sequence of strings")
        self.torchrun_args = tuple(torchrun_args)
        super().__init__(
            callbacks=callbacks,
            setup=setup,
            bus=bus,
            stop_timeout=stop_timeout,
            keep_events=keep_events,
            on_signal=on_signal,
        )
        self.connect_timeout = check_seconds("connect_timeout", connect_timeout)
        self.python = python or sys.executable
        self._stderr: deque[str] = deque(maxlen=40)
        self._exits = RankExits()
        self._process: anyio.abc.Process | None = None

    def command_line(self) -> list[str]:
        """The torchrun command this launcher runs."""
        addressed = any(a.startswith(_TORCHRUN_ADDRESSING) for a in self.torchrun_args)
        extra = [] if addressed else ["--standalone"]
        nproc = f"--nproc_per_node={self.nproc_per_node}"
        return [
            self.python,
            "-m",
            "torch.distributed.run",
            *extra,
            *self.torchrun_args,
            nproc,
            str(self.script),
            *self.args,
        ]

    async def launch(self) -> LaunchResult:
        """Start torchrun, serve rank 0's link, and wait until the workers exit.

        Returns:
            The :class:`LaunchResult` when torchrun exits 0.

        Raises:
            LaunchError: torchrun exited non-zero (a worker died or failed, the script failed
                to import), naming the exit code, the events that arrived and stderr's tail.
            Exception: a driver subscriber with ``on_error="raise"`` failed: its own exception
                (the workers are stopped first).
        """
        link = self._open_link()
        driver = await SocketDriver.listen(connect_timeout=self.connect_timeout)
        env = dict(os.environ) | {ADDR_ENV: driver.address, TOKEN_ENV: self._token}
        returncode: int | None = None
        try:
            async with self.bus:
                try:
                    process = self._process = await anyio.open_process(
                        self.command_line(),
                        env=env,
                        stdin=subprocess.DEVNULL,
                        stdout=None,
                        stderr=subprocess.PIPE,
                        start_new_session=True,
                    )
                except OSError as exc:
                    raise LaunchError(f"cannot start torchrun with {self.python!r}: {exc}") from exc
                log.info(
                    "launch_started",
                    pid=process.pid,
                    nproc_per_node=self.nproc_per_node,
                    script=str(self.script),
                )
                assert process.stderr is not None
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._pump_stderr, process.stderr)
                    self._serve(tg, link, driver.serve, driver.send)
                    returncode = await process.wait()
                    await self._drain(link, tg)
        finally:
            with anyio.CancelScope(shield=True):
                await driver.aclose()
                await self._abort()
        if returncode != 0:
            raise self._failure(returncode)
        self._raise_if_interrupted()
        return LaunchResult(returncode=returncode, **self._outcome())

    # ------------------------------------------------------------------ tasks
    def _failure(self, returncode: int | None) -> LaunchError:
        assert self._link is not None
        if not self._link.linked:
            what = (
                "before rank 0 linked to the driver (did the script fail to import, or "
                "never attach a WorkerLink?)"
            )
        else:
            what = self._so_far()
        first: RankExit | None = self._exits.root_cause
        if first is not None:
            what += f"; {first.describe()}"
            others = [e.describe() for e in self._exits.exits if e is not first]
            if others:
                what += f" (first; then {', '.join(others)})"
        return LaunchError(
            f"the workers failed: torchrun exited with code {returncode} {what}",
            returncode=returncode,
            stderr="".join(self._stderr),
            rank=first.rank if first else None,
            rank_exitcode=first.exitcode if first else None,
            rank_signal=first.signal if first else None,
            **self._outcome(),
        )

    async def _pump_stderr(self, stream: anyio.abc.ByteReceiveStream) -> None:
        # Passed through to our stderr, the tail kept for errors.
        pending = ""
        async for chunk in stream:
            text = chunk.decode(errors="replace")
            sys.stderr.write(text)
            pending += text
            *lines, pending = pending.split("\n")
            for line in lines:
                self._exits.feed(line)
                self._stderr.append(line + "\n")
        if pending:
            self._exits.feed(pending)
            self._stderr.append(pending)

    async def _abort(self) -> None:
        """SIGTERM torchrun's process group (torchrun forwards it to the workers), then
        SIGKILL whatever is left after a grace period."""
        process = self._process
        if process is None:
            return
        for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                return
            with anyio.move_on_after(grace):
                await process.wait()
                # torchrun is gone; its workers may not be (a SIGKILLed torchrun forwards
                # nothing): the group still names them.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, 0)
                continue
            return


def launch(
    script: str | os.PathLike[str],
    *args: str,
    backend: str = "asyncio",
    **kwargs: Any,
) -> LaunchResult:
    """Run ``script`` under torchrun with the subscribers in this process: a
    :class:`Launcher` (same arguments) run to the end.

    Returns:
        The :class:`LaunchResult`.

    Raises:
        ConfigError: a bad argument.
        LaunchError: the workers failed (see :meth:`Launcher.launch`).
    """
    return Launcher(script, *args, **kwargs).run(backend=backend)

"""The launcher: run a training script under torchrun while the subscribers run in the driver.

::

    trainbus.launch("train.py", "--lr", "0.1", nproc_per_node=2, callbacks=[MyCallback()])

    driver (this process)                           torchrun --nproc_per_node=2 train.py ...
    ┌────────────────────────────────┐  events   ┌───────────────────────────────────────┐
    │ EventBus: the user's callbacks,│ ◄──────── │ rank 0: WorkerLink (its bus' events)  │
    │ async subscribers, request(),  │  commands │ rank 1..: no link; the command        │
    │ operators                      │ ────────► │ agreement spreads rank 0's commands   │
    └────────────────────────────────┘ 127.0.0.1 └───────────────────────────────────────┘

Security model: the driver listens on 127.0.0.1 only, on an ephemeral port, and hands the
workers a per-run random token (``TRAINBUS_DRIVER_TOKEN``) in their environment; a connection
that does not present it first is refused and logged. Only JSON records cross (see
:mod:`trainbus.wire`): never pickles, never code, so callbacks stay in the driver
with their arguments and closures.

Event order in the driver is rank 0's publication order. A worker that dies ends the launch
with a :class:`~trainbus.LaunchError` (torchrun's exit code, the last events, the stderr tail);
Ctrl-C (or SIGTERM) sends ``StopTraining(reason="signal")`` to the workers (they stop after the
current step and write their final checkpoint), and after ``stop_timeout`` terminates them; a
second Ctrl-C terminates at once. Nothing is left running: torchrun runs in its own process
group, which is killed if it outlives the launch.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
from anyio.streams.buffered import BufferedByteReceiveStream

from . import commands as cmd
from . import events as ev
from . import wire
from ._exceptions import ConfigError, LaunchError
from ._log import get_logger
from ._validate import check_int, check_seconds
from .bus import EventBus
from .callbacks._base import Callback
from .distributed.exits import RankExit, RankExits
from .distributed.link import ADDR_ENV, TOKEN_ENV, control_record

__all__ = ["LaunchResult", "Launcher", "launch"]

log = get_logger(__name__)

_MAX_LINE = 16 * 1024 * 1024  # one event record; a bigger one is a broken peer
# Cheap (not per step) and what a failure report names, streamed even with no subscriber for them;
# every other type only when a driver subscriber wants it (the loop never builds unwanted ones).
_ALWAYS = frozenset({ev.FitStarted, ev.FitEnded, ev.EpochStarted, ev.EpochEnded,
                     ev.EvaluationEnded, ev.CheckpointSaved, ev.MetricsLogged,
                     ev.CommandApplied})  # fmt: skip
_TORCHRUN_ADDRESSING = ("--master_port", "--master-port", "--master_addr", "--master-addr",
                        "--rdzv", "--standalone", "--nnodes")  # fmt: skip


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchResult:
    """How a launch ended (returned when torchrun exited 0). The fields it shares with
    :class:`~trainbus.LaunchError` are named and typed alike.

    Attributes:
        returncode: torchrun's exit status (0).
        events: The last events rank 0 streamed to the driver (oldest first; at most the
            launcher's ``keep_events``).
        received: How many events rank 0 streamed to the driver in all.
        last_event: The last of them (``FitEnded`` for a run that ended normally).
        stop_reason: The workers' own reason when they stopped (their ``FitEnded.stop_reason``:
            ``"signal"`` after Ctrl-C/SIGTERM, a driver command's reason), else None.
        ending: How rank 0's run ended, typed (:class:`~trainbus.Ending`: ``SIGNAL`` after
            Ctrl-C/SIGTERM, ``PRUNED``, ``STOPPED``...), None when its ``FitEnded`` never
            arrived.
        signal: The signal the driver received (SIGINT or SIGTERM), None: none.
    """

    returncode: int
    events: tuple[ev.BaseEvent, ...]
    received: int
    last_event: ev.BaseEvent | None
    stop_reason: str | None = None
    ending: ev.Ending | None = None
    signal: int | None = None


class Launcher:
    """Runs ``script`` under torchrun; rank 0's events feed this process' :attr:`bus`.

    Args:
        script: The training script (a path; run as ``torchrun ... script args``).
        *args: The script's arguments.
        nproc_per_node: Worker processes (torchrun's ``--nproc_per_node``).
        torchrun_args: More torchrun options (``["--master_port=29501"]``); without any
            addressing option (master, rendezvous, nnodes) ``--standalone`` is added, which
            picks a free port.
        callbacks: Callbacks set up on the driver's bus (instances or classes).
        setup: A function of the bus, called once before the launch (subscriptions, operators).
        bus: The driver's bus (default: a new :class:`~trainbus.EventBus`).
        stop_timeout: Seconds between the graceful ``StopTraining`` of a Ctrl-C and the
            termination of the workers.
        connect_timeout: Seconds a connection has to present the token.
        keep_events: How many of the last events a :class:`LaunchResult` or
            :class:`~trainbus.LaunchError` carries (``events``; ``received`` counts them all).
        python: The interpreter running torchrun (default: this one).
        handle_signals: Turn SIGINT/SIGTERM into a graceful stop (main thread only).

    Raises:
        ConfigError: a bad argument, naming it.
    """

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
        handle_signals: bool = True,
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
        if setup is not None and not callable(setup):
            raise ConfigError.invalid("setup", setup, "None or a function of the bus")
        self.stop_timeout = check_seconds("stop_timeout", stop_timeout)
        self.connect_timeout = check_seconds("connect_timeout", connect_timeout)
        self.keep_events = check_int("keep_events", keep_events, 0)
        self.python = python or sys.executable
        self.handle_signals = bool(handle_signals)
        self.bus = bus if bus is not None else EventBus()
        for cb in callbacks:
            self._attach(cb)
        if setup is not None:
            setup(self.bus)
        self._token = secrets.token_urlsafe(32)
        self._events: deque[ev.BaseEvent] = deque(maxlen=max(self.keep_events, 1))
        self._count = 0
        self._stderr: deque[str] = deque(maxlen=40)
        self._exits = RankExits()
        self._ended: ev.FitEnded | None = None
        self._signal: int | None = None  # the first signal the driver received
        self._link: anyio.abc.SocketStream | None = None
        self._linked: anyio.Event | None = None
        self._link_done: anyio.Event | None = None
        self._inflight: list[cmd.Command] = []
        self._outbox: list[cmd.Command] = []
        self._stop_reason: str | None = None
        self._refused = 0
        self._process: anyio.abc.Process | None = None

    def _attach(self, callback: Callback | type[Callback]) -> None:
        # As Trainer.add_callback, minus the hooks: those run on a training thread, and there
        # is none in the driver.
        cb = callback() if isinstance(callback, type) and issubclass(callback, Callback) else (
            callback
        )
        if not isinstance(cb, Callback):
            raise ConfigError.invalid("callbacks", callback, "Callback subclasses or instances")
        _, hooks_map = type(cb).methods()
        if hooks_map:
            raise ConfigError.invalid(
                "callbacks", cb, "callbacks without hook_* methods (hooks change the step on the "
                f"training thread, which is in the workers: {sorted(hooks_map)})",
            )  # fmt: skip
        cb.subscribe_to(self.bus)

    # ------------------------------------------------------------------ queries
    @property
    def refused(self) -> int:
        """Connections refused so far (wrong token, or a second link)."""
        return self._refused

    def command_line(self) -> list[str]:
        """The torchrun command this launcher runs."""
        addressed = any(a.startswith(_TORCHRUN_ADDRESSING) for a in self.torchrun_args)
        extra = [] if addressed else ["--standalone"]
        nproc = f"--nproc_per_node={self.nproc_per_node}"
        return [self.python, "-m", "torch.distributed.run", *extra, *self.torchrun_args, nproc,
                str(self.script), *self.args]  # fmt: skip

    # ------------------------------------------------------------------ control
    def stop(self, reason: str = "requested") -> None:
        """Ask the workers to stop gracefully: ``StopTraining(reason)`` to rank 0 (applied by
        every rank at the next sync point). Safe from the event loop only."""
        self._stop_reason = reason
        self.bus.send(cmd.StopTraining(reason=reason))

    def run(self, *, backend: str = "asyncio") -> LaunchResult:
        """Synchronous twin of :meth:`launch`: ``anyio.run(self.launch, backend=backend)``."""
        return anyio.run(self.launch, backend=backend)

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
        if self._linked is not None:
            raise LaunchError("a Launcher launches once; build a new one")
        self._linked, self._link_done = anyio.Event(), anyio.Event()
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
        port = listener.listeners[0].extra(anyio.abc.SocketAttribute.local_port)
        env = dict(os.environ) | {ADDR_ENV: f"127.0.0.1:{port}", TOKEN_ENV: self._token}
        returncode: int | None = None
        try:
            async with self.bus:
                try:
                    process = self._process = await anyio.open_process(
                        self.command_line(), env=env, stdin=subprocess.DEVNULL, stdout=None,
                        stderr=subprocess.PIPE, start_new_session=True,
                    )  # fmt: skip
                except OSError as exc:
                    raise LaunchError(f"cannot start torchrun with {self.python!r}: {exc}") from exc
                log.info("launch_started", pid=process.pid, nproc_per_node=self.nproc_per_node,
                         script=str(self.script))  # fmt: skip
                assert process.stderr is not None
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._pump_stderr, process.stderr)
                    tg.start_soon(listener.serve, self._handle, tg)
                    tg.start_soon(self._forward_commands, tg)
                    main = threading.current_thread() is threading.main_thread()
                    if self.handle_signals and main:
                        tg.start_soon(self._watch_signals, tg)
                    returncode = await process.wait()
                    if self._linked.is_set():  # the last events still in the socket
                        assert self._link_done is not None
                        with anyio.move_on_after(5):
                            await self._link_done.wait()
                    await self.bus.wait_delivered(5)
                    tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await listener.aclose()
                await self._terminate()
        if returncode != 0:
            raise self._failure(returncode)
        return LaunchResult(returncode=returncode, events=self._kept(), received=self._count,
                            last_event=self._events[-1] if self._events else None,
                            stop_reason=self.stop_reason, signal=self._signal,
                            ending=None if self._ended is None
                            else self._ended.ending)  # fmt: skip

    @property
    def stop_reason(self) -> str | None:
        """Why the workers stopped: their own ``FitEnded.stop_reason`` once it arrived, else
        the reason this driver asked them to stop with (``"signal"``), else None."""
        if self._ended is not None and self._ended.reason != "completed":
            return self._ended.stop_reason or self._stop_reason
        return self._stop_reason

    def _kept(self) -> tuple[ev.BaseEvent, ...]:
        return tuple(self._events) if self.keep_events else ()

    # ------------------------------------------------------------------ tasks
    def _failure(self, returncode: int | None) -> LaunchError:
        last = self._events[-1] if self._events else None
        if self._linked is None or not self._linked.is_set():
            what = ("before rank 0 linked to the driver (did the script fail to import, or "
                    "never attach a WorkerLink?)")  # fmt: skip
        else:
            what = (f"after {self._count} events from rank 0 "
                    f"(last: {type(last).__name__ if last else None} at step "
                    f"{last.step if last else '?'})")  # fmt: skip
        # torchrun's summary: the first failed rank with its own exit code (-9: SIGKILL), and
        # the ranks torchrun then stopped (-15: its SIGTERM), each block read on its own.
        first: RankExit | None = self._exits.root_cause
        if first is not None:
            what += f"; {first.describe()}"
            others = [e.describe() for e in self._exits.exits if e is not first]
            if others:
                what += f" (first; then {', '.join(others)})"
        return LaunchError(
            f"the workers failed: torchrun exited with code {returncode} {what}",
            returncode=returncode, events=self._kept(), received=self._count,
            last_event=last, stop_reason=self.stop_reason, stderr="".join(self._stderr),
            rank=first.rank if first else None, rank_exitcode=first.exitcode if first else None,
            rank_signal=first.signal if first else None,
        )  # fmt: skip

    async def _pump_stderr(self, stream: anyio.abc.ByteReceiveStream) -> None:
        # Passed through to our stderr (the user sees the workers), the tail kept for errors.
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

    async def _handle(self, stream: anyio.abc.SocketStream) -> None:
        peer = stream.extra(anyio.abc.SocketAttribute.remote_address, None)
        reader = BufferedByteReceiveStream(stream)
        try:
            with anyio.fail_after(self.connect_timeout):
                hello = json.loads(await reader.receive_until(b"\n", 4096))
        except (TimeoutError, ValueError, anyio.IncompleteRead, anyio.DelimiterNotFound,
                anyio.EndOfStream, OSError, anyio.BrokenResourceError):  # fmt: skip
            hello = None
        token = hello.get("token") if isinstance(hello, dict) else None
        reason = None
        if not isinstance(token, str) or not hmac.compare_digest(token, self._token):
            reason = "wrong token"
        elif self._link is not None:
            reason = "a worker is already linked"
        if reason is not None:
            self._refused += 1
            log.warning("driver_connection_refused", peer=str(peer), reason=reason)
            await stream.aclose()
            return
        wanted = [t.__name__ for t in ev.EVENT_TYPES if t in _ALWAYS or self.bus.wants(t)]
        await stream.send(control_record("welcome", events=wanted))
        assert self._linked is not None and self._link_done is not None
        self._link = stream
        self._linked.set()
        log.info("driver_linked", peer=str(peer), pid=hello.get("pid") if hello else None)
        try:
            while True:
                line = await reader.receive_until(b"\n", _MAX_LINE)
                self._receive(line)
                if self._count % 256 == 0:
                    # Driver subscribers behind: stop reading, so TCP holds rank 0's sender
                    # back instead of this process' memory growing without bound. (Polled: the
                    # bus has no "room" event for the loop thread.)
                    while self.bus.statistics().queue_depth > self.bus.max_queue:  # noqa: ASYNC110
                        await anyio.sleep(0.01)
        except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError,
                anyio.ClosedResourceError, OSError):  # fmt: skip
            pass
        finally:
            self._link_done.set()
            await stream.aclose()

    def _receive(self, line: bytes) -> None:
        try:
            rec = json.loads(line)
            if isinstance(rec, dict) and rec.get("type") == "bye":
                return
            message = wire.decode(rec)
        except (ValueError, TypeError) as exc:  # ConfigError is a ValueError
            log.warning("driver_record_refused", error=str(exc)[:500])
            return
        if not isinstance(message, ev.BaseEvent):
            log.warning("driver_record_refused", type=rec.get("type"))
            return
        if isinstance(message, ev.CommandApplied):
            # request() resolves by identity: hand back the driver's own command object.
            for i, sent in enumerate(self._inflight):
                if sent == message.command:
                    message = replace(message, command=self._inflight.pop(i))
                    break
        if isinstance(message, ev.FitEnded):
            self._ended = message
        self._count += 1
        self._events.append(message)
        self.bus.publish(message)

    async def _forward_commands(self, tg: anyio.abc.TaskGroup) -> None:
        failed = False
        while True:
            await anyio.sleep(0.01)
            self._outbox.extend(self.bus.poll_commands())
            if self.bus.failure is not None and not failed:
                failed = True  # a driver subscriber failed the run: stop the workers
                self._outbox.append(cmd.StopTraining(reason="driver_subscriber_failed"))
                tg.start_soon(self._terminate_after, self.stop_timeout)
            if self._outbox and self._link is not None:
                batch, self._outbox = self._outbox, []
                with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                    await self._link.send(b"".join(wire.dumps(c) for c in batch))
                self._inflight.extend(batch)
                del self._inflight[:-1000]  # acks never coming (a dead worker) must not pile up

    async def _watch_signals(self, tg: anyio.abc.TaskGroup) -> None:
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for signum in signals:
                if self._signal is None:
                    self._signal = int(signum)
                if self._stop_reason == "signal":  # the second one: no more patience
                    log.warning("launch_aborted", signal=signum)
                    await self._terminate()
                    continue
                log.warning("launch_stopping", signal=signum, timeout=self.stop_timeout)
                if self._link is None:
                    self._stop_reason = "signal"
                    await self._terminate()
                else:
                    self.stop("signal")
                    tg.start_soon(self._terminate_after, self.stop_timeout)

    async def _terminate_after(self, seconds: float) -> None:
        await anyio.sleep(seconds)
        await self._terminate()

    async def _terminate(self) -> None:
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
    return anyio.run(partial(Launcher(script, *args, **kwargs).launch), backend=backend)

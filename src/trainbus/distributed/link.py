"""Rank 0's side of the launcher: stream the bus' events to the driver, feed its commands back.

``trainbus launch`` (:mod:`trainbus.launcher`) starts torchrun with two environment variables:
:data:`ADDR_ENV` (``127.0.0.1:<port>``, loopback only) and :data:`TOKEN_ENV` (a per-run random
token). Rank 0 connects, proves the token, and learns which event types the driver's
subscribers want; then::

    rank 0's bus --stream(wanted)--> sender thread --JSON lines--> driver's bus (subscribers)
    rank 0's bus <--bus.send(c)----- reader thread <--JSON lines-- driver's commands

The protocol is JSON lines (:mod:`trainbus.wire` records, plus three control
records): ``{"v":1,"type":"hello","token":...,"rank":0,"pid":...}`` from the worker,
``{"v":1,"type":"welcome","events":[<class names>]}`` from the driver (or the connection is
closed: refused), events from the worker in publication order, commands from the driver, and
``{"v":1,"type":"bye"}`` when the worker closes the link after its run.

Events are encoded on the sender thread (reading a tensor waits for the device: never on the
training thread nor the event loop). The commands the driver sends enter rank 0's bus like any
subscriber's, so the loop's command agreement spreads them to every rank.
"""

from __future__ import annotations

import json
import os
import queue
import socket
import threading
from collections.abc import Mapping
from types import TracebackType
from typing import Any, Protocol, Self

from .. import commands as cmd
from .. import events as ev
from .. import wire
from .._exceptions import ConfigError, LaunchError
from .._log import get_logger
from .._validate import check_seconds

__all__ = ["ADDR_ENV", "TOKEN_ENV", "BusLike", "WorkerLink", "control_record"]

log = get_logger(__name__)

ADDR_ENV = "TRAINBUS_DRIVER_ADDR"
"""Environment variable holding the driver's ``host:port`` (loopback)."""
TOKEN_ENV = "TRAINBUS_DRIVER_TOKEN"
"""Environment variable holding the run's token."""
LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})

_EVENTS: Mapping[str, type[ev.BaseEvent]] = {t.__name__: t for t in ev.EVENT_TYPES}
_CLOSE = object()  # sender-queue sentinel


class BusLike(Protocol):
    """What the link needs of a bus (a :class:`trainbus.EventBus` is one)."""

    def stream(self, *event_types: type[ev.BaseEvent]) -> Any:
        """An observable of those event types."""
        ...

    def send(self, command: cmd.Command) -> None:
        """Put a command on the back-channel; thread-safe."""
        ...


def control_record(kind: str, **fields: Any) -> bytes:
    """One control line of the link protocol (``hello``, ``welcome``, ``bye``)."""
    return (json.dumps({"v": wire.FORMAT_VERSION, "type": kind, **fields}) + "\n").encode()


class WorkerLink:
    """The worker end of the launcher's socket (see the module docstring).

    ::

        link = WorkerLink.from_env()      # None when not launched by `trainbus launch`
        if link is not None and group.is_main:
            link.connect()
            link.attach(bus)              # before the bus publishes its first event
        ... run ...                       # the bus closes: every event was delivered
        link.close()                      # flush, say bye, join the threads

    Args:
        address: The driver's ``host:port``; the host must be a loopback address.
        token: The run's token.
        timeout: Seconds for connecting and the handshake, and for :meth:`close` to flush.

    Raises:
        ConfigError: a malformed or non-loopback address, an empty token, a bad timeout.
    """

    def __init__(self, address: str, token: str, *, timeout: float = 10.0) -> None:
        host, _, port = address.rpartition(":")
        host = host.strip("[]")
        if host not in LOOPBACK or not port.isdigit():
            raise ConfigError.invalid(ADDR_ENV, address, "127.0.0.1:<port> (loopback only)")
        if not isinstance(token, str) or not token:
            raise ConfigError.invalid(TOKEN_ENV, "<empty>", "the run's token")
        self.host, self.port = host, int(port)
        self._token = token
        self.timeout = check_seconds("timeout", timeout)
        self._sock: socket.socket | None = None
        self._wanted: tuple[type[ev.BaseEvent], ...] = ()
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._subscription: Any = None
        self._sent = 0
        self._received = 0
        self._broken = False

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **kw: Any) -> WorkerLink | None:
        """The link described by :data:`ADDR_ENV` / :data:`TOKEN_ENV`, or None when this
        process was not started by the launcher.

        Raises:
            ConfigError: one variable is set without the other, or see :class:`WorkerLink`.
        """
        env = os.environ if env is None else env
        addr, token = env.get(ADDR_ENV), env.get(TOKEN_ENV)
        if addr is None and token is None:
            return None
        if not addr or not token:
            missing = ADDR_ENV if not addr else TOKEN_ENV
            raise ConfigError.invalid(missing, None, "set together with the other variable")
        return cls(addr, token, **kw)

    # ------------------------------------------------------------------ queries
    @property
    def sent(self) -> int:
        """Events written to the driver so far."""
        return self._sent

    @property
    def received(self) -> int:
        """Commands received from the driver so far."""
        return self._received

    # ------------------------------------------------------------------ lifecycle
    def connect(self) -> None:
        """Connect to the driver and prove the token.

        Raises:
            LaunchError: the driver is unreachable, refused the token, or did not answer
                within ``timeout``.
        """
        where = f"{self.host}:{self.port}"
        try:
            sock = socket.create_connection((self.host, self.port), timeout=self.timeout)
        except OSError as exc:
            raise LaunchError(f"cannot reach the trainbus driver at {where}: {exc}") from exc
        try:
            sock.sendall(control_record("hello", token=self._token, rank=0, pid=os.getpid()))
            reply = sock.makefile("rb").readline()
        except OSError as exc:
            sock.close()
            raise LaunchError(f"the trainbus driver at {where} did not answer: {exc}") from exc
        try:
            welcome = json.loads(reply) if reply else {}
        except ValueError:
            welcome = {}
        if welcome.get("type") != "welcome":
            sock.close()
            raise LaunchError(
                f"the trainbus driver at {where} refused this worker's link (wrong "
                f"{TOKEN_ENV}, or another rank already linked)"
            )
        self._wanted = tuple(_EVENTS[n] for n in welcome.get("events", ()) if n in _EVENTS)
        sock.settimeout(None)
        self._sock = sock
        log.debug("driver_linked", address=where, events=len(self._wanted))

    def attach(self, bus: BusLike) -> None:
        """Stream ``bus``' wanted events to the driver and feed the driver's commands into
        ``bus.send``. Connects first when :meth:`connect` was not called.

        Call it before the bus publishes the first event the driver should see.

        Raises:
            LaunchError: see :meth:`connect`; already attached.
        """
        if self._sock is None:
            self.connect()
        if self._threads:
            raise LaunchError("WorkerLink.attach() was already called")
        if self._wanted:
            self._subscription = bus.stream(*self._wanted).subscribe(
                self._queue.put, name="WorkerLink"
            )
        self._threads = [
            threading.Thread(target=self._send_loop, name="trainbus-link-send", daemon=True),
            threading.Thread(
                target=self._read_loop, args=(bus,), name="trainbus-link-read", daemon=True
            ),
        ]
        for t in self._threads:
            t.start()

    def close(self) -> None:
        """Write every queued event, say bye, close the socket and join the threads (each
        bounded by ``timeout``). Idempotent."""
        sock, self._sock = self._sock, None
        if sock is None:
            return
        if self._subscription is not None:
            self._subscription.dispose()
        self._queue.put(_CLOSE)
        if self._threads:
            self._threads[0].join(self.timeout)
        try:
            sock.sendall(control_record("bye", sent=self._sent))
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        sock.close()
        for t in self._threads[1:]:
            t.join(self.timeout)
        log.debug("driver_unlinked", sent=self._sent, received=self._received)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # ------------------------------------------------------------------ threads
    def _send_loop(self) -> None:
        sock = self._sock
        assert sock is not None
        while True:
            item = self._queue.get()
            batch = [item]
            while not self._queue.empty() and len(batch) < 256:  # one write per burst
                batch.append(self._queue.get_nowait())
            done = any(x is _CLOSE for x in batch)
            events = [x for x in batch if x is not _CLOSE]
            if events and not self._broken:
                try:
                    sock.sendall(b"".join(wire.dumps(e) for e in events))
                    self._sent += len(events)
                except OSError as exc:
                    # The driver is gone: it ends the launch itself; training is not ours to
                    # stop from here, so the events are dropped and said so once.
                    self._broken = True
                    log.warning("driver_link_broken", error=repr(exc), sent=self._sent)
            if done:
                return

    def _read_loop(self, bus: BusLike) -> None:
        sock = self._sock
        assert sock is not None
        try:
            for line in sock.makefile("rb"):
                try:
                    message = wire.loads(line)
                except ConfigError as exc:
                    log.warning("driver_record_refused", error=str(exc))
                    continue
                if isinstance(message, cmd.COMMAND_TYPES):
                    self._received += 1
                    bus.send(message)  # type: ignore[arg-type]
        except OSError:
            pass  # closed by close() or by the driver
        except Exception as exc:  # a bus that refuses: never an unhandled thread exception
            log.warning("driver_command_dropped", error=repr(exc))

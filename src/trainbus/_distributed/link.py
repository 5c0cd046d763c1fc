"""The worker's end of the link to a driver (docs/distributed.md, "One link, several
transports"): hello with the token, the driver's welcome naming the wanted events, then event
lines out and command lines in until bye; JSON lines only, never pickles."""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import anyio.from_thread
import anyio.lowlevel

from .. import _wire as wire
from .. import commands as cmd
from .. import events as ev
from .._exceptions import ConfigError, LaunchError
from .._log import get_logger
from .._validate import check_seconds
from .protocol import ADDR_ENV, TOKEN_ENV, control_record, control_types, hello_record
from .socket_link import SocketTransport

__all__ = ["BusLike", "WorkerLink", "WorkerTransport", "register_transport"]

log = get_logger(__name__)

_CLOSE = object()  # sender-queue sentinel
_MAX_BATCH = 4096  # events per transport call


class BusLike(Protocol):
    """What the link needs of a bus (a :class:`trainbus.EventBus` is one)."""

    def stream(self, *event_types: type[ev.BaseEvent]) -> Any: ...

    def send(self, command: cmd.Command) -> None: ...


class WorkerTransport(Protocol):
    """What carries the worker's end of the link (blocking calls, from the link's threads); the
    sender waits ``linger`` seconds after an event for more to join its batch."""

    where: str
    linger: float

    def open(self, hello: bytes) -> bytes:
        """Send the hello line, return the answer (``b""``: refused); ``LaunchError``: no
        driver, or no answer in time."""
        ...

    def send(self, data: bytes) -> None:
        """Write event lines; ``OSError`` once the driver is gone."""
        ...

    def receive(self) -> bytes:
        """Block until whole command lines arrive; ``b""`` once the link is closed."""
        ...

    def close(self, bye: bytes) -> None:
        """Send the bye line (best effort) and close; a blocked :meth:`receive` returns."""
        ...


TransportFactory = Callable[[str, float], WorkerTransport]
_TRANSPORTS: dict[str, TransportFactory] = {}


def register_transport(scheme: str, factory: TransportFactory) -> None:
    """Addresses ``<scheme>:...`` build their transport with ``factory(address, timeout)``
    (others are a loopback ``host:port``); ``ConfigError`` for a scheme not of letters."""
    if not (isinstance(scheme, str) and scheme.isalpha()):
        raise ConfigError.invalid("scheme", scheme, "a word of letters (e.g. 'ray')")
    _TRANSPORTS[scheme] = factory


def _transport_for(address: str, timeout: float) -> WorkerTransport:
    """The worker transport an :data:`ADDR_ENV` value names (``ConfigError`` when malformed)."""
    scheme = address.split(":", 1)[0]
    factory = _TRANSPORTS.get(scheme)
    if factory is not None:
        return factory(address, timeout)
    return SocketTransport(address, timeout)


class WorkerLink:
    """The worker end of the link: :meth:`start` before the bus' first event, :meth:`close`
    after its last was delivered. ``source``: the peer, logged with each command it sends (None:
    a driver); ``on_end``: called from the reader thread when the peer closed the link;
    ``wanted``: the events of an accepted attachment (None: :meth:`start` connects first)."""

    def __init__(
        self,
        transport: WorkerTransport | str,
        token: str,
        *,
        timeout: float = 10.0,
        source: str | None = None,
        on_end: Callable[[], object] | None = None,
        wanted: tuple[type[ev.BaseEvent], ...] | None = None,
    ) -> None:
        self.timeout = check_seconds("timeout", timeout)
        if isinstance(transport, str):
            transport = _transport_for(transport, self.timeout)
        if not isinstance(token, str) or not token:
            raise ConfigError.invalid(TOKEN_ENV, "<empty>", "the run's token")
        self.transport = transport
        self._token = token
        self._open = wanted is not None
        self._closed = False
        self._wanted: tuple[type[ev.BaseEvent], ...] = tuple(wanted or ())
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._subscription: Any = None
        self._bus: BusLike | None = None
        self._loop: Any = None  # the event loop start() ran on: where subscriptions change
        self._sent = 0
        self._received = 0
        self._broken = False
        self.source = source
        self._on_end = on_end

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **kw: Any) -> WorkerLink | None:
        """The link :data:`ADDR_ENV` / :data:`TOKEN_ENV` describe (None: neither is set);
        ``ConfigError`` when only one is set or the address is bad."""
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

    def post(self, line: bytes) -> None:
        """Queue a control line to go out between the events (one writer per transport)."""
        if not self._closed:
            self._queue.put(line)

    @property
    def wanted(self) -> tuple[type[ev.BaseEvent], ...]:
        """The event types the driver asked for (after :meth:`connect`)."""
        return self._wanted

    # ------------------------------------------------------------------ lifecycle
    def connect(self) -> None:
        """The handshake: ``LaunchError`` when the driver is unreachable, refused the token, or
        did not answer in time."""
        where = self.transport.where
        reply = self.transport.open(hello_record(self._token))
        wanted = control_types(reply, "welcome")
        if wanted is None:
            self.transport.close(b"")
            raise LaunchError(
                f"the trainbus driver at {where} refused this worker's link (wrong "
                f"{TOKEN_ENV}, or another rank already linked)"
            )
        self._wanted = wanted
        self._open = True
        log.debug("driver_linked", address=where, events=len(self._wanted))

    def start(self, bus: BusLike) -> None:
        """Stream ``bus``' wanted events and feed the peer's commands into ``bus.send``
        (connecting first if needed); ``LaunchError`` as :meth:`connect`, or already started."""
        if not self._open:
            self.connect()
        if self._threads:
            raise LaunchError("WorkerLink.start() was already called")
        self._bus = bus
        try:
            self._loop = anyio.lowlevel.current_token()
        except RuntimeError:  # no event loop here: a later `wants` record is refused
            self._loop = None
        self._subscribe()
        self._threads = [
            threading.Thread(target=self._send_loop, name="trainbus-link-send", daemon=True),
            threading.Thread(
                target=self._read_loop, args=(bus,), name="trainbus-link-read", daemon=True
            ),
        ]
        for t in self._threads:
            t.start()

    def want(self, wanted: tuple[type[ev.BaseEvent], ...]) -> None:
        """On the event-loop thread: stream ``wanted`` from now on, and tell the peer."""
        if self._closed or self._broken or self._bus is None:
            return
        self.unsubscribe()
        self._wanted = tuple(wanted)
        self._subscribe()
        # Queued after the dispose and before any event of the new subscription: the peer
        # knows from which line on the new set flows.
        self.post(control_record("streams", events=[t.__name__ for t in self._wanted]))

    def _subscribe(self) -> None:
        if self._wanted and self._bus is not None:
            self._subscription = self._bus.stream(*self._wanted).subscribe(
                self._queue.put, name=self.source or "WorkerLink"
            )

    def unsubscribe(self) -> None:
        """On the event-loop thread: stop taking the bus' events (the queued ones still go)."""
        subscription, self._subscription = self._subscription, None
        if subscription is not None:
            subscription.dispose()

    def close(self) -> None:
        """Write every queued event, say bye, close, join the threads; idempotent."""
        if not self._open or self._closed:
            return
        self._closed = True
        self.unsubscribe()
        self._queue.put(_CLOSE)
        if self._threads:
            self._threads[0].join(self.timeout)
        self.transport.close(control_record("bye", sent=self._sent))
        for t in self._threads[1:]:
            if t is not threading.current_thread():  # close() from the reader (peer left)
                t.join(self.timeout)
        log.debug("driver_unlinked", sent=self._sent, received=self._received)

    # ------------------------------------------------------------------ threads
    def _batch(self) -> tuple[list[Any], bool]:
        """The next queued events (``linger`` for more), and whether the close came."""
        batch = [self._queue.get()]
        deadline = time.monotonic() + self.transport.linger
        while batch[-1] is not _CLOSE and len(batch) < _MAX_BATCH:
            left = deadline - time.monotonic()
            try:
                batch.append(self._queue.get(block=left > 0, timeout=left))
            except queue.Empty:
                break
        done = batch[-1] is _CLOSE
        return (batch[:-1] if done else batch), done

    def _send_loop(self) -> None:
        while True:
            events, done = self._batch()
            if events and not self._broken:
                try:
                    self.transport.send(
                        b"".join(e if isinstance(e, bytes) else wire.dumps(e) for e in events)
                    )
                    self._sent += len(events)
                except OSError as exc:
                    # The driver is gone: it ends the launch itself; training is not ours to
                    # stop from here, so the events are dropped and said so once.
                    self._broken = True
                    log.warning("driver_link_broken", error=repr(exc), sent=self._sent)
            if done:
                return

    def _rewant(self, wanted: tuple[type[ev.BaseEvent], ...]) -> None:
        """From the reader thread: the peer's ``wants`` record."""
        if self._closed:
            return  # close() is joining this thread: the loop would not run want() now
        names = [t.__name__ for t in wanted]
        if self._loop is None:
            log.warning(
                "link_wants_refused",
                source=self.source,
                events=names,
                reason="the link was started outside an event loop",
            )
            return
        log.info("link_wants_received", source=self.source, events=names)
        try:
            anyio.from_thread.run_sync(self.want, wanted, token=self._loop)
        except RuntimeError:  # the run's event loop ended: nothing more goes out anyway
            return

    def _read_loop(self, bus: BusLike) -> None:
        try:
            while data := self.transport.receive():
                for line in data.splitlines():
                    try:
                        message = wire.loads(line)
                    except ConfigError as exc:
                        wanted = control_types(line, "wants")
                        if wanted is None:
                            log.warning("driver_record_refused", error=str(exc))
                        else:
                            self._rewant(wanted)
                        continue
                    if isinstance(message, cmd.COMMAND_TYPES):
                        self._received += 1
                        if self.source is not None:
                            log.info(
                                "link_command_received", source=self.source, command=repr(message)
                            )
                        bus.send(message)  # type: ignore[arg-type]
        except Exception as exc:  # a bus that refuses: never an unhandled thread exception
            log.warning("driver_command_dropped", error=repr(exc), source=self.source)
        if not self._closed:
            self._broken = True  # the peer closed its end: nothing more goes out
            if self._on_end is not None:
                self._on_end()

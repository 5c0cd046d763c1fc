"""Attach to a running job: watch its events and steer it from another process (docs/attach.md);
an :class:`Attachment` is the driver's end of :func:`trainbus.launch`'s link protocol."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import stat
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import Any, Self, TypeVar

import anyio
import anyio.abc
import anyio.from_thread
from anyio.streams.buffered import BufferedByteReceiveStream

from . import commands as cmd
from . import events as ev
from ._bus import EventBus
from ._bus.subscriptions import BusObservable, Subscription
from ._distributed.attach_server import SOCKET_NAME, TOKEN_NAME, max_socket_path
from ._distributed.driver_link import STREAM_GONE, DriverLink, wanted_names
from ._distributed.protocol import control_record, control_types, hello_record
from ._distributed.socket_link import read_lines
from ._exceptions import ConfigError, TrainbusError
from ._launcher import add_driver_callback
from ._log import get_logger
from ._validate import check_seconds
from .callbacks._base import Callback

__all__ = ["AttachError", "Attachment", "attach"]

log = get_logger(__name__)
T = TypeVar("T")

_WANTS_POLL_S = 0.01  # how often a connected attachment looks whether its wants changed
_CONTROL = b'{"v": 1, "type": "'  # how a control line starts (wire records are compact)


class AttachError(TrainbusError, ConnectionError):
    """Attaching to a run failed: no running job in the folder, a stale socket, another
    user's folder, a refused token. The message names the folder."""


def _fields(line: bytes) -> dict[str, Any]:
    """A control record's fields, without its version and type."""
    record: dict[str, Any] = json.loads(line)
    record.pop("v", None)
    record.pop("type", None)
    return record


def _refused(folder: Path, why: str) -> AttachError:
    return AttachError(f"cannot attach to {folder}: {why}")


def _owned(path: Path, folder: Path, what: str) -> os.stat_result:
    """``path``'s lstat, when it is this user's."""
    info = os.lstat(path)
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        raise _refused(
            folder,
            f"its {what} belongs to uid {info.st_uid}, not you (uid {os.getuid()}); only the "
            "run's owner may attach",
        )
    return info


def locate(run_dir: str | os.PathLike[str]) -> tuple[str, str]:
    """The socket's path (a symbolic link followed) and the token of the job in ``run_dir``,
    after every check (``AttachError`` naming the one that failed)."""
    folder = Path(run_dir)
    if not hasattr(socket, "AF_UNIX"):
        raise _refused(
            folder, "this platform has no Unix domain sockets (AF_UNIX), which attaching needs"
        )
    if not folder.is_dir():
        raise _refused(folder, "not a folder (a file)" if folder.exists() else "no such folder")
    _owned(folder, folder, "folder")
    sock, token_file = folder / SOCKET_NAME, folder / TOKEN_NAME
    if not os.path.lexists(sock):
        raise _refused(
            folder,
            f"no running job there (no {SOCKET_NAME}: the run ended, has not started, runs "
            "without a run folder, or with attach=False)",
        )
    info = _owned(sock, folder, SOCKET_NAME)
    target = Path(os.path.realpath(sock))
    if stat.S_ISLNK(info.st_mode):  # a long run-folder path: the socket lives elsewhere
        if not target.exists():
            raise _refused(
                folder,
                f"stale {SOCKET_NAME} (it points to {target}, which is gone: the job that made "
                "it died)",
            )
        info = _owned(target, folder, f"socket {target}")
    if not stat.S_ISSOCK(info.st_mode):
        raise _refused(folder, f"{SOCKET_NAME} is not a socket")
    if len(os.fsencode(str(target))) > max_socket_path():
        raise _refused(
            folder, f"the socket's path is longer than AF_UNIX allows ({max_socket_path()} bytes)"
        )
    try:
        token_info = _owned(token_file, folder, TOKEN_NAME)
        if token_info.st_mode & 0o077:
            mode = stat.S_IMODE(token_info.st_mode)
            raise _refused(
                folder, f"{TOKEN_NAME} is readable by others (mode {mode:o}); not trusted"
            )
        token = token_file.read_text().strip()
    except FileNotFoundError:
        raise _refused(
            folder,
            f"{TOKEN_NAME} is missing beside {SOCKET_NAME} (a stale socket from a job that died?)",
        ) from None
    except PermissionError as exc:
        raise _refused(folder, f"cannot read {TOKEN_NAME}: {exc}") from None
    return str(target), token


class Attachment:
    """One attachment to the job running in ``run_dir``: this process' bus receives the job's
    events and sends it commands (docs/attach.md); detaching leaves the run untouched.

    Args:
        run_dir: The job's run folder (where ``attach.sock`` is).
        callbacks: Callbacks run here on the job's events (as with ``trainbus.launch``).
        bus: This side's bus (default: a new one).
        events: Extra event types to stream even without a subscriber for them.
        timeout: Seconds for connecting and the handshake.

    Raises:
        ConfigError: a bad argument (checked now; the folder is checked when connecting).
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        *,
        callbacks: Iterable[Callback | type[Callback]] = (),
        bus: EventBus | None = None,
        events: Iterable[type[ev.BaseEvent]] = (),
        timeout: float = 5.0,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.bus = bus if bus is not None else EventBus()
        self.timeout = check_seconds("timeout", timeout)
        self._extra = tuple(events)
        for t in self._extra:
            if not (isinstance(t, type) and issubclass(t, ev.BaseEvent)):
                raise ConfigError.invalid("events", t, "trainbus event classes")
        for callback in callbacks:
            add_driver_callback(self.bus, callback)
        self._link: DriverLink | None = None
        self._welcome: dict[str, Any] = {}
        self._status: dict[str, Any] = {}
        self._told: list[str] = []  # the event types the job was last asked for
        self._loop_thread: int | None = None  # where the bus runs while connected
        self._portal: anyio.from_thread.BlockingPortal | None = None
        self._portal_cm: Any = None
        self._cm: Any = None

    # ------------------------------------------------------------------ the bus' face
    @property
    def events(self) -> BusObservable[ev.BaseEvent]:
        """Every event received (see :attr:`EventBus.events`)."""
        return self.bus.events

    def stream(self, *event_types: type[ev.BaseEvent], **kw: Any) -> BusObservable[Any]:
        """See :meth:`EventBus.stream` (and :meth:`wait_streaming`)."""
        return self.bus.stream(*event_types, **kw)

    def subscribe(self, observable: Any, on_next: Any, **kw: Any) -> Subscription:
        """See :meth:`EventBus.subscribe` (made on the bus' thread)."""
        return self._on_bus_thread(partial(self.bus.subscribe, observable, on_next, **kw))

    def subscribe_async(
        self, observable: Any, fn: Callable[[Any], Awaitable[Any]], **kw: Any
    ) -> Any:
        """See :meth:`EventBus.subscribe_async` (made on the bus' thread)."""
        return self._on_bus_thread(partial(self.bus.subscribe_async, observable, fn, **kw))

    def _on_bus_thread(self, fn: Callable[[], T]) -> T:
        if self._portal is not None and threading.get_ident() != self._loop_thread:
            return self._portal.call(fn)
        return fn()

    def send(self, command: cmd.Command) -> None:
        """Send a command to the job (applied at its next step; thread-safe)."""
        self.bus.send(command)

    async def request(self, command: cmd.Command) -> ev.BaseEvent:
        """Send a command and wait until the job applied it (see :meth:`EventBus.request`)."""
        return await self.bus.request(command)

    def request_sync(self, command: cmd.Command) -> ev.BaseEvent:
        """Synchronous twin of :meth:`request` (inside ``with attach(...)``)."""
        return self._sync().call(self.bus.request, command)

    # ------------------------------------------------------------------ queries
    @property
    def linked(self) -> bool:
        """Connected and welcomed, and the job has not ended the link."""
        return self._link is not None and self._link.linked and not self._link.unlinked

    @property
    def job(self) -> dict[str, Any]:
        """What the job said when it welcomed this attachment: ``pid``, ``rank``, ``folder``,
        ``events`` (the types it streams here)."""
        return dict(self._welcome)

    @property
    def status(self) -> dict[str, Any]:
        """The job's latest status record (sent every second): ``holding`` (subscribers the
        training loop waited for, with ``waited_s``), ``stalled`` (sync subscribers that
        blocked its event loop), ``failed``, ``queue_depth``, ``attached``."""
        return dict(self._status)

    @property
    def ended(self) -> ev.FitEnded | None:
        """The job's ``FitEnded``, once it arrived."""
        return None if self._link is None else self._link.ended

    # ------------------------------------------------------------------ lifecycle
    async def wait(self, timeout: float | None = None) -> ev.FitEnded | None:  # noqa: ASYNC109
        """Wait until the job ends the link (its run ended) or ``timeout`` seconds passed.

        Returns:
            The job's ``FitEnded``, or None (timed out, or the job went away without one).

        Raises:
            TrainbusError: not connected (outside ``async with attach(...)``).
        """
        link = self._attached()
        await link.wait_unlinked(float("inf") if timeout is None else timeout)
        return link.ended

    def _attached(self) -> DriverLink:
        if self._link is None:
            raise TrainbusError("not attached: use `async with attach(...)` first")
        return self._link

    def wait_sync(self, timeout: float | None = None) -> ev.FitEnded | None:
        """Synchronous twin of :meth:`wait`."""
        return self._sync().call(self.wait, timeout)

    async def wait_streaming(self, timeout: float | None = None) -> bool:  # noqa: ASYNC109
        """Wait until the job streams every event type this side wants now (it confirms a
        subscription made while connected within milliseconds).

        Returns:
            True when it does, False when ``timeout`` seconds passed first (or the link
            ended).

        Raises:
            TrainbusError: not connected (outside ``async with attach(...)``).
        """
        self._attached()
        with anyio.move_on_after(float("inf") if timeout is None else timeout):
            while set(wanted_names(self.bus, self._extra)) - set(self._welcome.get("events", ())):
                if not self.linked:
                    return False
                await anyio.sleep(_WANTS_POLL_S)
            return True
        return False

    def wait_streaming_sync(self, timeout: float | None = None) -> bool:
        """Synchronous twin of :meth:`wait_streaming`."""
        return self._sync().call(self.wait_streaming, timeout)

    @contextlib.asynccontextmanager
    async def _session(self) -> AsyncIterator[Self]:
        target, token = locate(self.run_dir)
        stream, reader = await self._connect(target, token)
        link = self._link = DriverLink(self.bus, token)
        link.welcomed(target)
        self._loop_thread = threading.get_ident()
        lock = anyio.Lock()

        async def send(data: bytes) -> None:  # commands and wants: one writer at a time
            async with lock:
                await stream.send(data)

        try:
            async with self.bus, anyio.create_task_group() as tg:
                tg.start_soon(partial(read_lines, reader, link, self._control, backpressure=False))
                tg.start_soon(link.forward, send)
                tg.start_soon(self._tell_wants, send)
                try:
                    yield self
                finally:
                    with anyio.CancelScope(shield=True):
                        await self.bus.wait_delivered(self.timeout)
                    tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                with contextlib.suppress(Exception):
                    if not link.unlinked:
                        await send(control_record("bye", sent=0))
                await stream.aclose()
            link.end()
            self._loop_thread = None

    async def _connect(
        self, target: str, token: str
    ) -> tuple[anyio.abc.SocketStream, BufferedByteReceiveStream]:
        try:
            with anyio.fail_after(self.timeout):
                stream = await anyio.connect_unix(target)
        except ConnectionRefusedError:
            raise self._refused(
                f"stale {SOCKET_NAME} (nobody listens: the job that made it died)"
            ) from None
        except TimeoutError:
            raise self._refused(f"the job did not accept within {self.timeout} s") from None
        except OSError as exc:
            raise self._refused(str(exc)) from None
        names = self._told = wanted_names(self.bus, self._extra)
        reader = BufferedByteReceiveStream(stream)
        try:
            await stream.send(hello_record(token, events=names))
            with anyio.fail_after(self.timeout):
                reply = await reader.receive_until(b"\n", 1 << 20)
        except TimeoutError:
            await stream.aclose()
            raise self._refused(f"the job did not answer within {self.timeout} s") from None
        except STREAM_GONE:
            reply = b""
        if control_types(reply, "welcome") is None:
            await stream.aclose()
            raise self._refused(
                f"the job refused this attachment (wrong token: {TOKEN_NAME} changed?)"
            )
        self._welcome = _fields(reply)
        return stream, reader

    def _refused(self, why: str) -> AttachError:
        return _refused(self.run_dir, why)

    async def _tell_wants(self, send: Callable[[bytes], Awaitable[None]]) -> None:
        """While connected: send the job the types wanted now when they changed."""
        doorbell = self.bus.port().doorbell
        rings = -1  # compare once at the start: a subscription made while connecting counts
        while True:
            await anyio.sleep(_WANTS_POLL_S)
            if doorbell.rings == rings:
                continue
            rings = doorbell.rings
            names = wanted_names(self.bus, self._extra)
            if names == self._told:
                continue
            self._told = names
            try:
                await send(control_record("wants", events=names))
            except STREAM_GONE:
                return  # the job went away: the reader ends the link
            log.debug("attach_wants_sent", events=names)

    def _control(self, line: bytes) -> bool:
        """Take the job's ``status`` and ``streams`` records (True), not its events."""
        if line.startswith(_CONTROL + b"status"):
            self._status = _fields(line)
        elif line.startswith(_CONTROL + b"streams"):
            streamed = control_types(line, "streams") or ()
            self._welcome["events"] = [t.__name__ for t in streamed]
        else:
            return False
        return True

    async def __aenter__(self) -> Self:
        if self._cm is not None:
            raise TrainbusError("this Attachment is in use already; make a new one")
        self._cm = self._session()
        return await self._cm.__aenter__()  # type: ignore[no-any-return]

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        return await self._cm.__aexit__(exc_type, exc, tb)  # type: ignore[no-any-return]

    def __enter__(self) -> Self:
        """Attach from synchronous code: the bus and the link run in a background thread
        (subscribers run there), until the ``with`` block ends."""
        self._portal_cm = anyio.from_thread.start_blocking_portal()
        self._portal = self._portal_cm.__enter__()
        self._cm = self._portal.wrap_async_context_manager(self._session())
        try:
            self._cm.__enter__()
        except BaseException as exc:
            self._portal_cm.__exit__(type(exc), exc, exc.__traceback__)
            self._portal = None
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self._cm.__exit__(exc_type, exc, tb)
        finally:
            self._portal = None
            self._portal_cm.__exit__(None, None, None)

    def _sync(self) -> anyio.from_thread.BlockingPortal:
        if self._portal is None:
            raise TrainbusError(
                "the *_sync methods work inside `with attach(...)`; in async "
                "code use `async with` and await request()/wait()"
            )
        return self._portal


def attach(run_dir: str | os.PathLike[str], **kw: Any) -> Attachment:
    """An :class:`Attachment` to the job running in ``run_dir`` (its ``checkpoint_dir`` or
    ``attach=`` folder), connecting on entering its ``with`` / ``async with`` block.

    Args:
        run_dir: The job's run folder.
        kw: See :class:`Attachment` (``ConfigError`` for a bad one).
    """
    return Attachment(run_dir, **kw)

"""The loopback socket transport of the link (``trainbus launch``): a blocking socket on the
worker's side, an anyio listener on 127.0.0.1 on the driver's."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable
from typing import Any

import anyio
import anyio.abc
from anyio.streams.buffered import BufferedByteReceiveStream

from .._exceptions import ConfigError, LaunchError
from .._validate import check_seconds
from .driver_link import STREAM_GONE, DriverLink
from .protocol import ADDR_ENV

__all__ = ["LOOPBACK", "SocketConnection", "SocketDriver", "SocketTransport", "read_lines"]

LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})
_MAX_LINE = 16 * 1024 * 1024  # one event record; a bigger one is a broken peer


class SocketConnection:
    """A connected socket (and its ``makefile("rb")``) as a worker transport whose handshake
    is done: rank 0's end of an attachment."""

    linger = 0.0  # a socket write is cheap: send what is queued at once

    def __init__(self, sock: socket.socket | None, file: Any, where: str) -> None:
        self._sock = sock
        self._file = file
        self.where = where

    def open(self, hello: bytes) -> bytes:
        raise OSError("the connection is open already")

    def send(self, data: bytes) -> None:
        if self._sock is None:
            raise OSError("the link is closed")
        self._sock.sendall(data)

    def receive(self) -> bytes:
        file = self._file
        if file is None:
            return b""
        try:
            line: bytes = file.readline()
        except (OSError, ValueError, AttributeError):  # closed under us by close()
            return b""
        return line

    def close(self, bye: bytes) -> None:
        sock, self._sock = self._sock, None
        if sock is None:
            return
        with contextlib.suppress(OSError):
            if bye:
                sock.sendall(bye)
            sock.shutdown(socket.SHUT_RDWR)
        sock.close()
        file, self._file = self._file, None
        if file is not None:
            file.close()  # the socket is only released once its file is closed


class SocketTransport(SocketConnection):
    """The worker's side: connects to the driver's loopback ``host:port`` on :meth:`open`
    (``ConfigError`` naming ``TRAINBUS_DRIVER_ADDR`` for another address)."""

    def __init__(self, address: str, timeout: float = 10.0) -> None:
        host, _, port = address.rpartition(":")
        host = host.strip("[]")
        if host not in LOOPBACK or not port.isdigit():
            raise ConfigError.invalid(ADDR_ENV, address, "127.0.0.1:<port> (loopback only)")
        super().__init__(None, None, f"{host}:{port}")
        self.host, self.port = host, int(port)
        self.timeout = check_seconds("timeout", timeout)

    def open(self, hello: bytes) -> bytes:
        try:
            sock = socket.create_connection((self.host, self.port), timeout=self.timeout)
        except OSError as exc:
            raise LaunchError(f"cannot reach the trainbus driver at {self.where}: {exc}") from exc
        self._sock, self._file = sock, sock.makefile("rb")
        try:
            sock.sendall(hello)
            reply: bytes = self._file.readline()
        except OSError as exc:
            self.close(b"")
            raise LaunchError(f"the trainbus driver at {self.where} did not answer: {exc}") from exc
        sock.settimeout(None)
        return reply


class SocketDriver:
    """The driver's side: a listener on 127.0.0.1 (:meth:`listen`) served into a
    :class:`DriverLink`; a connection has ``connect_timeout`` seconds to send its hello."""

    def __init__(self, listener: anyio.abc.Listener[Any], *, connect_timeout: float) -> None:
        self._listener = listener
        self.connect_timeout = connect_timeout
        port = listener.listeners[0].extra(anyio.abc.SocketAttribute.local_port)  # type: ignore[attr-defined]
        self.address = f"127.0.0.1:{port}"
        self._stream: anyio.abc.SocketStream | None = None

    @classmethod
    async def listen(cls, *, connect_timeout: float = 10.0) -> SocketDriver:
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
        return cls(listener, connect_timeout=check_seconds("connect_timeout", connect_timeout))

    async def serve(self, link: DriverLink) -> None:
        async with anyio.create_task_group() as tg:
            await self._listener.serve(lambda stream: self._handle(stream, link), tg)

    async def send(self, data: bytes) -> None:
        if self._stream is not None:
            await self._stream.send(data)

    async def aclose(self) -> None:
        await self._listener.aclose()

    async def _handle(self, stream: anyio.abc.SocketStream, link: DriverLink) -> None:
        peer = stream.extra(anyio.abc.SocketAttribute.remote_address, None)
        reader = BufferedByteReceiveStream(stream)
        try:
            with anyio.fail_after(self.connect_timeout):
                hello = await reader.receive_until(b"\n", 4096)
        except (TimeoutError, anyio.DelimiterNotFound, *STREAM_GONE):
            hello = b""
        welcome = link.greet(hello, str(peer))
        if welcome is None:
            await stream.aclose()
            return
        await stream.send(welcome)
        self._stream = stream
        try:
            await read_lines(reader, link)
        finally:
            await stream.aclose()


async def read_lines(
    reader: BufferedByteReceiveStream,
    link: DriverLink,
    control: Callable[[bytes], bool] | None = None,
    *,
    backpressure: bool = True,
) -> None:
    """Hand ``reader``'s lines to ``link`` (except those ``control`` takes) until the stream
    or the link ends, then end the link; with ``backpressure``, waiting for room (TCP then holds
    the sender back)."""
    count = 0
    try:
        while not link.unlinked:
            line = await reader.receive_until(b"\n", _MAX_LINE)
            if control is None or not control(line):
                link.receive(line)
            count += 1
            if backpressure and count % 256 == 0:
                await link.wait_room()
    except STREAM_GONE:
        pass
    finally:
        link.end()

"""Rank 0's attach listener: the link protocol with the roles reversed, on a Unix socket in the
run folder; each attachment of the same user is one accepted
:class:`~trainbus._distributed.link.WorkerLink`. The files and rules are docs/attach.md's."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import stat
import struct
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import anyio.from_thread
import anyio.lowlevel

from .. import events as ev
from .._exceptions import ConfigError
from .._log import get_logger
from .driver_link import ALWAYS
from .link import BusLike, WorkerLink
from .protocol import check_hello, control_record, event_types
from .socket_link import SocketConnection

__all__ = [
    "SOCKET_NAME",
    "TOKEN_NAME",
    "AttachServer",
    "attach_folder",
    "max_socket_path",
]

log = get_logger(__name__)

SOCKET_NAME = "attach.sock"
TOKEN_NAME = "attach.token"
_HANDSHAKE_S = 5.0
_SEND_TIMEOUT_S = 30  # an attachment that stops reading for this long is let go
_STATUS_EVERY_S = 1.0


def max_socket_path() -> int:
    """The longest ``AF_UNIX`` path in bytes on this platform (``sun_path`` less its NUL)."""
    return 103 if sys.platform == "darwin" or "bsd" in sys.platform else 107


def _peer_credentials(conn: socket.socket) -> tuple[int, int] | None:
    """The peer's ``(pid, uid)`` (``SO_PEERCRED``), or None where the platform does not say."""
    option = getattr(socket, "SO_PEERCRED", None)
    if option is None:
        return None
    try:
        pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, option, 12))
    except OSError:
        return None
    return pid, uid


def attach_folder(attach: object, checkpoint_dir: str | os.PathLike[str] | None) -> Path | None:
    """The folder a run listens in from ``Trainer(attach=...)`` (True: ``checkpoint_dir``
    where ``AF_UNIX`` exists), or None; ``ConfigError`` for neither a bool nor a path, or a
    folder that cannot be (no ``AF_UNIX``, a file, another user's)."""
    if isinstance(attach, bool):
        if not attach or checkpoint_dir is None or not hasattr(socket, "AF_UNIX"):
            return None
        return Path(checkpoint_dir)
    if not isinstance(attach, str | os.PathLike) or not os.fspath(attach):
        raise ConfigError.invalid(
            "attach", attach, "True (listen in checkpoint_dir), False, or a folder to listen in"
        )
    if not hasattr(socket, "AF_UNIX"):
        raise ConfigError.invalid(
            "attach",
            os.fspath(attach),
            "False on this platform (no Unix domain sockets: attaching needs AF_UNIX)",
        )
    folder = Path(attach)
    if folder.exists() and not folder.is_dir():
        raise ConfigError.invalid("attach", os.fspath(attach), "a folder (this is a file)")
    if folder.is_dir() and hasattr(os, "getuid") and folder.stat().st_uid != os.getuid():
        raise ConfigError.invalid(
            "attach",
            os.fspath(attach),
            f"a folder you own (this one is owned by uid {folder.stat().st_uid})",
        )
    return folder


class _Unavailable(Exception):
    """The run cannot listen in its folder: the message says why."""


class AttachServer:
    """Rank 0's listener for attachments in ``folder``: :meth:`start`, then :meth:`close`
    after the bus delivered the run's events."""

    def __init__(self, bus: BusLike, folder: Path) -> None:
        self._bus = bus
        self.folder = folder
        self.path = folder / SOCKET_NAME
        self.token_path = folder / TOKEN_NAME
        self._token = secrets.token_urlsafe(32)
        self._loop: Any = None
        self._sock: socket.socket | None = None
        self._private: Path | None = None  # the temporary folder of a too-long path's socket
        self._created: Path | None = None  # the topmost folder this server created
        self._links: list[WorkerLink] = []
        self._lock = threading.Lock()
        self._someone = threading.Event()
        self._closed = threading.Event()
        self._accepted = 0
        self._refused = 0

    @property
    def attached(self) -> int:
        """Attachments connected now."""
        with self._lock:
            return len(self._links)

    # ------------------------------------------------------------------ lifecycle
    @classmethod
    def start(cls, bus: BusLike, folder: Path) -> AttachServer | None:
        """Listen in ``folder`` (on the bus' event-loop thread); None when the run cannot
        (logged as ``attach_unavailable`` with the reason)."""
        server = cls(bus, folder)
        try:
            server._listen()
        except _Unavailable as exc:
            server._remove_files()
            log.warning("attach_unavailable", folder=str(folder), reason=str(exc))
            return None
        log.info("attach_listening", socket=str(server.path))
        return server

    def close(self) -> None:
        """On the event-loop thread: stop listening, remove the files, end every attachment
        (what was queued for it, then ``bye``); idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._someone.set()  # the status thread ends
        sock, self._sock = self._sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes the accept() (Linux)
            sock.close()
        self._remove_files()
        with self._lock:
            links, self._links = self._links, []
        for link in links:
            link.close()
        log.info(
            "attach_closed", folder=str(self.folder), accepted=self._accepted, refused=self._refused
        )

    # ------------------------------------------------------------------ setting up
    def _listen(self) -> None:
        self._loop = anyio.lowlevel.current_token()
        folder = self.folder
        if not folder.exists():
            top = folder
            while not top.parent.exists() and top.parent != top:
                top = top.parent
            try:
                folder.mkdir(parents=True)
            except OSError as exc:
                raise _Unavailable(f"cannot create the folder: {exc}") from exc
            self._created = top
        if hasattr(os, "getuid") and folder.stat().st_uid != os.getuid():
            raise _Unavailable(f"the folder is owned by uid {folder.stat().st_uid}, not this user")
        self._clear_stale()
        self._write_token()
        target = self.path
        if len(os.fsencode(os.path.abspath(target))) > max_socket_path():
            # AF_UNIX paths are short: the socket lives in a private temporary folder and the
            # run folder holds a symbolic link to it (what `trainbus attach` follows).
            self._private = Path(tempfile.mkdtemp(prefix="trainbus-attach-"))
            target = self._private / SOCKET_NAME
            if len(os.fsencode(str(target))) > max_socket_path():
                raise _Unavailable(f"the temporary folder's path {target} is too long too")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(str(target))
            os.chmod(target, 0o600)
            sock.listen(16)
        except OSError as exc:
            sock.close()
            raise _Unavailable(f"cannot listen on {target}: {exc}") from exc
        if self._private is not None:
            os.symlink(target, self.path)
        self._sock = sock
        for name, fn in (("accept", self._accept_loop), ("status", self._status_loop)):
            threading.Thread(target=fn, name=f"trainbus-attach-{name}", daemon=True).start()

    def _clear_stale(self) -> None:
        """Remove a dead job's socket; ``_Unavailable`` when a live job listens there."""
        path = self.path
        if not os.path.lexists(path):
            return
        mode = os.lstat(path).st_mode
        if not (stat.S_ISSOCK(mode) or stat.S_ISLNK(mode)):
            raise _Unavailable(f"{path} exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.settimeout(2)
            probe.connect(os.path.realpath(path))
        except OSError:
            pass  # nobody listens: a dead job's socket
        else:
            raise _Unavailable(f"another job listens on {path}")
        finally:
            probe.close()
        log.info("attach_stale_socket_removed", socket=str(path))
        if stat.S_ISLNK(mode):
            stale = Path(os.path.realpath(path))
            with contextlib.suppress(OSError):
                stale.unlink()
                stale.parent.rmdir()
        path.unlink()

    def _write_token(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.token_path.unlink()
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
        try:
            fd = os.open(self.token_path, flags, 0o600)
        except OSError as exc:
            raise _Unavailable(f"cannot write {self.token_path}: {exc}") from exc
        with os.fdopen(fd, "w") as f:
            f.write(self._token)

    def _remove_files(self) -> None:
        for path in (self.path, self.token_path):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        if self._private is not None:
            shutil.rmtree(self._private, ignore_errors=True)
            self._private = None
        created, self._created = self._created, None
        if created is not None:
            # A folder made only to listen in, still empty (no checkpoint written): removed,
            # so the run leaves the disk as a run without attach would.
            folder = self.folder
            while True:
                try:
                    folder.rmdir()
                except OSError:
                    break
                if folder == created:
                    break
                folder = folder.parent

    # ------------------------------------------------------------------ threads
    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            sock = self._sock
            if sock is None:
                return
            try:
                conn, _ = sock.accept()
            except OSError:
                return  # closed
            threading.Thread(
                target=self._greet, args=(conn,), name="trainbus-attach-greet", daemon=True
            ).start()

    def _greet(self, conn: socket.socket) -> None:
        credentials = _peer_credentials(conn)
        pid = credentials[0] if credentials else None
        try:
            conn.settimeout(_HANDSHAKE_S)
            reader = conn.makefile("rb")
            hello = reader.readline(4096)
        except OSError:
            hello, reader = b"", None
        record = check_hello(hello, self._token)
        reason = None
        if credentials is not None and hasattr(os, "getuid") and credentials[1] != os.getuid():
            reason = f"another user (uid {credentials[1]})"
        elif record is None:
            reason = "wrong token" if hello else "no hello"
        if reason is not None or record is None:
            self._refused += 1
            log.warning("attach_refused", folder=str(self.folder), peer_pid=pid, reason=reason)
            if reader is not None:
                reader.close()
            conn.close()
            return
        if pid is None and isinstance(record.get("pid"), int):
            pid = record["pid"]
        wanted = event_types(record.get("events")) or tuple(
            t for t in ev.EVENT_TYPES if t in ALWAYS
        )
        source = f"attach:pid={pid}"
        transport = SocketConnection(conn, reader, source)
        link: WorkerLink

        def left() -> None:
            self._left(link)

        link = WorkerLink(
            transport, self._token, timeout=5.0, source=source, on_end=left, wanted=wanted
        )
        try:
            conn.settimeout(None)
            with contextlib.suppress(OSError, AttributeError):  # a platform without it
                conn.setsockopt(
                    socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", _SEND_TIMEOUT_S, 0)
                )
            conn.sendall(
                control_record(
                    "welcome",
                    events=[t.__name__ for t in wanted],
                    pid=os.getpid(),
                    rank=0,
                    folder=str(self.folder),
                )
            )
            anyio.from_thread.run_sync(self._admit, link, token=self._loop)
        except (OSError, RuntimeError) as exc:  # the peer left, or the run's loop is gone
            log.debug("attach_not_admitted", source=source, error=repr(exc))
            transport.close(b"")

    def _admit(self, link: WorkerLink) -> None:
        """On the event-loop thread: subscribe the attachment."""
        if self._closed.is_set():
            link.transport.close(control_record("bye", sent=0))
            return
        link.start(self._bus)
        with self._lock:
            self._links.append(link)
        self._accepted += 1
        self._someone.set()
        log.info(
            "attach_connected",
            source=link.source,
            events=len(link.wanted),
            attached=len(self._links),
        )

    def _left(self, link: WorkerLink) -> None:
        """From the attachment's reader thread: it went away."""
        with self._lock:
            if link not in self._links:
                return  # close() is ending it
            self._links.remove(link)
            if not self._links:
                self._someone.clear()
        with contextlib.suppress(RuntimeError):  # the run's loop ended: close() disposes
            anyio.from_thread.run_sync(link.unsubscribe, token=self._loop)
        link.close()
        log.info("attach_detached", source=link.source, sent=link.sent, received=link.received)

    def _status_loop(self) -> None:
        """While someone is attached: a ``status`` record of the bus' statistics every second."""
        while True:
            self._someone.wait()
            if self._closed.wait(_STATUS_EVERY_S):
                return
            with self._lock:
                links = list(self._links)
            if not links:
                continue
            try:
                stats = anyio.from_thread.run_sync(self._bus_statistics, token=self._loop)
            except RuntimeError:
                return
            line = control_record("status", **stats)
            for link in links:
                link.post(line)

    def _bus_statistics(self) -> dict[str, Any]:
        statistics = getattr(self._bus, "statistics", None)
        if statistics is None:
            return {}
        snapshot = statistics()
        subs = [s for s in snapshot.subscriptions if not s.name.startswith("attach:")]
        return {
            "queue_depth": snapshot.queue_depth,
            "holding": [
                {"name": s.name, "waited_s": round(s.waited_s, 3)} for s in subs if s.waited_s > 0
            ],
            "stalled": [
                {"name": s.name, "stalls": s.stalls, "blocked_s": round(s.blocked_s, 3)}
                for s in subs
                if s.stalls > 0
            ],
            "failed": [
                {"name": s.name, "failed": s.failed, "last_error": s.last_error}
                for s in subs
                if s.failed > 0
            ],
            "attached": self.attached,
        }

"""The Ray transport of the link: a named mailbox actor between rank 0 and the driver. The
worker pushes numbered batches fire-and-forget and long-polls for commands; the driver
long-polls :meth:`_Mailbox.take`. Only the accepted link's pushes are kept."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from typing import Any

import anyio
import anyio.to_thread
import ray
from ray.exceptions import GetTimeoutError, RayError

from .._distributed.driver_link import DriverLink
from .._distributed.protocol import ADDR_ENV
from .._exceptions import ConfigError, LaunchError
from .._validate import check_seconds

__all__ = ["RayDriver", "RayTransport", "register_worker"]

_COMMAND_WAIT = 0.5  # seconds a worker's long poll for commands lasts
_TAKE_WAIT = 0.5  # seconds the driver's long poll for hellos and batches lasts


class _Mailbox:
    """The actor between rank 0 and the driver."""

    def __init__(self) -> None:
        self._hellos: list[tuple[str, bytes]] = []
        self._replies: dict[str, asyncio.Future[bytes]] = {}
        self._linked: str | None = None
        self._chunks: dict[int, bytes] = {}
        self._next = 0
        self._commands: list[bytes] = []
        self._wake = asyncio.Event()
        self._arrived = asyncio.Event()  # a hello or a batch: the driver's take() returns
        self._released: set[str] = set()
        self._workers: list[Any] = []
        self._aborted = False

    async def hello(self, link_id: str, line: bytes, wait: float) -> bytes:
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._replies[link_id] = future
        self._hellos.append((link_id, line))
        self._arrived.set()
        try:
            return await asyncio.wait_for(future, wait)
        except TimeoutError:
            return b""
        finally:
            self._replies.pop(link_id, None)

    def push(self, link_id: str, seq: int, data: bytes) -> None:
        if link_id == self._linked:
            self._chunks[seq] = data
            self._arrived.set()

    async def commands(self, link_id: str, wait: float) -> bytes | None:
        if link_id != self._linked or link_id in self._released:
            return None
        if not self._commands:
            await _wait(self._wake, wait)
        if link_id in self._released:
            return None
        out, self._commands = b"".join(self._commands), []
        return out

    def release(self, link_id: str) -> None:
        self._released.add(link_id)
        self._wake.set()

    def register(self, worker: Any) -> bool:
        """A worker's actor handle, before ``train_fn``: True when the run was aborted."""
        if not self._aborted:
            self._workers.append(worker)
        return self._aborted

    def ready(self) -> bool:
        return True

    def abort(self) -> list[Any]:
        """The registered workers' handles, to kill; later ones are refused."""
        self._aborted = True
        workers, self._workers = self._workers, []
        return workers

    async def take(self, wait: float) -> tuple[list[tuple[str, bytes]], list[bytes]]:
        """The hellos and the batches (in order) since the last take, waiting up to ``wait``
        seconds for one."""
        if not self._hellos and self._next not in self._chunks:
            await _wait(self._arrived, wait)
        hellos, self._hellos = self._hellos, []
        out: list[bytes] = []
        while self._next in self._chunks:
            out.append(self._chunks.pop(self._next))
            self._next += 1
        return hellos, out

    def answer(self, link_id: str, reply: bytes) -> None:
        if reply:  # accepted: this link's pushes count from 0
            self._linked, self._chunks, self._next = link_id, {}, 0
            self._commands = []
        future = self._replies.get(link_id)
        if future is not None and not future.done():
            future.set_result(reply)

    def put_commands(self, data: bytes) -> None:
        self._commands.append(data)
        self._wake.set()


async def _wait(event: asyncio.Event, seconds: float) -> None:
    """Wait up to ``seconds`` for ``event`` to be set from now on."""
    event.clear()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(event.wait(), seconds)


_MailboxActor: Any = ray.remote(num_cpus=0)(_Mailbox)


def parse_address(address: str) -> tuple[str, str]:
    """``ray:<namespace>/<name>`` -> (namespace, name); ``ConfigError`` when malformed."""
    scheme, _, rest = address.partition(":")
    namespace, _, name = rest.rpartition("/")
    if scheme != "ray" or not name or not namespace:
        raise ConfigError.invalid(ADDR_ENV, address, "ray:<namespace>/<actor name>")
    return namespace, name


def register_worker(address: str) -> bool:
    """In a Ray Train worker, before ``train_fn``: register it for
    :meth:`RayDriver.abort_workers`; True when the run was aborted already."""
    me = ray.get_runtime_context().current_actor
    return bool(ray.get(_mailbox(address).register.remote(me)))


def _mailbox(address: str) -> Any:
    """The mailbox actor at ``address``; ``LaunchError`` when it is gone."""
    namespace, name = parse_address(address)
    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError as exc:
        raise LaunchError(f"cannot reach the trainbus driver at {address}: {exc}") from exc


class RayTransport:
    """The worker's side, for the mailbox at ``ray:<namespace>/<name>`` (``ConfigError``
    when malformed)."""

    linger = 0.05  # seconds the sender waits after an event for more to join its batch

    def __init__(self, address: str, timeout: float = 10.0) -> None:
        parse_address(address)  # ConfigError now, not at open()
        self.where = address
        self.timeout = check_seconds("timeout", timeout)
        self._id = secrets.token_hex(8)
        self._actor: Any = None
        self._seq = 0
        self._closed = False

    def open(self, hello: bytes) -> bytes:
        self._actor = _mailbox(self.where)
        try:
            reply: bytes = ray.get(
                self._actor.hello.remote(self._id, hello, self.timeout), timeout=self.timeout + 5
            )
        except (GetTimeoutError, RayError) as exc:
            raise LaunchError(f"the trainbus driver at {self.where} did not answer: {exc}") from exc
        return reply

    def send(self, data: bytes) -> None:
        if self._actor is None or self._closed:
            raise OSError("the link is closed")
        self._actor.push.remote(self._id, self._seq, data)
        self._seq += 1

    def receive(self) -> bytes:
        while not self._closed and self._actor is not None:
            try:
                out: bytes | None = ray.get(self._actor.commands.remote(self._id, _COMMAND_WAIT))
            except RayError:
                return b""  # the driver is gone
            if out is None:
                return b""
            if out:
                return out
        return b""

    def close(self, bye: bytes) -> None:
        if self._actor is None or self._closed:
            return
        if bye:
            self.send(bye)
        self._closed = True
        self._actor.release.remote(self._id)


class RayDriver:
    """The driver's side: a named mailbox actor in this job's namespace (:meth:`start`)."""

    def __init__(self, actor: Any, address: str) -> None:
        self._actor = actor
        self.address = address

    @classmethod
    async def start(cls) -> RayDriver:
        """Start the mailbox actor and wait until it runs."""
        namespace = ray.get_runtime_context().namespace
        name = f"trainbus-link-{secrets.token_hex(8)}"
        actor = _MailboxActor.options(name=name, namespace=namespace).remote()
        await anyio.to_thread.run_sync(ray.get, actor.ready.remote())
        return cls(actor, f"ray:{namespace}/{name}")

    async def serve(self, link: DriverLink) -> None:
        while True:
            ref = self._actor.take.remote(_TAKE_WAIT)
            # Abandoned on cancel: the long poll ends by itself, or with the actor (aclose).
            hellos, chunks = await anyio.to_thread.run_sync(ray.get, ref, abandon_on_cancel=True)
            for data in chunks:  # the linked worker's, before a hello that may replace it
                link.receive(data)
            for link_id, line in hellos:
                reply = link.greet(line, f"ray worker {link_id}")
                self._actor.answer.remote(link_id, reply or b"")
            await link.wait_room()

    async def send(self, data: bytes) -> None:
        self._actor.put_commands.remote(data)

    async def abort_workers(self) -> int:
        """Kill every worker of the run now (later ones never run ``train_fn``); how many."""
        workers = await anyio.to_thread.run_sync(ray.get, self._actor.abort.remote())
        for worker in workers:
            try:
                ray.kill(worker, no_restart=True)
            except (ValueError, RayError):  # already gone
                pass
        return len(workers)

    async def aclose(self) -> None:
        ray.kill(self._actor)

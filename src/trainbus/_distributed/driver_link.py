"""The driver's end of the link, whatever carries it: a transport hands :class:`DriverLink`
the lines that arrive, and sends what :meth:`DriverLink.forward` gives it."""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import replace
from typing import Any, Protocol

import anyio

from .. import _wire as wire
from .. import commands as cmd
from .. import events as ev
from .._log import get_logger
from .protocol import check_hello, control_record

__all__ = ["ALWAYS", "STREAM_GONE", "CommandSource", "DriverBus", "DriverLink", "wanted_names"]

log = get_logger(__name__)

STREAM_GONE = (
    anyio.EndOfStream,
    anyio.IncompleteRead,
    anyio.BrokenResourceError,
    anyio.ClosedResourceError,
    OSError,
)
"""What reading or writing an anyio stream raises once the other side is gone."""

ALWAYS = frozenset(
    {
        ev.FitStarted,
        ev.FitEnded,
        ev.EpochStarted,
        ev.EpochEnded,
        ev.EvaluationEnded,
        ev.CheckpointSaved,
        ev.MetricsLogged,
        ev.CommandApplied,
    }
)
"""Streamed even with no driver subscriber for them: cheap, and what a failure report names."""


def wanted_names(bus: DriverBus, extra: Iterable[type[ev.BaseEvent]] = ()) -> list[str]:
    """The names of the event types a driver asks for: :data:`ALWAYS`, ``extra`` and what
    ``bus``' subscriptions want, in :data:`trainbus.events.EVENT_TYPES` order."""
    extra = set(extra)
    return [t.__name__ for t in ev.EVENT_TYPES if t in ALWAYS or t in extra or bus.wants(t)]


class CommandSource(Protocol):
    """The bus' loop face (:class:`trainbus._bus.LoopPort`): the driver drains it as a loop."""

    def poll_commands(self) -> list[cmd.Command]: ...

    @property
    def failure(self) -> Exception | None: ...


_NOT_JSON = object()


def _parse(line: bytes) -> Any:
    """One line's JSON value, or ``_NOT_JSON`` (logged)."""
    try:
        return json.loads(line)
    except ValueError as exc:
        log.warning("driver_record_refused", error=str(exc)[:500])
        return _NOT_JSON


class DriverBus(Protocol):
    """What the driver's end needs of a bus (a :class:`trainbus.EventBus` is one)."""

    max_queue: int

    def wants(self, event_type: type[ev.BaseEvent]) -> bool: ...

    def publish(self, event: ev.BaseEvent) -> None: ...

    def port(self) -> CommandSource: ...

    def statistics(self) -> Any: ...


class DriverLink:
    """The driver's end of one run's link. ``relink``: a new hello with the token replaces the
    linked worker (Ray restarted it: a ``WorkersRestarted`` is published), else it is refused."""

    def __init__(
        self, bus: DriverBus, token: str, *, keep_events: int = 100, relink: bool = False
    ) -> None:
        self.bus = bus
        self._commands = bus.port()  # the loop face: the link drains the commands, as a loop
        self._relink = relink
        self._links = 0
        self._token = token
        self._keep = keep_events
        self._events: deque[ev.BaseEvent] = deque(maxlen=max(keep_events, 1))
        self._count = 0
        self._ended: ev.FitEnded | None = None
        self._attempt_ended: ev.FitEnded | None = None  # the current attempt's FitEnded
        self._inflight: list[cmd.Command] = []
        self._refused = 0
        self._linked = anyio.Event()
        self._unlinked = anyio.Event()

    # ------------------------------------------------------------------ queries
    @property
    def linked(self) -> bool:
        """A worker linked (its hello was accepted)."""
        return self._linked.is_set()

    @property
    def unlinked(self) -> bool:
        """The linked worker said bye (or its transport ended)."""
        return self._unlinked.is_set()

    @property
    def links(self) -> int:
        """Hellos accepted so far (more than 1: the workers were restarted, with ``relink``)."""
        return self._links

    @property
    def refused(self) -> int:
        """Hellos refused so far (wrong token, or a second link)."""
        return self._refused

    @property
    def received(self) -> int:
        """Events received so far."""
        return self._count

    @property
    def events(self) -> tuple[ev.BaseEvent, ...]:
        """The last events received (at most ``keep_events``, oldest first)."""
        return tuple(self._events) if self._keep else ()

    @property
    def last_event(self) -> ev.BaseEvent | None:
        """The last event received."""
        return self._events[-1] if self._events else None

    @property
    def ended(self) -> ev.FitEnded | None:
        """Rank 0's ``FitEnded``, once it arrived."""
        return self._ended

    async def wait_room(self) -> None:
        """Wait while the driver's subscribers are behind, so the worker's side holds the
        events, not this process' memory (polled: the bus has no "room" event)."""
        while self.bus.statistics().queue_depth > self.bus.max_queue:  # noqa: ASYNC110
            await anyio.sleep(0.01)

    # ------------------------------------------------------------------ protocol
    def greet(self, hello: bytes, peer: str) -> bytes | None:
        """The welcome line answering ``hello`` from ``peer``, or None: refused (logged)."""
        record = check_hello(hello, self._token)
        reason = None
        if record is None:
            reason = "wrong token"
        elif self.linked and not self._relink:
            reason = "a worker is already linked"
        if reason is not None or record is None:
            self._refused += 1
            log.warning("driver_connection_refused", peer=peer, reason=reason)
            return None
        self._links += 1
        if self.linked:  # relink: rank 0 of a restarted attempt; the old one is gone
            log.warning("driver_relinked", peer=peer, pid=record.get("pid"), links=self._links)
            self._unlinked = anyio.Event()
            self.bus.publish(self._restarted())
        self._linked.set()
        log.info("driver_linked", peer=peer, pid=record.get("pid"))
        return control_record("welcome", events=wanted_names(self.bus))

    def welcomed(self, peer: str) -> None:
        """The link is up, its handshake done by the other side (an attachment's)."""
        self._links += 1
        self._linked.set()
        log.debug("attach_linked", peer=peer)

    def _restarted(self) -> ev.WorkersRestarted:
        """The event of a relink: the new attempt, and why the last one ended."""
        ended, self._attempt_ended = self._attempt_ended, None
        last = self.last_event
        if ended is not None and ended.error is not None:
            reason: str | None = f"rank 0's fit {ended.reason}: {ended.error}"
        elif ended is not None:
            reason = f"rank 0's fit {ended.reason}; another worker failed"
        else:
            reason = "rank 0 streamed no FitEnded: a worker died or was killed"
        return ev.WorkersRestarted(
            step=last.step if last else 0,
            epoch=last.epoch if last else 0,
            attempt=self._links,
            reason=reason,
        )

    def receive(self, data: bytes) -> None:
        """Publish the events of ``data`` (JSON lines); a refused record is logged and skipped;
        ``bye`` ends the link."""
        lines = [line for line in data.splitlines() if line.strip()]
        try:
            # One parse for the whole batch (a parse per line cost a third of the driver's
            # time per event); a batch holding a line that is not JSON is read line by line.
            records: list[Any] = json.loads(b"[" + b",".join(lines) + b"]")
        except ValueError:
            records = [_parse(line) for line in lines]
        for rec in records:
            if rec is not _NOT_JSON:
                self._receive_record(rec)

    def _receive_record(self, rec: Any) -> None:
        try:
            if isinstance(rec, dict) and rec.get("type") == "bye":
                self.end()
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
            self._ended = self._attempt_ended = message
        self._count += 1
        self._events.append(message)
        self.bus.publish(message)

    def end(self) -> None:
        """The link ended (a bye, or the transport closed); idempotent."""
        self._unlinked.set()

    async def wait_unlinked(self, timeout: float) -> bool:  # noqa: ASYNC109
        """Wait at most ``timeout`` seconds for the link to end: True when it did."""
        with anyio.move_on_after(timeout):
            await self._unlinked.wait()
        return self.unlinked

    async def forward(
        self,
        send: Callable[[bytes], Awaitable[None]],
        *,
        on_failure: Callable[[], object] | None = None,
    ) -> None:
        """Until cancelled, ``send`` the bus' commands every 10 ms once linked; a driver
        subscriber failing the run stops the workers and calls ``on_failure``."""
        outbox: list[cmd.Command] = []
        failed = False
        while True:
            await anyio.sleep(0.01)
            outbox.extend(self._commands.poll_commands())
            if self._commands.failure is not None and not failed:
                failed = True  # a driver subscriber failed the run: stop the workers
                outbox.append(cmd.StopTraining(reason="driver_subscriber_failed"))
                if on_failure is not None:
                    on_failure()
            if outbox and self.linked and not self.unlinked:
                batch, outbox = outbox, []
                try:
                    await send(b"".join(wire.dumps(c) for c in batch))
                except STREAM_GONE:
                    pass
                self._inflight.extend(batch)
                del self._inflight[:-1000]  # acks never coming (a dead worker) must not pile up

"""What the loop acts on between steps: the doorbell, the decision steps (docs/events.md,
"When a command takes effect") and the command channel (with its Rx face, ``bus.commands``)."""

from __future__ import annotations

import contextvars
import dataclasses
import itertools
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeAlias

import anyio
from reactivex import abc
from reactivex.disposable import Disposable

from .. import commands as cmd
from .. import events as ev
from .._exceptions import BusClosedError, ConfigError, TrainbusError
from .._log import get_logger

__all__ = [
    "ITEM_STEP",
    "At",
    "CommandChannel",
    "CommandError",
    "CommandSink",
    "DecisionStamp",
    "DecisionSteps",
    "Doorbell",
    "Every",
    "StepClock",
]

log = get_logger(__name__)


class Doorbell:
    """A counter that only grows: :meth:`ring` after a change the training loop must see."""

    __slots__ = ("_lock", "rings")

    def __init__(self) -> None:
        self.rings = 0
        self._lock = threading.Lock()

    def ring(self) -> None:
        """Add one to ``rings``, from any thread."""
        with self._lock:
            self.rings += 1


# ================================================================== the step clock
@dataclass(frozen=True, slots=True)
class Every:
    """Decide at every step that is a multiple of ``n`` (``n``, ``2n``, ...)."""

    n: int

    def next_after(self, step: int) -> int:
        return (step // self.n + 1) * self.n


@dataclass(frozen=True, slots=True)
class At:
    """Decide once, at ``step``."""

    step: int

    def next_after(self, step: int) -> int | None:
        return self.step if self.step > step else None


DecisionSteps: TypeAlias = Every | At
"""A declared set of decision steps."""


class StepClock:
    """The declared decision steps (changed on the event-loop thread, a tuple replaced on
    change), and the next one after a step (read on the training thread)."""

    def __init__(self, doorbell: Doorbell) -> None:
        self._doorbell = doorbell
        self._ids = itertools.count()
        self._declared: dict[int, DecisionSteps] = {}
        self.decision_steps: tuple[DecisionSteps, ...] = ()
        """Every declaration, in order of declaration."""

    def declare(self, *decision_steps: DecisionSteps) -> abc.DisposableBase:
        """Add ``decision_steps`` until the returned disposable is disposed."""
        keys = [next(self._ids) for _ in decision_steps]
        self._declared.update(zip(keys, decision_steps, strict=True))
        self._changed()

        def remove() -> None:
            for key in keys:
                del self._declared[key]
            self._changed()

        return Disposable(remove)

    def _changed(self) -> None:
        self.decision_steps = tuple(self._declared.values())
        self._doorbell.ring()  # after the change: the loop that hears it reads the new set

    def next_decision(self, after_step: int) -> int | None:
        """The smallest declared decision step greater than ``after_step`` (None: none)."""
        steps = [d.next_after(after_step) for d in self.decision_steps]
        return min((step for step in steps if step is not None), default=None)


ITEM_STEP: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "trainbus_item_step", default=None
)
"""The step of the item an async worker is running (set around each item)."""


class DecisionStamp:
    """The step handled on this thread now, which ``bus.send`` stamps on a command: set per
    event by the dispatch slice, per item (:data:`ITEM_STEP`) by an async worker."""

    __slots__ = ("event_id", "loop_thread", "step")

    def __init__(self) -> None:
        self.step: int | None = None
        # id() of the event delivered now or last (a barrier asks who received it).
        self.event_id = 0
        self.loop_thread: int | None = None  # the thread of the last dispatch slice

    def current(self) -> int | None:
        """The step of the event being handled by the caller, or None."""
        if self.step is not None and threading.get_ident() == self.loop_thread:
            return self.step
        return ITEM_STEP.get()


# ================================================================== the command channel
def _check_command(command: object) -> None:
    if not isinstance(command, cmd.COMMAND_TYPES):
        allowed = "an instance of a trainbus.commands class"
        if isinstance(command, type) and issubclass(command, cmd.COMMAND_TYPES):
            allowed += f", such as {command.__name__}(...), not the class"
        raise ConfigError.invalid("command", command, allowed)


class CommandError(TrainbusError):
    """A requested command was acknowledged with an error (``CommandApplied.error``)."""


class CommandChannel:
    """The back-channel's queue, the pending ``request()`` waiters, and the barrier's wake-up."""

    def __init__(self, stamp: DecisionStamp, doorbell: Doorbell) -> None:
        self._stamp = stamp
        self._doorbell = doorbell
        # deque.append/popleft are atomic under the GIL: senders on any thread need no lock.
        self._commands: deque[cmd.Command] = deque()
        self._requests: dict[int, tuple[cmd.Command, anyio.Event, list[Any]]] = {}
        self._wake: anyio.Event | None = None
        self._closed = False
        self._sealed = False
        self._polls_over = False  # before the first call: the first loop polls them

    def send(self, command: cmd.Command) -> None:
        """:meth:`EventBus.send`."""
        _check_command(command)
        if self._sealed:
            raise BusClosedError(
                f"the bus is closed (its run is over): no loop will apply {command!r}; send "
                "commands while fit(), evaluate() or predict() runs"
            )
        if self._polls_over:  # no loop polls until the next call: not carried into it
            self._drop(
                [command], "no call is running (a command applies in the call it is sent during)"
            )
            return
        self._commands.append(self.stamped(command))
        self._doorbell.ring()  # after the append: the loop that hears it finds the command

    def stamped(self, command: cmd.Command) -> cmd.Command:
        """``command`` with ``decided_at`` set to the step the caller handles (a copy), unless
        it has one or the caller handles no event."""
        if command.decided_at is None:
            step = self._stamp.current()
            if step is not None:
                return dataclasses.replace(command, decided_at=step)
        return command

    def has_commands(self) -> bool:
        """True when a command waits on the back-channel (never blocks)."""
        return bool(self._commands)

    def poll_commands(self) -> list[cmd.Command]:
        """Take every command waiting on the back-channel, oldest first (never blocks)."""
        q = self._commands
        return [q.popleft() for _ in range(len(q))]  # popleft: a sender may append meanwhile

    def withdraw(self, match: Callable[[cmd.Command], bool]) -> int:
        """Remove the queued commands ``match`` accepts; returns how many."""
        kept = [c for c in self._commands if not match(c)]
        removed = len(self._commands) - len(kept)
        if removed:
            self._commands.clear()
            self._commands.extend(kept)
        return removed

    def request_waiting(self) -> bool:
        """True when a ``request()`` waits and a command is queued."""
        return bool(self._requests) and bool(self._commands)

    async def request(self, command: cmd.Command) -> ev.BaseEvent:
        """:meth:`EventBus.request`."""
        if self._closed:
            raise BusClosedError("the bus is closed: no loop will apply this command")
        if self._polls_over:
            raise BusClosedError(
                "no call is running (or it made its last poll point): no loop will apply this "
                "command; request it while fit(), evaluate() or predict() runs"
            )
        _check_command(command)
        # Stamped before it is registered: the acknowledgement carries the queued object.
        command = self.stamped(command)
        done = anyio.Event()
        slot: list[Any] = []
        self._requests[id(command)] = (command, done, slot)
        try:
            self.send(command)
            if self._wake is not None:
                self._wake.set()  # a barrier may be waiting on this very requester
            await done.wait()
        finally:
            self._requests.pop(id(command), None)
        if not slot:
            raise BusClosedError(
                f"{command!r} was not applied: the call ended (its last poll "
                "point passed) or the bus closed first"
            )
        ack: ev.CommandApplied = slot[0]
        if ack.error is not None:
            raise CommandError(f"{command!r} failed: {ack.error!r}") from ack.error
        return ack.result if ack.result is not None else ack

    def acknowledge(self, ack: ev.CommandApplied) -> None:
        """Resolve the ``request()`` waiting for ``ack.command``, if any."""
        entry = self._requests.get(id(ack.command))
        if entry is not None and entry[0] is ack.command:
            entry[2].append(ack)
            entry[1].set()

    def arm_wake(self) -> anyio.Event:
        """An event a ``request()`` sets, so a waiting barrier can let the loop apply it."""
        self._wake = anyio.Event()
        return self._wake

    def disarm_wake(self) -> None:
        self._wake = None

    def close(self) -> None:
        """The bus is closing: ``request()`` refuses new commands."""
        self._closed = True

    def seal(self) -> None:
        """The bus has closed: :meth:`send` refuses commands, a waiting ``request()`` raises."""
        self._sealed = True
        self._release_waiters()

    def _release_waiters(self) -> None:
        for _, done, _slot in list(self._requests.values()):
            done.set()

    def end_polls(self) -> None:
        """The loop made its last poll point: drop the queued commands; until
        :meth:`resume_polls` (the next call), ``send`` drops and ``request()`` raises."""
        self._polls_over = True
        self.drop_unapplied()
        self._release_waiters()

    def resume_polls(self) -> None:
        """A call starts: its loop polls the commands sent from now on."""
        self._polls_over = False

    def drop_unapplied(self) -> None:
        """Log and drop the commands sent after the loop's last poll point."""
        commands = list(self._commands)
        self._commands.clear()  # none carries over into the next call
        self._drop(commands, "sent after the call's last poll point")

    def _drop(self, commands: list[cmd.Command], reason: str) -> None:
        # A stop no loop applies asks for what already happened: no warning.
        stops = [c for c in commands if isinstance(c, cmd.StopTraining | cmd.StopEpoch)]
        lost = [c for c in commands if c not in stops]
        if stops:
            log.info("stop_after_the_end", commands=[repr(c) for c in stops], reason=reason)
        if lost:
            log.warning("commands_not_applied", commands=[repr(c) for c in lost], reason=reason)


class CommandSink(abc.ObserverBase[Any]):
    """``bus.commands``: the back-channel as an Rx Observer of commands (a non-command is a
    ``ConfigError``, reported as the subscription's failure)."""

    def __init__(self, send: Callable[[cmd.Command], None]) -> None:
        self.send = send
        """Put a command on the back-channel (what ``on_next`` does)."""

    def on_next(self, value: cmd.Command) -> None:
        self.send(value)

    def on_error(self, error: Exception) -> None:
        raise error

    def on_completed(self) -> None:
        return None

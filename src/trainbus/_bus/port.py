"""The loop's face of the bus: what a publisher that steers by commands holds.

An :class:`~trainbus.EventBus` has two faces, as a trio memory channel has a send end and a
receive end. Users hold the bus (``events``, ``stream``, ``subscribe*``, ``commands``,
``send``, ``request``, ``statistics``). The training loop, the trainer's session and the
distributed code hold a :class:`LoopPort`, obtained once from its bus (``bus.port()``, the
same object for the bus' lifetime): they publish, ask the demand before building an event,
poll commands at their poll points, wait at barriers and read the decision steps. A user never
needs these names; a loop implementer needs nothing else.

**One signal for "the loop must look".** :attr:`LoopPort.doorbell` rings after every change the
loop must act on: a subscription came or went (the demand changed), a decision steps was
declared or removed, a command was sent, a ``"raise"`` subscriber failed, a ``"block"`` buffer
went over capacity, a cancel was requested. The loop compares :attr:`Doorbell.rings` with the
count it last acted on (one attribute read) and only then re-reads the real state; a ring
carries no data.

**Sampling as a demand.** :meth:`LoopPort.demand` answers, for one event type, whether some
subscription takes every event (:attr:`Demand.each`) or only samples (:attr:`Demand.sampled`;
then :meth:`Demand.takes` says whether the event of a step, stamped now, is taken). How the
sampling is done (``every_s``, ``every_steps``) stays in the route table.
"""

from __future__ import annotations

from collections.abc import Callable

from reactivex import abc

from .. import commands as cmd
from .. import events as ev
from .commands import CommandChannel, DecisionSteps, StepClock
from .dispatch import Barrier, BarrierStatus, Demand, PublishQueue, RouteTable
from .doorbell import Doorbell
from .lifecycle import Lifecycle
from .subscriptions import Backpressure, BusStatistics, Chains
from .watchdog import FailureLedger

__all__ = ["LoopPort"]


class LoopPort:
    """The loop's end of one bus (see the module docstring); built by the bus, never by hand.

    Attributes:
        publish: Queue an event for delivery (:meth:`PublishQueue.publish`): a type check and a
            deque append, safe from any thread. The queue's own method, bound once, so a call
            costs no extra frame.
        wants: True when some subscription would receive events of the given type
            (:meth:`RouteTable.wants`); ask before building an event. Bound once as well.
        doorbell: Rung whenever the loop must look at the bus: the one signal (see the module
            docstring). Read ``doorbell.rings``; ``doorbell.ring()`` from a cancel.
    """

    def __init__(
        self,
        *,
        doorbell: Doorbell,
        queue: PublishQueue,
        routes: RouteTable,
        clock: StepClock,
        channel: CommandChannel,
        ledger: FailureLedger,
        pressure: Backpressure,
        barrier: Barrier,
        lifecycle: Lifecycle,
        chains: Chains,
    ) -> None:
        self.publish: Callable[[ev.BaseEvent], None] = queue.publish
        self.wants: Callable[[type[ev.BaseEvent]], bool] = routes.wants
        self.doorbell = doorbell
        self._routes = routes
        self._clock = clock
        self._channel = channel
        self._ledger = ledger
        self._pressure = pressure
        self._barrier = barrier
        self._lifecycle = lifecycle
        self._chains = chains

    # ================================================================== demand
    def demand(self, event_type: type[ev.BaseEvent]) -> Demand:
        """What the subscriptions of ``event_type`` take (see :class:`Demand`): the same
        object for the bus' lifetime, kept up to date on the event-loop thread. Re-read its
        flags when the doorbell rang; ask :meth:`Demand.takes` per event while it is
        ``sampled``."""
        return self._routes.demand(event_type)

    # ================================================================== decision steps
    def declare(self, decision_steps: tuple[DecisionSteps, ...]) -> abc.DisposableBase:
        """Declare decision steps to the step clock until the result is disposed."""
        return self._chains.declare(decision_steps)

    @property
    def decision_steps(self) -> tuple[DecisionSteps, ...]:
        """Every declaration of decision steps (what ranks agree on at a run's start)."""
        return self._clock.decision_steps

    def statistics(self) -> BusStatistics:
        """The bus' counters now (the loop's result at its end; the Trainer replaces them
        once the bus delivered the run's events)."""
        return self._lifecycle.statistics()

    def next_decision(self, after_step: int) -> int | None:
        """The first declared decision step after ``after_step`` (None: none declared)."""
        return self._clock.next_decision(after_step)

    # ================================================================== poll points
    @property
    def failure(self) -> Exception | None:
        """The first failure of a subscription with ``on_error="raise"``, if any (the loop
        raises it at its next poll point)."""
        return self._ledger.fatal

    @property
    def held(self) -> bool:
        """True while an ``overflow="block"`` subscription's buffer is over capacity: call
        :meth:`wait_for_room` at the next poll point (one attribute read)."""
        return self._pressure.active

    def wait_for_room(self, stop: Callable[[], bool] | None = None) -> float:
        """Block the calling thread (the loop's, at a poll point) while a ``"block"`` buffer
        is over capacity; return early when the doorbell rings or ``stop()`` is true (see
        :meth:`Backpressure.wait_for_room`). Never on the event-loop thread.

        Returns:
            Seconds waited.
        """
        return self._pressure.wait_for_room(stop)

    def has_commands(self) -> bool:
        """True when a command waits on the back-channel (never blocks)."""
        return self._channel.has_commands()

    def poll_commands(self) -> list[cmd.Command]:
        """Take every command waiting on the back-channel, oldest first (never blocks)."""
        return self._channel.poll_commands()

    def withdraw(self, match: Callable[[cmd.Command], bool]) -> int:
        """Remove the queued commands that ``match`` accepts, before any loop applies them
        (between two trainer calls: a signal's ``StopTraining`` that arrived after the last
        poll must not stop the next call).

        Returns:
            How many commands were removed.
        """
        return self._channel.withdraw(match)

    async def wait_barrier(
        self, timeout: float, event: ev.BaseEvent | None, resume: bool
    ) -> BarrierStatus:
        """The loop's barrier, on the event-loop thread (see :meth:`Barrier.wait_barrier`).

        Returns:
            ``"done"``, ``"timeout"``, or ``"request"`` (apply it, then call again with
            ``resume=True``).
        """
        return await self._barrier.wait_barrier(timeout, event, resume)

    def request_cancel_pending(self) -> None:
        """Ask a call's end or a close that waits for async subscribers to cancel their
        pending work within about 0.1 s (see :meth:`Lifecycle.request_cancel_pending`). Safe
        from any thread and from a signal handler (it sets a flag)."""
        self._lifecycle.request_cancel_pending()

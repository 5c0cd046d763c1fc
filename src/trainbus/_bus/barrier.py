"""Barriers: deliver now, then wait for the deciders among the async subscribers of one event.

The loop calls :meth:`Barrier.wait_barrier` at barrier events (``EvaluationEnded``,
``EpochEnded`` by default, or ``Trainer(barriers=...)``), at the decision steps of the step
clock (their ``StepEnded``) and once after the last step (no event), so that a decision made
there is applied before the next step. A ``request()`` arriving meanwhile interrupts the wait,
so the loop can apply it first.

Who is waited for (docs/bus.md, "Barriers", is the one account of it): every sync subscriber
of what was queued runs during the delivery, as always; of the async subscriptions, only those
made with ``decides=True`` (``Callback.decides``) that received the event, or an event derived
from it in the same dispatch (at the last barrier: anything delivered then), and only until
they finished what they had received by then. Any other async subscription (a poster of the
metrics, an uploader, a logger) is never waited for, whatever events it receives: its backlog
stays its own (the bus' close waits for it, within ``close_timeout``). Delivery itself never
waits (a full ``"block"`` buffer pushes back on the training loop instead, see ``pressure.py``).
The seconds the loop waits are added to each waited-for subscription's ``waited_s``; once a
subscription has held training for ``_ANNOUNCE_AFTER`` seconds (in one wait or in all), a
``training_waits_for_subscriber`` warning names it (:func:`~.pressure.announce_wait`, as for a
full ``"block"`` buffer), during the wait that crosses it.
"""

from __future__ import annotations

from typing import Literal

import anyio

from .. import events as ev
from .._log import get_logger
from .async_subscription import AsyncSubscription
from .channel import CommandChannel
from .pressure import announce_wait
from .queue import PublishQueue
from .registry import SubscriptionSet
from .tasks import TaskSet

__all__ = ["Barrier", "BarrierStatus"]

log = get_logger(__name__)

BarrierStatus = Literal["done", "timeout", "request"]

_ANNOUNCE_AFTER = 0.5
"""Seconds of waiting on a decider (one wait, or all of them) after which a warning names it:
a decider that answers within milliseconds is not worth a line; one that holds training is
named within about a second of the wait that makes it so."""
_REASON = (
    "it was made with decides=True and received this barrier's event: training waits until "
    "it has finished what it received, so that its commands apply before the next step"
)
_REMEDIES = (
    "decides=False (the default) when its commands need not land on this step (an async "
    "subscriber that only posts, uploads or logs never holds training); a faster fn; "
    "Trainer(barrier_timeout=...) bounds each wait; Trainer(barriers=...) names the events "
    "the loop waits at"
)


class Barrier:
    """``wait_delivered`` and the loop's interruptible barrier.

    Args:
        queue: What to deliver first.
        subscriptions: The async subscriptions waited for.
        channel: A ``request()`` on it interrupts an interruptible wait.
    """

    def __init__(
        self, queue: PublishQueue, subscriptions: SubscriptionSet, channel: CommandChannel
    ) -> None:
        self._queue = queue
        self._subscriptions = subscriptions
        self._channel = channel
        # A wait interrupted by a request: its targets and deadline, resumed by the next call.
        self._pending: tuple[list[tuple[AsyncSubscription, int]], float] | None = None
        self._announced: set[int] = set()  # subscriptions named in a warning already
        self._waited: dict[int, float] = {}  # seconds barriers waited per subscription

    async def wait_delivered(
        self, timeout: float | None = None, event: ev.BaseEvent | None = None
    ) -> bool:
        """Deliver everything queued; then wait for the async subscriptions that received an
        item from ``event`` (or, without ``event``, from anything in that delivery) to finish
        it. So a slow async subscriber of some other event (a checkpoint upload, say) is not
        waited for.

        Args:
            timeout: Seconds to wait for the async subscribers (None: no limit).
            event: An already published event (found by identity in the queue).

        Returns:
            True when everything finished, False when the timeout expired first.
        """
        # The timeout covers the delivery too (which never waits on a subscriber today).
        start = anyio.current_time()
        with anyio.move_on_after(timeout) as scope:
            targets = await self._deliver_for_barrier(event)
        if scope.cancelled_caught:
            log.warning("barrier_timeout", timeout=timeout, waiting=[], stage="delivery")
            return False
        left = None if timeout is None else max(0.0, timeout - (anyio.current_time() - start))
        status = await self._wait_targets(targets, left, interruptible=False, configured=timeout)
        return status == "done"

    async def _deliver_for_barrier(
        self, event: ev.BaseEvent | None
    ) -> list[tuple[AsyncSubscription, int]]:
        asyncs = self._subscriptions.asyncs()
        q = self._queue
        if event is not None:
            # What was published before the barrier event is delivered but not waited for.
            before_event = q.index(event)
            if before_event is None:
                # The poller already dispatched the event (between its publish and this call):
                # each subscription noted which event fed its last item, so the ones it reached
                # are still known (an event reaching one later would have been published after
                # it: the loop waits here and publishes nothing meanwhile).
                await q.drain()
                fed = [(s, s.received_from(id(event))) for s in asyncs]
                return [(s, n) for s, n in fed if n is not None]
            if before_event:
                await q.drain(limit=before_event)
        before = {id(s): s.received for s in asyncs}
        if event is not None and q.first_is(event):
            await q.drain(limit=1)
            targets = [(s, s.received) for s in asyncs if s.received > before[id(s)]]
            await q.drain()
        else:
            await q.drain()
            targets = [(s, s.received) for s in asyncs if s.received > before[id(s)]]
        return targets

    async def _wait_targets(
        self,
        targets: list[tuple[AsyncSubscription, int]],
        timeout: float | None,
        *,
        interruptible: bool,
        configured: float | None = None,
        account: bool = False,
    ) -> BarrierStatus:
        status: BarrierStatus = "timeout"
        wake = self._channel.arm_wake()
        start = anyio.current_time()
        # Only those not settled yet are waited for (and charged): a sub that finished its
        # item before the barrier cost training nothing.
        waiting = [(sub, n) for sub, n in targets if sub.settled < n and not sub.finished]
        unsettled = {id(sub) for sub, _ in waiting}
        # A race of tasks that each end by their own scope (tasks.py), not by cancelling the
        # task group: all settled ("done"), a request ("request") or the timeout.
        async with anyio.create_task_group() as tg:
            tasks = TaskSet(tg)

            async def settle_one(sub: AsyncSubscription, target: int) -> None:
                await sub.wait_settled(target)
                unsettled.discard(id(sub))
                if account:
                    self._charge(sub, anyio.current_time() - start)
                if not unsettled:
                    settled()

            def settled() -> None:
                nonlocal status
                if not tasks.stopped:
                    status = "done"
                    tasks.stop()

            async def interrupted() -> None:
                nonlocal status
                await wake.wait()
                if not tasks.stopped:
                    status = "request"
                    tasks.stop()

            async def timer(seconds: float) -> None:
                await anyio.sleep(seconds)
                tasks.stop()  # status stays "timeout"

            async def announce() -> None:
                # Said while training waits, not after: a decider stuck for minutes is named
                # within about a second. Ends with the wait (its own scope, tasks.py).
                await anyio.sleep(_ANNOUNCE_AFTER)
                for sub, _ in waiting:
                    if id(sub) in unsettled:
                        self._announce(sub)

            if not waiting:
                settled()
            for sub, target in waiting:
                tasks.start_soon(settle_one, sub, target)
            if interruptible:
                tasks.start_soon(interrupted)
            if timeout is not None:
                tasks.start_soon(timer, timeout)
            if account and waiting and not tasks.stopped:
                tasks.start_soon(announce)
        self._channel.disarm_wake()
        if account and unsettled:  # timed out or interrupted: charged up to now
            elapsed = anyio.current_time() - start
            for sub, _ in waiting:
                if id(sub) in unsettled:
                    self._charge(sub, elapsed)
        if account:
            # Many short waits add up: named once they have cost training as much as one
            # long wait would have before its warning.
            for sub, _ in waiting:
                if self._waited.get(id(sub), 0.0) >= _ANNOUNCE_AFTER:
                    self._announce(sub)
        if status == "timeout":
            log.warning(
                "barrier_timeout",
                timeout=configured if configured is not None else timeout,
                waiting=[s.name for s, _ in targets],
            )
        return status

    def _charge(self, sub: AsyncSubscription, seconds: float) -> None:
        sub.add_waited(seconds)  # what the user reads (back-pressure's waits included)
        self._waited[id(sub)] = self._waited.get(id(sub), 0.0) + seconds

    def _announce(self, sub: AsyncSubscription) -> None:
        if id(sub) not in self._announced:
            self._announced.add(id(sub))
            announce_wait(sub, reason=_REASON, remedies=_REMEDIES)

    async def wait_barrier(
        self, timeout: float, event: ev.BaseEvent | None, resume: bool
    ) -> BarrierStatus:
        """The loop's barrier: deliver, then wait for the async deciders (``decides=True``)
        that received the event (None: anything delivered now) until they finish
        (``"done"``), the timeout (``"timeout"``), or a ``request()`` arrives (``"request"``:
        the loop applies it, then resumes the same wait with ``resume=True``). No other async
        subscription is waited for.
        """
        if resume and self._pending is not None:
            targets, deadline = self._pending
            await self._queue.drain()  # delivers the CommandApplied the requester is waiting for
        else:
            deadline = anyio.current_time() + timeout
            with anyio.move_on_at(deadline) as scope:
                targets = await self._deliver_for_barrier(event)
            if scope.cancelled_caught:
                log.warning("barrier_timeout", timeout=timeout, waiting=[], stage="delivery")
                return "timeout"
            # Only the deciders: a poster, uploader or logger that received the event (or one
            # derived from it, e.g. metrics a sync subscriber re-published) never holds
            # training, and its backlog stays its own; the bus' close waits for it.
            targets = [(s, n) for s, n in targets if s.decides]
        self._pending = None
        if self._channel.request_waiting():
            status: BarrierStatus = "request"
        else:
            left = max(0.0, deadline - anyio.current_time())
            status = await self._wait_targets(targets, left, interruptible=True,
                                              configured=timeout, account=True)  # fmt: skip
        if status == "request":
            self._pending = (targets, deadline)
        return status

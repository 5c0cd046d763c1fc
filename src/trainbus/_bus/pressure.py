"""Back-pressure of ``"block"`` subscriptions: pushed back on the training thread, not dispatch.

A ``"block"`` async subscription never drops: when its buffer goes over capacity it takes the
item anyway (the dispatcher never waits for one subscription's room, so every other subscriber
keeps receiving) and raises :class:`Backpressure`, which rings the bus' doorbell. The training
loop hears the ring after its current step and, at its poll point, calls
:meth:`Backpressure.wait_for_room`: the training thread waits there until every ``"block"``
buffer is back within capacity, a command or cancel arrives (the doorbell rings again), or the
run stops. So a ``"block"`` subscription slows training to its own pace (that is what it asks
for: nothing lost), and holds at most its buffer plus what one step or one evaluation round
publishes.

The first time the training thread waits on a subscription, a warning names it, with how fast
it finishes items against how fast they come, and the remedies. Every second waited is counted
per subscription (``SubscriptionStatistics.waited_s``, ``FitResult.waited_s``). The barrier
(``barrier.py``), the other place training may wait on a subscriber, says so through the same
:func:`announce_wait`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Protocol

from .._log import get_logger
from .doorbell import Doorbell

__all__ = ["Backpressure", "Holder", "announce_wait"]

log = get_logger(__name__)

_SLICE = 0.05
"""Seconds between two looks of a waiting training thread (its waits are counted per slice)."""

REMEDIES = (
    "a larger buffer=, a higher concurrency=, overflow='drop_oldest' or 'latest' (drops are "
    "counted as lost work), or sample at the stream: bus.stream(T, every_steps=n) / "
    "bus.stream(T, every_s=x)"
)


class Holder(Protocol):
    """What back-pressure needs of a subscription that holds the training thread."""

    name: str

    def add_waited(self, seconds: float) -> None:
        """Count seconds the training thread waited on it."""

    def rates(self) -> tuple[float, float]:
        """(items finished per second, items received per second) since its first item."""


def announce_wait(sub: Holder, *, reason: str, remedies: str) -> None:
    """Say that the training thread waits on ``sub`` (the ``training_waits_for_subscriber``
    warning), with how fast it finishes items against how fast they come. Its callers say it
    once per subscription: the first wait that matters.

    Args:
        sub: The subscription training waits on.
        reason: Why training waits on it.
        remedies: What the user can change so that it does not.
    """
    done_rate, in_rate = sub.rates()
    log.warning(
        "training_waits_for_subscriber",
        subscription=sub.name,
        rate_per_s=round(done_rate, 3),
        events_per_s=round(in_rate, 3),
        reason=reason,
        remedies=remedies,
    )


class Backpressure:
    """The ``"block"`` subscriptions over capacity, and the training thread's wait for them.

    ``active`` is read once per poll point by the loop, so it is a plain attribute. The set of
    holders changes on the event-loop thread only; the training thread reads a snapshot.

    Args:
        doorbell: Rung when a subscription starts holding, so the loop looks at once.
    """

    __slots__ = ("_doorbell", "_holders", "_room", "_warned", "active")

    def __init__(self, doorbell: Doorbell | None = None) -> None:
        self.active = False
        self._doorbell = doorbell or Doorbell()
        self._holders: dict[int, Holder] = {}
        self._room = threading.Event()
        self._room.set()
        self._warned: set[int] = set()

    def signal(self, sub: Holder) -> None:
        """``sub``'s buffer went over capacity (event-loop thread)."""
        if id(sub) in self._holders:
            return
        self._holders[id(sub)] = sub
        self._room.clear()
        self.active = True
        self._doorbell.ring()  # after the change: the loop that hears it finds it active

    def relieve(self, sub: Holder) -> None:
        """``sub`` is back within capacity, or will never take another item (loop thread)."""
        if self._holders.pop(id(sub), None) is not None and not self._holders:
            self.active = False
            self._room.set()

    def clear(self) -> None:
        """Nobody holds any more (the bus closes)."""
        self._holders.clear()
        self.active = False
        self._room.set()

    def holders(self) -> tuple[Holder, ...]:
        """The subscriptions over capacity now (a snapshot; any thread)."""
        return tuple(list(self._holders.values()))

    def wait_for_room(self, stop: Callable[[], bool] | None = None) -> float:
        """Block the calling (training) thread while a ``"block"`` buffer is over capacity.

        Returns early when the doorbell rings (a command, a ``"raise"`` failure, a cancel: the
        loop must act on it) or ``stop()`` turns true. Each slice waited is added to the
        ``waited_s`` of every subscription holding during it; the first wait on a
        subscription logs ``training_waits_for_subscriber``.

        Args:
            stop: Polled every slice; True ends the wait.

        Returns:
            Seconds waited.
        """
        if not self.active:
            return 0.0
        bell = self._doorbell
        seen = bell.rings
        start = t = time.monotonic()
        while self.active and bell.rings == seen and not (stop is not None and stop()):
            holding = self.holders()
            for sub in holding:
                if id(sub) not in self._warned:
                    self._warned.add(id(sub))
                    self._warn(sub)
            self._room.wait(_SLICE)
            now = time.monotonic()
            for sub in holding:
                sub.add_waited(now - t)
            t = now
        return t - start

    @staticmethod
    def _warn(sub: Holder) -> None:
        announce_wait(
            sub,
            reason="its overflow='block' buffer is full: training goes at its pace so that "
            "nothing is dropped",
            remedies=REMEDIES,
        )

"""The doorbell: how the bus tells the training loop, in one attribute read, to look at it.

The one signal that the loop must look (the loop holds it on its port, ``bus.port().doorbell``).
The loop runs its steps without polling. Before a step and at the poll point after it, it reads
:attr:`Doorbell.rings` and compares it with the value it last acted on there; the bus' parts
ring the bell after each change the loop must act on: a subscription came or went
(``RouteTable``), a decision steps was declared or removed (``StepClock``), a command was
sent (``CommandChannel``), a ``"raise"`` subscriber failed (``FailureLedger``), a ``"block"``
buffer went over capacity (``Backpressure``), a cancel was requested. The loop then re-reads the
real state (its wanted events and next decision step before a step; commands, failure, pressure
at the poll point), so a ring carries no data. Each ring adds exactly one under a lock (rings
are rare: a change, never a publish), so rings racing on different threads all count and the
count never goes back; the loop's read stays one plain attribute read.
"""

from __future__ import annotations

import threading

__all__ = ["Doorbell"]


class Doorbell:
    """A counter that only grows; :meth:`ring` after a change the training loop must see.

    Attributes:
        rings: How many times the bell rang (read by the loop between steps).
    """

    __slots__ = ("_lock", "rings")

    def __init__(self) -> None:
        self.rings = 0
        self._lock = threading.Lock()

    def ring(self) -> None:
        """Tell the loop to look at the bus: add one to :attr:`rings`. Any thread; waits only
        for another thread's ring (a read-modify-write racing without the lock could lose a
        ring, or write back an older count)."""
        with self._lock:
            self.rings += 1

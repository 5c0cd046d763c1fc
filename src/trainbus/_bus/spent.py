"""Spent items: what the event-loop thread is done with, freed on the publishing thread.

Freeing a tensor releases the GIL: torch's deallocator drops it. When the last reference to a
``StepEnded`` (and so to its detached loss) died on the loop thread, each free handed the GIL to
the busy training thread and waited to get it back: one round trip per event, 50-250 µs of wall
time between two threads on a loaded machine, for a dispatch that itself costs ~1.5 µs.

So the loop thread does not drop what it delivered. The publish queue appends each dispatched
event here, an async subscription each item its callback finished with or its overflow policy
dropped; the next :meth:`~trainbus._bus.queue.PublishQueue.publish` clears the deque on the
publishing thread (the training thread), among its own tensor frees, while the loop thread
sleeps: the same frees then cost nothing extra. A subscriber that keeps an event frees it
wherever it drops it, as before. At most one slice's worth waits here; the bus clears it when
it closes.
"""

from __future__ import annotations

from collections import deque
from typing import Any

__all__ = ["Spent"]


class Spent(deque[Any]):
    """Items the loop thread is done with. ``append`` on the loop thread; ``clear`` on the
    publishing thread. A deque: both are atomic under the GIL, and ``clear`` detaches every item
    before it drops them, so an append racing with a clear is kept for the next one.
    ``Spent(maxlen=0)`` keeps nothing: what a part appends is freed at once, where it is (a part
    built without a bus, in tests).
    """

    __slots__ = ()

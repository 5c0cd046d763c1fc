"""Frozen snapshots of the bus' counters (``bus.statistics()``, ``sub.statistics()``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["BusStatistics", "LostWork", "SubscriptionStatistics"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SubscriptionStatistics:
    """A snapshot of one subscription's counters."""

    name: str
    kind: Literal["sync", "async"]
    active: bool
    received: int
    """Items that reached the subscription (after its operators)."""
    delivered: int
    """Items handed to the subscriber's function."""
    completed: int
    """Calls of the function that returned or raised (async: finished awaits)."""
    failed: int
    dropped: int
    """Items discarded by the overflow policy (async only)."""
    queued: int
    """Items waiting in the buffer (async only)."""
    in_flight: int
    cancelled: int
    """Items waiting or running when the bus closed past its ``close_timeout``, or when
    ``EventBus.cancel_pending()`` was called, then cancelled."""
    last_error: str | None
    stalls: int = 0
    """Calls that blocked the event-loop thread past the bus' ``watchdog_s`` (each warned
    about while it blocked; sync only)."""
    blocked_s: float = 0.0
    """Seconds those calls blocked the event loop, once returned (measured by the watchdog's
    polls: right to within ``watchdog_s / 10``, at most 0.5 s, per call)."""
    waited_s: float = 0.0
    """Seconds the training thread waited on this subscription: a full ``overflow="block"``
    buffer, or a barrier or decision step it decides at. 0 for everything else."""

    @property
    def lost_work(self) -> LostWork:
        """What this subscription lost: items dropped, cancelled, or whose call failed."""
        return LostWork(dropped=self.dropped, cancelled=self.cancelled, failed=self.failed)


@dataclass(frozen=True, slots=True, kw_only=True)
class LostWork:
    """Work one subscription never did (``FitResult.lost_work``).

    Attributes:
        dropped: Items its overflow policy dropped (``"drop_oldest"``, ``"latest"``).
        cancelled: Items waiting or running when they were cancelled (``close_timeout``,
            ``EventBus.cancel_pending()``).
        failed: Calls that raised (and upstream errors that ended its stream).
    """

    dropped: int = 0
    cancelled: int = 0
    failed: int = 0

    @property
    def total(self) -> int:
        """dropped + cancelled + failed."""
        return self.dropped + self.cancelled + self.failed

    def __bool__(self) -> bool:
        return self.total > 0

    def __add__(self, other: LostWork) -> LostWork:
        """The lost work of two subscriptions (or two calls) together, count by count."""
        return LostWork(dropped=self.dropped + other.dropped,
                        cancelled=self.cancelled + other.cancelled,
                        failed=self.failed + other.failed)  # fmt: skip


@dataclass(frozen=True, slots=True, kw_only=True)
class BusStatistics:
    """A snapshot of the whole bus."""

    published: int
    """Events accepted by ``publish`` (delivered plus still queued)."""
    delivered: int
    """Events taken off the queue and dispatched to every matching subscription."""
    queue_depth: int
    dropped: int
    failed: int
    cancelled: int
    publisher_waits: int
    """Times a publishing thread waited because the queue was full (``max_queue``)."""
    subscriptions: tuple[SubscriptionStatistics, ...]

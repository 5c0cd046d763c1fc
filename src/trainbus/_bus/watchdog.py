"""The event-loop watchdog: says which sync subscriber blocks the event-loop thread, while it does.

Sync subscribers run on the event-loop thread. One that blocks (a ``time.sleep``, a slow upload
in a plain ``def``) holds every other subscriber, the barriers and the close; nothing else would
say so. The dispatcher's guard marks which subscription it is running with two plain attribute
writes per call (no lock, no clock: the cost is that of the writes)::

    loop thread (GuardedObserver.on_next)        watchdog thread (daemon, polls)
    ┌────────────────────────────────────┐       ┌──────────────────────────────────────────┐
    │ sub.received += 1  (counted anyway)│       │ every threshold/10 (at most 0.5 s):      │
    │ prev = w.current; w.current = sub  │ ───►  │   same call (sub, sub.received) running  │
    │ fn(event)                          │ read  │   since >= threshold? → warning:         │
    │ w.current = prev                   │       │   subscription, blocked_s, the loop      │
    └────────────────────────────────────┘       │   thread's stack (now)                   │
                                                 └──────────────────────────────────────────┘

The warning comes while the call still blocks, with the loop thread's current stack
(``sys._current_frames()``), once per blocked call; when the call returns, an info line says how
long it blocked. The subscription counts its ``stalls`` and ``blocked_s`` (see
:class:`~trainbus._bus.statistics.SubscriptionStatistics`). Times are measured by the watchdog's
polls, so they are right to within one poll interval.

What it does not see: an Rx operator upstream of the subscriber (``ops.map(slow)``) runs before
the guard, and an ``async def`` subscriber that blocks between its awaits runs in a worker task.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from typing import Protocol

from .._log import get_logger

__all__ = ["DEFAULT_WATCHDOG_S", "Watchdog", "Watched"]

log = get_logger(__name__)

DEFAULT_WATCHDOG_S = 5.0
"""Seconds a sync subscriber may block the event-loop thread before the watchdog warns."""
_MAX_POLL = 0.5
_MIN_POLL = 0.005
_STACK_FRAMES = 25


class Watched(Protocol):
    """What the watchdog needs of a subscription: its name, its call count (bumped before
    each call: with the subscription, it names one call), and where to count a stall."""

    name: str
    received: int

    def stalled(self, blocked_s: float, *, ended: bool) -> None:
        """A call blocked the event loop past the threshold (``ended``: it has returned)."""


class Watchdog:
    """Watches the event-loop thread from a daemon thread (see the module docstring).

    The loop thread writes :attr:`current`; nothing else does. The watchdog thread only reads it
    and the subscription's ``received`` (a torn read costs at most one poll of delay, never a
    false alarm: a warning needs the same call seen on polls ``threshold`` apart).

    Args:
        threshold: Seconds a call may block before the warning; None: no watchdog thread (the
            marks are still written, and cost the same).
    """

    __slots__ = ("_loop_thread", "_stop", "_thread", "_warnings", "current", "threshold")

    def __init__(self, threshold: float | None) -> None:
        self.threshold = threshold
        self.current: Watched | None = None
        """The subscription whose function runs now on the loop thread (None: none does)."""
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._loop_thread = 0
        self._warnings = 0

    @property
    def warnings(self) -> int:
        """Warnings given so far (one per blocked call)."""
        return self._warnings

    @property
    def running(self) -> bool:
        """True while the watchdog thread runs."""
        return self._thread is not None and self._thread.is_alive()

    def start(self, loop_thread: int) -> None:
        """Watch ``loop_thread`` (a ``threading.get_ident()``) from a new daemon thread; nothing
        when the threshold is None or it runs already."""
        if self.threshold is None or self._thread is not None:
            return
        self._loop_thread = loop_thread
        self._stop.clear()
        self._thread = threading.Thread(target=self._watch, name="trainbus-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop and join the watchdog thread. Idempotent; a later :meth:`start` starts anew."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stop.set()
        thread.join()

    # ------------------------------------------------------------------ the watchdog thread
    def _watch(self) -> None:
        threshold = self.threshold
        assert threshold is not None
        poll = min(max(threshold / 10, _MIN_POLL), _MAX_POLL)
        seen: Watched | None = None
        seen_calls = -1
        since = 0.0
        warned = False
        while not self._stop.wait(poll):
            current = self.current
            calls = current.received if current is not None else -1
            now = time.monotonic()
            if current is not seen or calls != seen_calls:
                if warned and seen is not None:
                    self._ended(seen, now - since)
                seen, seen_calls, since, warned = current, calls, now, False
                continue
            if current is not None and not warned and now - since >= threshold:
                warned = True
                self._warn(current, now - since)
        if warned and seen is not None:  # stopped while a call blocked (a flush elsewhere)
            self._ended(seen, time.monotonic() - since)

    def _warn(self, sub: Watched, blocked_s: float) -> None:
        self._warnings += 1
        sub.stalled(blocked_s, ended=False)
        frame = sys._current_frames().get(self._loop_thread)
        stack = "".join(traceback.format_stack(frame)[-_STACK_FRAMES:]) if frame else ""
        del frame
        log.warning(
            "subscriber_blocks_event_loop",
            subscription=sub.name,
            blocked_s=round(blocked_s, 3),
            watchdog_s=self.threshold,
            stack=stack,
            hint="a sync subscriber runs on the event-loop thread and holds every other "
            "subscriber, the barriers and the close: make it async (subscribe_async), sample "
            "its stream (every_s=, every_steps=), or hand the work to a thread",
        )

    def _ended(self, sub: Watched, blocked_s: float) -> None:
        sub.stalled(blocked_s, ended=True)
        log.info("subscriber_unblocked", subscription=sub.name, blocked_s=round(blocked_s, 3))

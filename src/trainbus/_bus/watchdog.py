"""What a subscriber blocks or raises: the :class:`Watchdog` (a daemon thread that warns when
one sync subscriber call holds the event-loop thread) and the :class:`FailureLedger` (counts,
error policies).
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, Literal, Protocol, TypeAlias, get_args

from .. import commands as cmd
from .. import events as ev
from .._exceptions import ConfigError
from .._log import get_logger, worth_logging
from .commands import Doorbell

__all__ = [
    "DEFAULT_WATCHDOG_S",
    "ERROR_POLICIES",
    "ErrorPolicy",
    "FailureLedger",
    "Watchdog",
    "check_policy",
    "name_of",
]


log = get_logger(__name__)

DEFAULT_WATCHDOG_S = 5.0
"""Seconds a sync subscriber may block the event-loop thread before the watchdog warns."""
_MAX_POLL = 0.5
_MIN_POLL = 0.005
_STACK_FRAMES = 25


ErrorPolicy: TypeAlias = Literal["log", "stop", "raise"]
"""What a subscriber's exception does: log it and go on; also send ``StopTraining``; fail the
run (the subscriber's own exception, noted, from ``fit()`` or closing the bus)."""
ERROR_POLICIES: tuple[str, ...] = get_args(ErrorPolicy)


class Watched(Protocol):
    """What the watchdog and the ledger need of a :class:`Subscription` (``received``, bumped
    before each call, names the call)."""

    name: str
    received: int
    policy: ErrorPolicy | None
    failed: int
    stalls: int
    blocked_s: float

    def claim_stop(self) -> bool: ...


class Watchdog:
    """Watches the event-loop thread from a daemon thread: the guard sets :attr:`current`
    around each call (loop thread only); the same call seen on polls ``threshold`` apart is
    warned about once, with the loop thread's stack (docs/reliability.md)."""

    __slots__ = ("_loop_thread", "_stop", "_thread", "current", "threshold")

    def __init__(self, threshold: float | None) -> None:
        self.threshold = threshold
        self.current: Watched | None = None
        """The subscription whose function runs now on the loop thread (None: none does)."""
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._loop_thread = 0

    def start(self, loop_thread: int) -> None:
        """Watch ``loop_thread`` from a new daemon thread (none without a threshold)."""
        if self.threshold is None or self._thread is not None:
            return
        self._loop_thread = loop_thread
        self._stop.clear()
        self._thread = threading.Thread(target=self._watch, name="trainbus-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop and join the watchdog thread. Idempotent."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stop.set()
        thread.join()

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
        sub.stalls += 1  # its seconds are counted once it has returned (_ended)
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
        sub.blocked_s += blocked_s
        log.info("subscriber_unblocked", subscription=sub.name, blocked_s=round(blocked_s, 3))


def check_policy(policy: ErrorPolicy | None) -> ErrorPolicy | None:
    """Validate an ``on_error`` policy (None: the bus default)."""
    if policy is not None and policy not in ERROR_POLICIES:
        raise ConfigError.invalid("on_error", policy, f"one of {ERROR_POLICIES}")
    return policy


def name_of(fn: object) -> str:
    """A readable name for a function or observer (logs and statistics)."""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    return str(name) if name else type(fn).__name__


class FailureLedger:
    """Counts every failure on the bus and applies the subscription's policy (``send`` takes
    the ``"stop"`` policy's command; ``doorbell`` rings when :attr:`fatal` is set)."""

    def __init__(
        self, default_policy: ErrorPolicy, send: Callable[[cmd.Command], None], doorbell: Doorbell
    ) -> None:
        self.default_policy: ErrorPolicy = default_policy
        self._doorbell = doorbell
        self._send = send
        self.failed = 0
        """Failures counted so far (subscribers, operators, completions, scheduled actions)."""
        self.fatal: Exception | None = None
        """The first failure of an ``on_error="raise"`` subscription (its own exception)."""

    def take_fatal(self) -> Exception | None:
        """The ``"raise"`` failure, if any, cleared: the bus' next run starts without it."""
        fatal, self.fatal = self.fatal, None
        return fatal

    def count(self, exc: BaseException | None = None) -> None:
        """Count a failure its owner handled (an upstream error, a scheduled action)."""
        self.failed += 1

    def subscriber_failed(
        self, sub: Watched, exc: Exception, item: Any, *, ended: bool = False
    ) -> None:
        """Count, log (throttled) and apply ``sub``'s policy to ``exc`` raised on ``item``."""
        self.failed += 1
        policy = sub.policy or self.default_policy
        # The traceback only with the first failure (and the last).
        n = sub.failed
        if ended or worth_logging(n):
            log.error(
                "subscriber_failed",
                subscription=sub.name,
                policy=policy,
                failures=n,
                ended=ended,
                exc_info=exc if n == 1 or ended else None,
                **_fields(item),
            )
        if policy == "stop":
            if sub.claim_stop():
                self._send(cmd.StopTraining(reason=f"subscriber {sub.name!r} failed: {exc!r}"))
        elif policy == "raise" and self.fatal is None:
            # The user's exception itself fails the run (``except MyError`` matches at fit()).
            where = ""
            if isinstance(item, ev.BaseEvent):
                where = f" handling {type(item).__name__} (step {item.step}, epoch {item.epoch})"
            exc.add_note(
                f"trainbus: raised by subscriber {sub.name!r}{where}; its on_error="
                "'raise' policy failed the run"
            )
            self.fatal = exc
            self._doorbell.ring()

    def operator_failed(self, observer: Any, exc: Exception, event: object = None) -> None:
        """Count and log an operator that raised past RxPY (policy ``log``)."""
        self.failed += 1
        log.error(
            "subscriber_failed",
            subscription=name_of(observer),
            policy="log",
            exc_info=exc,
            **_fields(event),
        )


def _fields(item: object) -> dict[str, Any]:
    if isinstance(item, ev.BaseEvent):
        return {"event_type": type(item).__name__, "step": item.step, "epoch": item.epoch}
    return {}

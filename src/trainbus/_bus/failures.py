"""The failure ledger: subscriber failures counted, logged without flooding, handled by policy.

Policies: ``"log"`` (go on), ``"stop"`` (send ``StopTraining`` once per subscription),
``"raise"`` (the first such failure becomes :attr:`FailureLedger.fatal`; the loop raises it at
its next poll point, a bare bus on close).

The ledger knows nothing of subscriptions beyond the :class:`FailureSource` protocol: a
subscription keeps its own counters and reports each failure here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, Protocol, TypeAlias

from .. import commands as cmd
from .. import events as ev
from .._exceptions import ConfigError
from .._log import get_logger
from .doorbell import Doorbell

__all__ = [
    "ERROR_POLICIES",
    "ErrorPolicy",
    "FailureLedger",
    "FailureSource",
    "check_policy",
    "name_of",
]

log = get_logger(__name__)

ErrorPolicy: TypeAlias = Literal["log", "stop", "raise"]
"""What a subscriber's exception does: log it and go on; also send ``StopTraining``; fail the
run (the subscriber's exception itself, with a note naming it, from ``fit()`` / from
closing the bus)."""
ERROR_POLICIES: tuple[str, ...] = ("log", "stop", "raise")


def check_policy(policy: ErrorPolicy | None) -> ErrorPolicy | None:
    """Validate an ``on_error`` policy (None means "the bus default").

    Raises:
        ConfigError: ``policy`` is not one of :data:`ERROR_POLICIES`.
    """
    if policy is not None and policy not in ERROR_POLICIES:
        raise ConfigError.invalid("on_error", policy, f"one of {ERROR_POLICIES}")
    return policy


def name_of(fn: object) -> str:
    """A readable name for a function or observer (logs and statistics)."""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    return str(name) if name else type(fn).__name__


class FailureSource(Protocol):
    """What the ledger needs of a failing subscription."""

    @property
    def name(self) -> str: ...

    @property
    def on_error(self) -> ErrorPolicy | None: ...

    @property
    def failed(self) -> int: ...

    def claim_stop(self) -> bool:
        """True the first time only: the ``"stop"`` policy sends one ``StopTraining``."""
        ...


class FailureLedger:
    """Counts every failure on the bus and applies the subscription's policy.

    Args:
        default_policy: Policy of subscriptions made without one.
        send: Puts a command on the back-channel (the ``"stop"`` policy's ``StopTraining``).
    """

    def __init__(
        self,
        default_policy: ErrorPolicy,
        send: Callable[[cmd.Command], None],
        doorbell: Doorbell | None = None,
    ) -> None:
        self.default_policy: ErrorPolicy = default_policy
        self._doorbell = doorbell or Doorbell()
        self._send = send
        self._failed = 0
        self._fatal: Exception | None = None

    @property
    def failed(self) -> int:
        """Failures counted so far (subscribers, operators, completions, scheduled actions)."""
        return self._failed

    @property
    def fatal(self) -> Exception | None:
        """The first failure of a subscription with ``on_error="raise"``, if any: the
        subscriber's own exception, with a note naming the subscription (and event)."""
        return self._fatal

    def take_fatal(self) -> Exception | None:
        """The ``"raise"`` failure, if any, cleared: the bus' next run starts without it."""
        fatal, self._fatal = self._fatal, None
        return fatal

    def count(self) -> None:
        """Count a failure that needs no logging here (already reported by its owner)."""
        self._failed += 1

    def scheduler_failed(self, exc: BaseException) -> None:
        """A scheduled action raised (the scheduler logs it): count it."""
        self._failed += 1

    def subscriber_failed(
        self, sub: FailureSource, exc: Exception, item: Any, *, ended: bool = False
    ) -> None:
        """Count, log (throttled) and apply the policy of ``sub``, which already counted it.

        Args:
            sub: The failing subscription (its ``failed`` includes this failure).
            exc: What it raised.
            item: The item it was handling (an event adds its type, step and epoch to the log).
            ended: The failure ended the subscription (always logged with its traceback).
        """
        self._failed += 1
        policy = sub.on_error or self.default_policy
        # The first failure is logged with its traceback; repeats only at 10, 100, 1000, ...
        # failures, so a subscriber that fails on every step cannot flood the log. Every
        # failure is counted in statistics() either way.
        n = sub.failed
        if n == 1 or ended or (n >= 10 and n == 10 ** (len(str(n)) - 1)):
            fields: dict[str, Any] = {}
            if isinstance(item, ev.BaseEvent):
                fields = {"event_type": type(item).__name__, "step": item.step, "epoch": item.epoch}
            log.error(
                "subscriber_failed",
                subscription=sub.name,
                policy=policy,
                failures=n,
                ended=ended,
                exc_info=exc if n == 1 or ended else None,
                **fields,
            )
        if policy == "stop":
            if sub.claim_stop():
                self._send(cmd.StopTraining(reason=f"subscriber {sub.name!r} failed: {exc!r}"))
        elif policy == "raise" and self._fatal is None:
            # The user's exception itself fails the run (``except MyError`` matches at fit()),
            # with a note saying where trainbus caught it.
            where = ""
            if isinstance(item, ev.BaseEvent):
                where = f" handling {type(item).__name__} (step {item.step}, epoch {item.epoch})"
            exc.add_note(f"trainbus: raised by subscriber {sub.name!r}{where}; its on_error="
                         "'raise' policy failed the run")  # fmt: skip
            self._fatal = exc
            self._doorbell.ring()

    def chain_failed(self, observer: Any, exc: Exception, event: ev.BaseEvent) -> None:
        """An operator raised past RxPY into the dispatch: count and log it (policy ``log``)."""
        self._failed += 1
        log.error(
            "subscriber_failed",
            subscription=name_of(observer),
            policy="log",
            event_type=type(event).__name__,
            step=event.step,
            epoch=event.epoch,
            exc_info=exc,
        )

    def completion_failed(self, observer: Any, exc: Exception) -> None:
        """Completing a stream at close raised: count and log it."""
        self._failed += 1
        log.error("subscriber_failed", subscription=name_of(observer), exc_info=exc)

"""Subscriber failures: counted, logged without flooding, handled by policy (part of EventBus).

Policies: ``"log"`` (go on), ``"stop"`` (send ``StopTraining`` once), ``"raise"`` (the first such
failure becomes :attr:`failure`; the loop raises it at its next poll point, a bare bus on close).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import structlog

from . import commands as cmd
from . import events as ev
from ._exceptions import ConfigError, SubscriberError
from ._subscription import ERROR_POLICIES, ErrorPolicy, Subscription

__all__ = ["FailureMixin", "name_of"]

log = structlog.get_logger("trainbus._bus")


def name_of(fn: object) -> str:
    """A readable name for a function or observer (logs and statistics)."""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    return str(name) if name else type(fn).__name__


class FailureMixin:
    """Failure accounting and policies."""

    default_on_error: ErrorPolicy
    _failed: int
    _fatal: SubscriberError | None

    if TYPE_CHECKING:

        def send(self, command: cmd.Command) -> None: ...  # provided by CommandChannelMixin

    @staticmethod
    def _check_policy(policy: ErrorPolicy | None) -> ErrorPolicy:
        if policy is not None and policy not in ERROR_POLICIES:
            raise ConfigError.invalid("on_error", policy, f"one of {ERROR_POLICIES}")
        return policy  # type: ignore[return-value]

    def _subscriber_failed(
        self, sub: Subscription, exc: Exception, item: Any, *, ended: bool = False
    ) -> None:
        sub.failed += 1
        sub.last_error = repr(exc)
        self._failed += 1
        policy = sub.on_error or self.default_on_error
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
        if policy == "stop" and not sub.stop_sent:
            sub.stop_sent = True
            self.send(cmd.StopTraining(reason=f"subscriber {sub.name!r} failed: {exc!r}"))
        elif policy == "raise" and self._fatal is None:
            fatal = SubscriberError(sub.name, exc)
            fatal.__cause__ = exc
            self._fatal = fatal

    def _chain_failed(self, observer: Any, exc: Exception, event: ev.BaseEvent) -> None:
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

    def _scheduler_failed(self, exc: BaseException) -> None:
        self._failed += 1

    @property
    def failure(self) -> SubscriberError | None:
        """The first failure of a subscription with ``on_error="raise"``, if any."""
        return self._fatal

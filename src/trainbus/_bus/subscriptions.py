"""Subscription records, and the guarded observer every bus subscription ends in.

Every subscription made through the bus gets a :class:`Subscription` record that counts what it
received, dropped and failed, and that is also the ``Disposable`` the subscribe call returns.
Counters are plain ints touched only on the event-loop thread, so they need no lock. Failures go
to the :class:`~trainbus._bus.failures.FailureLedger` the record is given; a full ``"block"``
buffer of an async subscription (``async_subscription.py``) raises the :class:`Backpressure`
flag the training loop checks at its poll points (``pressure.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from reactivex import abc

from .failures import ErrorPolicy, FailureLedger
from .pressure import Backpressure
from .statistics import SubscriptionStatistics
from .watchdog import Watchdog

__all__ = ["Backpressure", "ErrorPolicy", "GuardedObserver", "Subscription"]


class Subscription(abc.DisposableBase):
    """Handle of a bus subscription: dispose it to unsubscribe; read its ``statistics()``."""

    kind: Literal["sync", "async"] = "sync"

    def __init__(self, ledger: FailureLedger, name: str, on_error: ErrorPolicy | None) -> None:
        self._ledger = ledger
        self.name = name
        self.on_error = on_error
        self.active = True
        self.received = 0
        self.completed = 0
        self.failed = 0
        self.dropped = 0
        self.cancelled = 0
        self.waited_s = 0.0
        """Seconds the training thread waited on this subscription (back-pressure, barriers,
        decision steps)."""
        self.last_error: str | None = None
        self.stalls = 0
        self.blocked_s = 0.0
        self.upstream: abc.DisposableBase | None = None
        self._stop_sent = False
        self._held: list[abc.DisposableBase] = []

    @property
    def delivered(self) -> int:
        return self.received - self.dropped

    def fail(self, exc: Exception, item: Any, *, ended: bool = False) -> None:
        """Count a failure of this subscription and report it to the ledger (its policy)."""
        self.failed += 1
        self.last_error = repr(exc)
        self._ledger.subscriber_failed(self, exc, item, ended=ended)

    def error_handled(self, exc: Exception) -> None:
        """Count an upstream error the user's ``on_error`` callback handles (it still ended the
        chain), here and in the bus total."""
        self.failed += 1
        self.last_error = repr(exc)
        self._ledger.count()

    def stalled(self, blocked_s: float, *, ended: bool) -> None:
        """Count a call that blocked the event loop past the watchdog's threshold (called on
        the watchdog thread, its only writer of these two counters): once when it is seen,
        and its seconds once it has returned."""
        if ended:
            self.blocked_s += blocked_s
        else:
            self.stalls += 1

    def add_waited(self, seconds: float) -> None:
        """Count ``seconds`` the training thread waited on this subscription."""
        self.waited_s += seconds

    def claim_stop(self) -> bool:
        """True the first time only: the ``"stop"`` policy sends one ``StopTraining``."""
        first, self._stop_sent = not self._stop_sent, True
        return first

    def hold(self, resource: abc.DisposableBase) -> None:
        """Dispose ``resource`` when this subscription is disposed (its decision steps)."""
        self._held.append(resource)

    def dispose(self) -> None:
        """Unsubscribe. Idempotent."""
        self.active = False
        if self.upstream is not None:
            self.upstream.dispose()
        held, self._held = self._held, []
        for resource in held:
            resource.dispose()

    def statistics(self) -> SubscriptionStatistics:
        """A frozen snapshot of this subscription's counters."""
        return SubscriptionStatistics(
            name=self.name,
            kind=self.kind,
            active=self.active,
            received=self.received,
            delivered=self.delivered,
            completed=self.completed,
            failed=self.failed,
            dropped=self.dropped,
            queued=self.queued,
            in_flight=self.in_flight,
            cancelled=self.cancelled,
            last_error=self.last_error,
            stalls=self.stalls,
            blocked_s=self.blocked_s,
            waited_s=self.waited_s,
        )

    @property
    def queued(self) -> int:
        return 0

    @property
    def in_flight(self) -> int:
        return 0

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} active={self.active}>"


class GuardedObserver(abc.ObserverBase[Any]):
    """The observer at the end of every bus subscription: counts, and isolates failures.

    RxPY re-raises an observer's exception into the ``on_next`` that called it, which would
    reach the publisher's dispatch; here it is reported to the failure ledger instead, under the
    subscription's policy, and the subscription keeps receiving. ``on_error`` means an operator
    upstream failed and Rx has ended the chain: it is reported the same way unless the user gave
    an ``on_error`` callback. Each call of ``on_next`` is marked on the bus' :class:`Watchdog`
    (two attribute writes), which warns when one blocks the event loop too long.
    """

    __slots__ = ("_on_completed", "_on_error", "_on_next", "_sub", "_watchdog")

    def __init__(
        self,
        sub: Subscription,
        on_next: Callable[[Any], Any] | None,
        on_error: Callable[[Exception], Any] | None,
        on_completed: Callable[[], Any] | None,
        watchdog: Watchdog | None = None,
    ) -> None:
        self._sub = sub
        self._on_next = on_next
        self._on_error = on_error
        self._on_completed = on_completed
        self._watchdog = Watchdog(None) if watchdog is None else watchdog

    def on_next(self, value: Any) -> None:
        sub = self._sub
        sub.received += 1
        if self._on_next is None:
            sub.completed += 1
            return
        watchdog = self._watchdog
        outer = watchdog.current  # a subscriber may flush(): the inner call restores it
        watchdog.current = sub  # with sub.received (just counted), it names this very call
        try:
            self._on_next(value)
        except Exception as exc:
            sub.fail(exc, value)
        finally:
            watchdog.current = outer
        sub.completed += 1

    def on_error(self, error: Exception) -> None:
        sub = self._sub
        sub.active = False
        if self._on_error is None:
            sub.fail(error, None, ended=True)
            return
        sub.error_handled(error)
        try:
            self._on_error(error)
        except Exception as exc:
            sub.fail(exc, None, ended=True)

    def on_completed(self) -> None:
        sub = self._sub
        sub.active = False
        if self._on_completed is not None:
            try:
                self._on_completed()
            except Exception as exc:
                sub.fail(exc, None, ended=True)

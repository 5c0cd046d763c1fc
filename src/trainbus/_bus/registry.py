"""The subscriptions of one bus: the records in order, and the back-pressure they share.

:class:`SubscriptionSet` creates every :class:`~trainbus._bus.subscriptions.Subscription` (so each
is given the bus' failure ledger), starts async workers once the bus runs, and holds the
:class:`~trainbus._bus.pressure.Backpressure` their ``"block"`` buffers share.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Any

from reactivex import Observable, abc

from .._exceptions import BusClosedError, ConfigError
from .async_subscription import (
    DEFAULT_OVERFLOW,
    OVERFLOWS,
    AsyncFeeder,
    AsyncSubscription,
    Overflow,
)
from .clock import DecisionStamp
from .doorbell import Doorbell
from .failures import ErrorPolicy, FailureLedger, check_policy, name_of
from .pressure import Backpressure
from .spent import Spent
from .statistics import SubscriptionStatistics
from .subscriptions import GuardedObserver, Subscription
from .tasks import TaskSet
from .watchdog import Watchdog

__all__ = ["SubscriptionSet"]


def _is_async(fn: Callable[..., Any]) -> bool:
    """True for an ``async def`` function or method, a ``functools.partial`` of one, or an
    object whose ``__call__`` is ``async def``."""
    if inspect.iscoroutinefunction(fn):
        return True
    call = getattr(type(fn), "__call__", None)  # noqa: B004  (the class' own __call__)
    return not inspect.isfunction(fn) and inspect.iscoroutinefunction(call)


class SubscriptionSet:
    """Every subscription of one bus, in order, and the back-pressure flag they share.

    Args:
        ledger: Where the subscriptions report their failures.
        spent: Where async subscriptions put the items they are done with (``spent.py``).
        doorbell: Rung when a ``"block"`` buffer goes over capacity (the loop then waits).
        stamp: The dispatch's stamp: async subscriptions note which event fed them.
        watchdog: Where sync subscriptions mark their calls (``watchdog.py``; default: one
            that never watches).
    """

    def __init__(
        self,
        ledger: FailureLedger,
        spent: Spent | None = None,
        doorbell: Doorbell | None = None,
        stamp: DecisionStamp | None = None,
        watchdog: Watchdog | None = None,
    ) -> None:
        self._stamp = stamp or DecisionStamp()
        self._ledger = ledger
        self._watchdog = Watchdog(None) if watchdog is None else watchdog
        self._spent = Spent(maxlen=0) if spent is None else spent  # none: freed at once
        self._subs: list[Subscription] = []
        self._tasks: TaskSet | None = None
        self._open = True
        self.backpressure = Backpressure(doorbell)

    def check_open(self) -> None:
        """Raises ``BusClosedError`` once the bus closes (no new subscription then)."""
        if not self._open:
            raise BusClosedError("the bus is closed; subscribe before it closes")

    def close(self) -> None:
        """Refuse new subscriptions from now on."""
        self._open = False

    def add_guarded(
        self,
        source: Observable[Any],
        on_next: Callable[[Any], Any],
        on_rx_error: Callable[[Exception], Any] | None,
        on_completed: Callable[[], Any] | None,
        *,
        policy: ErrorPolicy | None,
        name: str | None,
        scheduler: abc.SchedulerBase,
    ) -> Subscription:
        """Subscribe validated callbacks to ``source`` behind a :class:`GuardedObserver`."""
        sub = Subscription(self._ledger, name or name_of(on_next), policy)
        self._subs.append(sub)
        guard = GuardedObserver(sub, on_next, on_rx_error, on_completed, self._watchdog)
        sub.upstream = source.subscribe(guard, scheduler=scheduler)
        return sub

    @staticmethod
    def check_async(
        fn: Callable[[Any], Awaitable[Any]],
        *,
        concurrency: int,
        buffer: int | None,
        overflow: Overflow | None,
        policy: ErrorPolicy | None,
    ) -> tuple[int, Overflow]:
        """Validate an async subscription's options (the same answer on every rank, whether
        the subscription runs there or not); returns the buffer size and the overflow policy
        (defaults filled in: ``DEFAULT_OVERFLOW``, 64 items, 1 for ``"latest"``).

        Raises:
            ConfigError: for an ``fn`` that is not an async function (a plain ``def`` would
                fail with a ``TypeError`` on every item) or an argument out of range.
        """
        if not callable(fn):
            raise ConfigError.invalid("fn", fn, "an async function of one item")
        if not _is_async(fn):
            raise ConfigError.invalid(
                "fn", getattr(fn, "__qualname__", repr(fn)), "an async def function of one "
                "item; for a plain function use bus.subscribe(stream, fn), which runs it on "
                "the event loop",
            )  # fmt: skip
        if not isinstance(concurrency, int) or concurrency < 1:
            raise ConfigError.invalid("concurrency", concurrency, "an int >= 1")
        if overflow is None:
            overflow = DEFAULT_OVERFLOW
        if overflow not in OVERFLOWS:
            raise ConfigError.invalid("overflow", overflow, f"one of {OVERFLOWS}")
        if buffer is None:
            buffer = 1 if overflow == "latest" else 64
        if not isinstance(buffer, int) or buffer < 1:
            raise ConfigError.invalid("buffer", buffer, "an int >= 1")
        if overflow == "latest" and buffer != 1:
            raise ConfigError.invalid("buffer", buffer, "1 (or omitted) with overflow='latest'")
        check_policy(policy)
        return buffer, overflow

    def add_async(
        self,
        fn: Callable[[Any], Awaitable[Any]],
        connect: Callable[[abc.ObserverBase[Any]], abc.DisposableBase],
        *,
        concurrency: int,
        buffer: int | None,
        overflow: Overflow | None,
        policy: ErrorPolicy | None,
        name: str | None,
        decides: bool = False,
    ) -> AsyncSubscription:
        """Validate and add an async subscription; ``connect`` subscribes its feeder upstream.

        Raises:
            ConfigError: for a non-callable ``fn`` or an argument out of range.
            BusClosedError: the bus is closed.
        """
        size, policy_ = self.check_async(fn, concurrency=concurrency, buffer=buffer,
                                         overflow=overflow, policy=policy)  # fmt: skip
        self.check_open()
        sub = AsyncSubscription(
            self._ledger,
            name or name_of(fn),
            fn,
            concurrency=concurrency,
            buffer=size,
            overflow=policy_,
            on_error=policy,
            backpressure=self.backpressure,
            spent=self._spent,
            decides=decides,
            stamp=self._stamp,
        )
        if self._tasks is not None:
            # Its workers' events and tasks belong to the event loop, whichever thread
            # subscribes (a hook's subscription comes from the training thread).
            self._tasks.on_loop(sub.start, self._tasks)
        self._subs.append(sub)
        sub.upstream = connect(AsyncFeeder(sub))
        return sub

    def start(self, tasks: TaskSet) -> None:
        """The bus runs: start the active async subscriptions (and later ones at once) in
        ``tasks`` (the bus' :class:`TaskSet`)."""
        self._tasks = tasks
        for sub in self.asyncs():
            if sub.active:
                sub.start(tasks)

    def suspend(self) -> None:
        """The bus suspends: its task group is about to stop; the async subscriptions keep
        their state (and start again with the next :meth:`start`)."""
        self._tasks = None
        for sub in self.asyncs():
            sub.suspend()

    def all(self) -> tuple[Subscription, ...]:
        """Every subscription, in order (inactive ones included)."""
        return tuple(self._subs)

    def asyncs(self) -> list[AsyncSubscription]:
        """The async subscriptions, in order."""
        return [s for s in self._subs if isinstance(s, AsyncSubscription)]

    def statistics(self) -> tuple[SubscriptionStatistics, ...]:
        """Every subscription's snapshot, in order."""
        return tuple(s.statistics() for s in self._subs)

    def pending(self) -> dict[str, int]:
        """Items waiting or running per async subscription that has any (what a close waits
        for)."""
        return {s.name: s.pending for s in self.asyncs() if s.pending}

    def cancel_pending(self) -> dict[str, int]:
        """Cancel every async subscription's workers now; what they held counts as cancelled.

        Returns:
            Items pending per subscription when cancelled (only those with any).
        """
        pending = self.pending()
        for sub in self.asyncs():
            sub.cancel()
        return pending

"""The subscriptions of one bus: the records in order, and the back-pressure they share.

:class:`SubscriptionSet` creates every :class:`~trainbus.bus.subscriptions.Subscription` (so each
is given the bus' failure ledger), starts async workers once the bus runs, and waits for
``"block"`` buffers over capacity when the dispatcher asks it to.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio
from anyio.abc import TaskGroup
from reactivex import Observable, abc

from .._exceptions import BusClosedError, ConfigError
from .async_subscription import OVERFLOWS, AsyncFeeder, AsyncSubscription, Overflow
from .failures import ErrorPolicy, FailureLedger, check_policy, name_of
from .spent import Spent
from .statistics import SubscriptionStatistics
from .subscriptions import Backpressure, GuardedObserver, Subscription

__all__ = ["SubscriptionSet"]


class SubscriptionSet:
    """Every subscription of one bus, in order, and the back-pressure flag they share.

    Args:
        ledger: Where the subscriptions report their failures.
        spent: Where async subscriptions put the items they are done with (``spent.py``).
    """

    def __init__(self, ledger: FailureLedger, spent: Spent | None = None) -> None:
        self._ledger = ledger
        self._spent = Spent(maxlen=0) if spent is None else spent  # none: freed at once
        self._subs: list[Subscription] = []
        self._tg: TaskGroup | None = None
        self._open = True
        self.backpressure = Backpressure()

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
        on_error: Callable[[Exception], Any] | None,
        on_completed: Callable[[], Any] | None,
        *,
        policy: ErrorPolicy | None,
        name: str | None,
        scheduler: abc.SchedulerBase,
    ) -> Subscription:
        """Subscribe validated callbacks to ``source`` behind a :class:`GuardedObserver`."""
        sub = Subscription(self._ledger, name or name_of(on_next), policy)
        self._subs.append(sub)
        guard = GuardedObserver(sub, on_next, on_error, on_completed)
        sub.upstream = source.subscribe(guard, scheduler=scheduler)
        return sub

    @staticmethod
    def check_async(
        fn: Callable[[Any], Awaitable[Any]],
        *,
        concurrency: int,
        buffer: int | None,
        overflow: Overflow,
        policy: ErrorPolicy | None,
    ) -> int:
        """Validate an async subscription's options (the same answer on every rank, whether
        the subscription runs there or not); returns the buffer size (its default filled in).

        Raises:
            ConfigError: for a non-callable ``fn`` or an argument out of range.
        """
        if not callable(fn):
            raise ConfigError.invalid("fn", fn, "an async function of one item")
        if not isinstance(concurrency, int) or concurrency < 1:
            raise ConfigError.invalid("concurrency", concurrency, "an int >= 1")
        if overflow not in OVERFLOWS:
            raise ConfigError.invalid("overflow", overflow, f"one of {OVERFLOWS}")
        if buffer is None:
            buffer = 1 if overflow == "latest" else 64
        if not isinstance(buffer, int) or buffer < 1:
            raise ConfigError.invalid("buffer", buffer, "an int >= 1")
        if overflow == "latest" and buffer != 1:
            raise ConfigError.invalid("buffer", buffer, "1 (or omitted) with overflow='latest'")
        check_policy(policy)
        return buffer

    def add_async(
        self,
        fn: Callable[[Any], Awaitable[Any]],
        connect: Callable[[abc.ObserverBase[Any]], abc.DisposableBase],
        *,
        concurrency: int,
        buffer: int | None,
        overflow: Overflow,
        policy: ErrorPolicy | None,
        name: str | None,
        decides: bool = False,
    ) -> AsyncSubscription:
        """Validate and add an async subscription; ``connect`` subscribes its feeder upstream.

        Raises:
            ConfigError: for a non-callable ``fn`` or an argument out of range.
            BusClosedError: the bus is closed.
        """
        buffer = self.check_async(fn, concurrency=concurrency, buffer=buffer, overflow=overflow,
                                  policy=policy)  # fmt: skip
        self.check_open()
        sub = AsyncSubscription(
            self._ledger,
            name or name_of(fn),
            fn,
            concurrency=concurrency,
            buffer=buffer,
            overflow=overflow,
            on_error=policy,
            backpressure=self.backpressure,
            spent=self._spent,
            decides=decides,
        )
        self._subs.append(sub)
        if self._tg is not None:
            sub.start(self._tg)
        sub.upstream = connect(AsyncFeeder(sub))
        return sub

    def start(self, tg: TaskGroup) -> None:
        """The bus runs: start the active async subscriptions (and later ones at once) in
        ``tg``."""
        self._tg = tg
        for sub in self.asyncs():
            if sub.active:
                sub.start(tg)

    def suspend(self) -> None:
        """The bus suspends: its task group is about to stop; the async subscriptions keep
        their state (and start again with the next :meth:`start`)."""
        self._tg = None
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

    async def relieve_pressure(self, close_deadline: float | None) -> None:
        """Wait until every ``"block"`` buffer is back within capacity, then clear the flag.

        Args:
            close_deadline: While closing, the loop time past which a stalled subscriber is
                cancelled instead of waited for (None while running).
        """
        for sub in self._subs:
            if isinstance(sub, AsyncSubscription) and sub.over_capacity:
                if close_deadline is None:
                    await sub.wait_for_room()
                    continue
                # Closing: a "block" subscriber stalled on a full buffer must not hold the rest
                # of the drain (and close itself) forever. Past close_timeout it is cancelled,
                # like any async subscriber still busy then; its items count as cancelled.
                with anyio.move_on_at(close_deadline):
                    await sub.wait_for_room()
                if sub.over_capacity:
                    sub.cancel()  # no-op (and nothing to wait for) if never started
                    await sub.wait_finished()
        self.backpressure.clear()

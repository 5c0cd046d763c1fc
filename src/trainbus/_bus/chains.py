"""The guard every bus chain ends in: what a :class:`~trainbus._bus.observable.BusObservable`
needs of its bus, and nothing a user calls.

A chain born on the bus (``bus.events``, ``bus.stream(...)`` and whatever their ``pipe()``
returns) subscribes through :class:`Chains`: the observer is wrapped in the bus' guard under
its error policy (``on_error``), the chain gets the bus' Rx scheduler, a subscription made
for other ranks is inert, and the pipeline's decision steps are declared to the step clock
for the subscription's lifetime. The :class:`~trainbus.EventBus` builds one and hands it to
every chain it makes; users never hold it.
"""

from __future__ import annotations

from typing import Any

from reactivex import Observable, abc
from reactivex.disposable import Disposable

from .clock import DecisionSteps, StepClock
from .failures import ErrorPolicy, FailureLedger, check_policy
from .observable import normalize_observer
from .rank_filter import RankFilter, Ranks
from .registry import SubscriptionSet
from .scheduler import ChainScheduler
from .subscriptions import Subscription

__all__ = ["Chains"]


class Chains:
    """Subscribes a chain's last observer behind the bus' guard (a ``BusChains``).

    Args:
        subscriptions: The bus' subscription records (where a guarded observer is added).
        ranks: The bus' rank filter (a subscription for other ranks is inert here).
        ledger: The bus' failure ledger (an inert subscription's counters).
        clock: The step clock the pipelines' decision steps are declared to.
        rx_scheduler: What chains get: timers on the bus' Rx scheduler, "now" work inline.
    """

    def __init__(
        self,
        subscriptions: SubscriptionSet,
        ranks: RankFilter,
        ledger: FailureLedger,
        clock: StepClock,
        rx_scheduler: ChainScheduler,
    ) -> None:
        self._subs = subscriptions
        self._ranks = ranks
        self._ledger = ledger
        self._clock = clock
        self._chain_scheduler = rx_scheduler

    @property
    def rx_scheduler(self) -> abc.SchedulerBase:
        """The scheduler bus chains get: timers on the bus' Rx scheduler, "now" work inline."""
        return self._chain_scheduler

    def inert(self, name: str | None, on_error: ErrorPolicy | None) -> Subscription:
        """A subscription for other ranks: registered nowhere, so it costs nothing."""
        sub = Subscription(self._ledger, name or "inert", on_error)
        sub.dispose()
        return sub

    def subscribe_observer(
        self,
        source: Observable[Any],
        observer: Any,
        on_rx_error: Any = None,
        on_completed: Any = None,
        *,
        on_error: ErrorPolicy | None = None,
        name: str | None = None,
        scheduler: abc.SchedulerBase | None = None,
        ranks: Ranks = None,
    ) -> Subscription:
        """Subscribe ``observer`` (function or Rx observer) to ``source`` behind the guard.

        Args:
            source: The chain to subscribe to.
            observer: A function of one item, or an Rx observer.
            on_rx_error: The Rx error callback of a function observer (an error the chain
                itself emits); None: the subscription's policy handles it.
            on_completed: Called when the chain completes.
            on_error: The error policy (``"log"``, ``"stop"``, ``"raise"``; None: the bus').
            name: Name in logs and statistics.
            scheduler: Overrides the bus' Rx scheduler for this chain.
            ranks: Where it runs under torchrun.

        Returns:
            The subscription (inert on a rank it does not run on).

        Raises:
            ConfigError: ``observer`` is neither callable nor an observer; a callback is not
                callable; unknown policy or ranks.
            BusClosedError: the bus is closed.
        """
        self._subs.check_open()
        on_next, on_rx_error, on_completed = normalize_observer(observer, on_rx_error, on_completed)
        policy = check_policy(on_error)
        if not self._ranks.runs_here(ranks):
            return self.inert(name, policy)
        chain = ChainScheduler(scheduler) if scheduler else self._chain_scheduler
        return self._subs.add_guarded(
            source,
            on_next,
            on_rx_error,
            on_completed,
            policy=policy,
            name=name,
            scheduler=chain,
        )

    def declare(self, decision_steps: tuple[DecisionSteps, ...]) -> abc.DisposableBase:
        """Declare decision steps to the step clock until the result is disposed (what
        subscribing a pipeline with ``tbops.every(n)`` / ``tbops.once(at=k)`` does)."""
        clock = self._clock
        keys = clock.declare(*decision_steps)
        return Disposable(lambda: clock.remove(keys))

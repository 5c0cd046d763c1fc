"""The event bus and what its subscriptions hand back.

:class:`EventBus` is what a program builds (``Trainer(..., bus=EventBus(...))``) or gets
(``trainer.bus``); the other names here are what its methods return or raise, for annotations
and ``except`` clauses: a :class:`Subscription` (:class:`AsyncSubscription` for an async
subscriber), the :class:`BusObservable` that ``bus.events`` and ``bus.stream(...)`` are, the
:class:`BusStatistics` of ``bus.statistics()``, and the :class:`AnyioScheduler` that timed Rx
operators run on. The implementation is private (``trainbus._bus``).
"""

from .._bus import CommandError as CommandError
from .._bus import EventBus as EventBus
from .._bus.scheduler import AnyioScheduler as AnyioScheduler
from .._bus.subscriptions import AsyncSubscription as AsyncSubscription
from .._bus.subscriptions import BusObservable as BusObservable
from .._bus.subscriptions import BusStatistics as BusStatistics
from .._bus.subscriptions import LostWork as LostWork
from .._bus.subscriptions import Subscription as Subscription
from .._bus.subscriptions import SubscriptionStatistics as SubscriptionStatistics
from .._exceptions import BusClosedError as BusClosedError

__all__ = [
    "AnyioScheduler",
    "AsyncSubscription",
    "BusClosedError",
    "BusObservable",
    "BusStatistics",
    "CommandError",
    "EventBus",
    "LostWork",
    "Subscription",
    "SubscriptionStatistics",
]

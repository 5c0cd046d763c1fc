"""The event bus (:class:`EventBus`) and what its methods return or raise, for annotations and
``except`` clauses; the implementation is private (``trainbus._bus``). See docs/bus.md.
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

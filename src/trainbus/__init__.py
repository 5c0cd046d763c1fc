"""trainbus: a PyTorch trainer whose callback system is an async-first reactive event bus.

This module only re-exports; see ``trainbus.events``, ``trainbus.commands``,
``trainbus.operators`` and ``trainbus.testing`` for the topic modules.
"""

from ._attachment import AttachError as AttachError
from ._attachment import Attachment as Attachment
from ._attachment import attach as attach
from ._bus import CommandError as CommandError
from ._bus import EventBus as EventBus
from ._bus.async_subscription import AsyncSubscription as AsyncSubscription
from ._bus.observable import BusObservable as BusObservable
from ._bus.scheduler import AnyioScheduler as AnyioScheduler
from ._bus.statistics import BusStatistics as BusStatistics
from ._bus.statistics import LostWork as LostWork
from ._bus.statistics import SubscriptionStatistics as SubscriptionStatistics
from ._bus.subscriptions import Subscription as Subscription
from ._exceptions import BusClosedError as BusClosedError
from ._exceptions import CheckpointError as CheckpointError
from ._exceptions import CheckpointWriteError as CheckpointWriteError
from ._exceptions import ConfigError as ConfigError
from ._exceptions import DistributedError as DistributedError
from ._exceptions import EvaluationJobError as EvaluationJobError
from ._exceptions import LaunchError as LaunchError
from ._exceptions import LostWorkError as LostWorkError
from ._exceptions import MissingExtraError as MissingExtraError
from ._exceptions import NonFiniteLossError as NonFiniteLossError
from ._exceptions import RecordedError as RecordedError
from ._exceptions import SubscriberError as SubscriberError
from ._exceptions import TrainbusError as TrainbusError
from ._exceptions import TrainingError as TrainingError
from ._launcher import Launcher as Launcher
from ._launcher import LaunchResult as LaunchResult
from ._launcher import launch as launch
from ._loop.custom import TrainContext as TrainContext
from ._loop.hooks import HookHandle as HookHandle
from ._loop.hooks import StepContext as StepContext
from ._loop.set_metrics import Perplexity as Perplexity
from ._loop.set_metrics import SetMetric as SetMetric
from ._loop.set_metrics import TokenAccuracy as TokenAccuracy
from ._replay import replay as replay
from ._seeding import seed_everything as seed_everything
from ._trainer.trainer import FitResult as FitResult
from ._trainer.trainer import Trainer as Trainer
from .callbacks._base import Callback as Callback
from .callbacks._base import GlobalCallbackHandle as GlobalCallbackHandle
from .callbacks._base import RunPlan as RunPlan
from .callbacks._base import register_global_callback as register_global_callback
from .events import Ending as Ending

__all__ = [
    "AnyioScheduler",
    "AsyncSubscription",
    "AttachError",
    "Attachment",
    "BusClosedError",
    "BusObservable",
    "BusStatistics",
    "Callback",
    "CheckpointError",
    "CheckpointWriteError",
    "CommandError",
    "ConfigError",
    "DistributedError",
    "Ending",
    "EvaluationJobError",
    "EventBus",
    "FitResult",
    "GlobalCallbackHandle",
    "HookHandle",
    "LaunchError",
    "LaunchResult",
    "Launcher",
    "LostWork",
    "LostWorkError",
    "MissingExtraError",
    "NonFiniteLossError",
    "Perplexity",
    "RecordedError",
    "RunPlan",
    "SetMetric",
    "StepContext",
    "SubscriberError",
    "Subscription",
    "SubscriptionStatistics",
    "TokenAccuracy",
    "TrainContext",
    "TrainbusError",
    "Trainer",
    "TrainingError",
    "attach",
    "launch",
    "register_global_callback",
    "replay",
    "seed_everything",
]

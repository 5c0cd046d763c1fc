"""trainbus: a PyTorch trainer whose callback system is an async-first reactive event bus.

This module only re-exports; see ``trainbus.events``, ``trainbus.commands``,
``trainbus.operators`` and ``trainbus.testing`` for the topic modules.
"""

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
from .attachment import AttachError as AttachError
from .attachment import Attachment as Attachment
from .attachment import attach as attach
from .bus import CommandError as CommandError
from .bus import EventBus as EventBus
from .bus.async_subscription import AsyncSubscription as AsyncSubscription
from .bus.observable import BusObservable as BusObservable
from .bus.scheduler import AnyioScheduler as AnyioScheduler
from .bus.statistics import BusStatistics as BusStatistics
from .bus.statistics import LostWork as LostWork
from .bus.statistics import SubscriptionStatistics as SubscriptionStatistics
from .bus.subscriptions import Subscription as Subscription
from .callbacks._base import Callback as Callback
from .callbacks._base import GlobalCallbackHandle as GlobalCallbackHandle
from .callbacks._base import RunPlan as RunPlan
from .callbacks._base import register_global_callback as register_global_callback
from .events import Ending as Ending
from .launcher import Launcher as Launcher
from .launcher import LaunchResult as LaunchResult
from .launcher import launch as launch
from .loop.custom import TrainContext as TrainContext
from .loop.hooks import HookHandle as HookHandle
from .loop.hooks import StepContext as StepContext
from .loop.set_metrics import Perplexity as Perplexity
from .loop.set_metrics import SetMetric as SetMetric
from .loop.set_metrics import TokenAccuracy as TokenAccuracy
from .replay import replay as replay
from .seeding import seed_everything as seed_everything
from .trainer import Accumulate as Accumulate
from .trainer import CheckpointDir as CheckpointDir
from .trainer import EvalSchedule as EvalSchedule
from .trainer import FitResult as FitResult
from .trainer import PerEpoch as PerEpoch
from .trainer import Trainer as Trainer

__all__ = [
    "Accumulate",
    "AnyioScheduler",
    "AsyncSubscription",
    "AttachError",
    "Attachment",
    "BusClosedError",
    "BusObservable",
    "BusStatistics",
    "Callback",
    "CheckpointDir",
    "CheckpointError",
    "CheckpointWriteError",
    "CommandError",
    "ConfigError",
    "DistributedError",
    "Ending",
    "EvalSchedule",
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
    "PerEpoch",
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

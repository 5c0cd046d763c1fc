"""trainbus: a PyTorch trainer whose callback system is an async-first reactive event bus.

The public modules are this one and its topic modules: ``trainbus.events``,
``trainbus.commands``, ``trainbus.operators``, ``trainbus.callbacks``, ``trainbus.checkpoint``,
``trainbus.bus``, ``trainbus.testing``, ``trainbus.ray`` and ``trainbus.integrations.*``.
Everything under an underscored name is private and may change in any release.
"""

from ._attachment import AttachError as AttachError
from ._attachment import Attachment as Attachment
from ._attachment import attach as attach
from ._bus import EventBus as EventBus
from ._exceptions import CheckpointError as CheckpointError
from ._exceptions import ConfigError as ConfigError
from ._exceptions import DistributedError as DistributedError
from ._exceptions import LaunchError as LaunchError
from ._exceptions import LostWorkError as LostWorkError
from ._exceptions import MissingExtraError as MissingExtraError
from ._exceptions import NonFiniteLossError as NonFiniteLossError
from ._exceptions import TrainbusError as TrainbusError
from ._exceptions import TrainingError as TrainingError
from ._launcher import Launcher as Launcher
from ._launcher import LaunchResult as LaunchResult
from ._launcher import launch as launch
from ._loop.context import TrainContext as TrainContext
from ._loop.context import default_train_step as default_train_step
from ._loop.hooks import HookHandle as HookHandle
from ._loop.hooks import StepContext as StepContext
from ._loop.set_metrics import Perplexity as Perplexity
from ._loop.set_metrics import SetMetric as SetMetric
from ._loop.set_metrics import TokenAccuracy as TokenAccuracy
from ._moved import moved_name, report_moved_modules
from ._replay import replay as replay
from ._seeding import seed_everything as seed_everything
from ._trainer.trainer import Accumulate as Accumulate
from ._trainer.trainer import CheckpointDir as CheckpointDir
from ._trainer.trainer import EvalSchedule as EvalSchedule
from ._trainer.trainer import FitResult as FitResult
from ._trainer.trainer import PerEpoch as PerEpoch
from ._trainer.trainer import Trainer as Trainer
from .callbacks import Callback as Callback

__all__ = [
    "Accumulate",
    "AttachError",
    "Attachment",
    "Callback",
    "CheckpointDir",
    "CheckpointError",
    "ConfigError",
    "DistributedError",
    "EvalSchedule",
    "EventBus",
    "FitResult",
    "HookHandle",
    "LaunchError",
    "LaunchResult",
    "Launcher",
    "LostWorkError",
    "MissingExtraError",
    "NonFiniteLossError",
    "PerEpoch",
    "Perplexity",
    "SetMetric",
    "StepContext",
    "TokenAccuracy",
    "TrainContext",
    "TrainbusError",
    "Trainer",
    "TrainingError",
    "attach",
    "default_train_step",
    "launch",
    "replay",
    "seed_everything",
]

report_moved_modules()


def __getattr__(name: str) -> object:
    """A name that moved to a topic module: an ``AttributeError`` naming where it lives now
    (``from trainbus import X`` gets an ``ImportError`` saying the same)."""
    raise moved_name(name)

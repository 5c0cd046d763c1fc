"""trainbus: a PyTorch trainer whose callback system is an async-first reactive event bus.

The public modules are this one and its topic modules: ``trainbus.events``,
``trainbus.commands``, ``trainbus.operators``, ``trainbus.callbacks``, ``trainbus.checkpoint``,
``trainbus.bus``, ``trainbus.testing``, ``trainbus.ray`` and ``trainbus.integrations.*``.
Everything under an underscored name is private and may change in any release.
"""

from ._attachment import AttachError, Attachment, attach
from ._bus import EventBus
from ._exceptions import (
    CheckpointError,
    ConfigError,
    DistributedError,
    LaunchError,
    LostWorkError,
    MissingExtraError,
    NonFiniteLossError,
    TrainbusError,
    TrainingError,
)
from ._launcher import Launcher, LaunchResult, launch
from ._loop.hooks import HookHandle, StepContext
from ._loop.set_metrics import Perplexity, SetMetric, TokenAccuracy
from ._loop.step import TrainContext, default_train_step
from ._moved import moved_name, report_moved_modules
from ._replay import replay
from ._seeding import seed_everything
from ._trainer.trainer import Accumulate, CheckpointDir, EvalSchedule, FitResult, PerEpoch, Trainer
from .callbacks import Callback

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

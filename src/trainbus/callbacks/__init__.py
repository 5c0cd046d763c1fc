"""Built-in callbacks, one module each, and the :class:`Callback` base class."""

from ._base import Callback as Callback
from ._base import GlobalCallbackHandle as GlobalCallbackHandle
from ._base import RunPlan as RunPlan
from ._base import global_callbacks as global_callbacks
from ._base import register_global_callback as register_global_callback
from .checkpoint import Checkpointing as Checkpointing
from .early_stopping import EarlyStopping as EarlyStopping
from .ema import EMA as EMA
from .evaluate import EvaluateCheckpoints as EvaluateCheckpoints

# kit monitors and stoppers
from .grad_norm import GradientNormMonitor as GradientNormMonitor
from .logging import JsonlEventLog as JsonlEventLog
from .logging import MetricsLogger as MetricsLogger
from .lr import LearningRateMonitor as LearningRateMonitor
from .lr import ReduceLROnPlateau as ReduceLROnPlateau
from .memory import MemoryMonitor as MemoryMonitor
from .mlflow import MLflowLogger as MLflowLogger
from .optimizer_stats import OptimizerMonitor as OptimizerMonitor
from .plot import CurvePlot as CurvePlot
from .progress import Progress as Progress
from .runtime import RuntimeEstimator as RuntimeEstimator
from .stoppers import ThresholdStopping as ThresholdStopping
from .stoppers import TimeLimit as TimeLimit
from .tensorboard import TensorBoardLogger as TensorBoardLogger
from .throughput import Throughput as Throughput
from .throughput import ThroughputMonitor as ThroughputMonitor
from .wandb import WandbLogger as WandbLogger

__all__ = [
    "EMA",
    "Callback",
    "Checkpointing",
    "CurvePlot",
    "EarlyStopping",
    "EvaluateCheckpoints",
    "GlobalCallbackHandle",
    "GradientNormMonitor",
    "JsonlEventLog",
    "LearningRateMonitor",
    "MLflowLogger",
    "MemoryMonitor",
    "MetricsLogger",
    "OptimizerMonitor",
    "Progress",
    "ReduceLROnPlateau",
    "RunPlan",
    "RuntimeEstimator",
    "TensorBoardLogger",
    "ThresholdStopping",
    "Throughput",
    "ThroughputMonitor",
    "TimeLimit",
    "WandbLogger",
    "global_callbacks",
    "register_global_callback",
]

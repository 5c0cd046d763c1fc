"""Built-in callbacks, one module each, and the :class:`Callback` base class."""

from .._exceptions import EvaluationJobError as EvaluationJobError
from ._base import Callback as Callback
from ._base import GlobalCallbackHandle as GlobalCallbackHandle
from ._base import RunPlan as RunPlan
from ._base import SubscribeOptions as SubscribeOptions
from ._base import global_callbacks as global_callbacks
from ._base import register_global_callback as register_global_callback
from ._checkpoint import Checkpointing as Checkpointing
from ._ema import EMA as EMA
from ._evaluate import EvaluateCheckpoints as EvaluateCheckpoints
from ._logging import JsonlEventLog as JsonlEventLog
from ._logging import MetricsLogger as MetricsLogger
from ._lr import LearningRateMonitor as LearningRateMonitor
from ._lr import ReduceLROnPlateau as ReduceLROnPlateau
from ._monitors import GradientNormMonitor as GradientNormMonitor
from ._monitors import MemoryMonitor as MemoryMonitor
from ._monitors import OptimizerMonitor as OptimizerMonitor
from ._monitors import Throughput as Throughput
from ._monitors import ThroughputMonitor as ThroughputMonitor
from ._plot import CurvePlot as CurvePlot
from ._progress import Progress as Progress
from ._progress import RuntimeEstimator as RuntimeEstimator
from ._stoppers import EarlyStopping as EarlyStopping
from ._stoppers import ThresholdStopping as ThresholdStopping
from ._stoppers import TimeLimit as TimeLimit
from ._trackers import MLflowLogger as MLflowLogger
from ._trackers import TensorBoardLogger as TensorBoardLogger
from ._trackers import WandbLogger as WandbLogger

__all__ = [
    "EMA",
    "Callback",
    "Checkpointing",
    "CurvePlot",
    "EarlyStopping",
    "EvaluateCheckpoints",
    "EvaluationJobError",
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
    "SubscribeOptions",
    "TensorBoardLogger",
    "ThresholdStopping",
    "Throughput",
    "ThroughputMonitor",
    "TimeLimit",
    "WandbLogger",
    "global_callbacks",
    "register_global_callback",
]

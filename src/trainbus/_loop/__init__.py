"""The training thread's side: the loop and its parts, one object each owning its state
(ARCHITECTURE.md, "The loop"). This package imports the bus only for types."""

from .evaluation import StandaloneRun as StandaloneRun
from .evaluation import evaluation_metric_names as evaluation_metric_names
from .hooks import HookFn as HookFn
from .hooks import HookHandle as HookHandle
from .hooks import Hooks as Hooks
from .loop import Loop as Loop
from .outputs import PadValue as PadValue
from .outputs import PadValues as PadValues
from .outputs import join_outputs as join_outputs
from .result import Cancelled as Cancelled
from .result import FitResult as FitResult
from .settings import NonFinitePolicy as NonFinitePolicy
from .settings import Precision as Precision
from .settings import Settings as Settings
from .step import TrainContext as TrainContext
from .window import TRAIN_METRIC_NAMES as TRAIN_METRIC_NAMES

__all__ = [
    "TRAIN_METRIC_NAMES",
    "Cancelled",
    "FitResult",
    "HookFn",
    "HookHandle",
    "Hooks",
    "Loop",
    "NonFinitePolicy",
    "PadValue",
    "PadValues",
    "Precision",
    "Settings",
    "StandaloneRun",
    "TrainContext",
    "evaluation_metric_names",
    "join_outputs",
]

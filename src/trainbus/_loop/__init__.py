"""The training thread's side: the loop and its parts, one object each owning its state
(docs/architecture.md, "The loop"). This package imports the bus only for types."""

from .context import StepRunner as StepRunner
from .context import TrainContext as TrainContext
from .context import default_train_step as default_train_step
from .control import BarrierWait as BarrierWait
from .control import CommandHandler as CommandHandler
from .evaluation import Evaluator as Evaluator
from .evaluation import evaluation_metric_names as evaluation_metric_names
from .hooks import HookFn as HookFn
from .hooks import HookHandle as HookHandle
from .hooks import Hooks as Hooks
from .hooks import StepContext as StepContext
from .logged import TRAIN_METRIC_NAMES as TRAIN_METRIC_NAMES
from .logged import UserMetrics as UserMetrics
from .loop import Loop as Loop
from .optimizers import OptimizerSet as OptimizerSet
from .optimizers import SchedulerSet as SchedulerSet
from .outputs import OutputsCheck as OutputsCheck
from .outputs import PadValue as PadValue
from .outputs import PadValues as PadValues
from .result import Cancelled as Cancelled
from .result import FitResult as FitResult
from .saving import CheckpointWriter as CheckpointWriter
from .settings import NonFinitePolicy as NonFinitePolicy
from .settings import Precision as Precision
from .settings import Settings as Settings
from .settings import eval_sets as eval_sets
from .standalone import StandaloneRun as StandaloneRun
from .standalone import join_outputs as join_outputs
from .step import Step as Step
from .wants import Wants as Wants
from .window import LogWindow as LogWindow

__all__ = [
    "TRAIN_METRIC_NAMES",
    "BarrierWait",
    "Cancelled",
    "CheckpointWriter",
    "CommandHandler",
    "Evaluator",
    "FitResult",
    "HookFn",
    "HookHandle",
    "Hooks",
    "LogWindow",
    "Loop",
    "NonFinitePolicy",
    "OptimizerSet",
    "OutputsCheck",
    "PadValue",
    "PadValues",
    "Precision",
    "SchedulerSet",
    "Settings",
    "StandaloneRun",
    "Step",
    "StepContext",
    "StepRunner",
    "TrainContext",
    "UserMetrics",
    "Wants",
    "default_train_step",
    "eval_sets",
    "evaluation_metric_names",
    "join_outputs",
]

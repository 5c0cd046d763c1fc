"""The training thread's side: the step, command handling, log window, evaluation.

Objects, each owning its state (see docs/architecture.md for the table); every module of the
package is listed, and each name where it is defined (``tests/test_layers.py`` checks both):

- :class:`Loop` (``loop.py``): the run, the epoch and the poll point after a run of steps.
- :class:`Step` (``step.py``): one optimizer step, written once, in event order (the steps
  before the next one the loop must look after run back to back).
- :class:`StepPhases` (``phases.py``): forward, backward, optimizer step with events and hooks.
- :func:`forward_loss`, :func:`model_outputs` (``forward.py``): the forward (model outputs,
  then the loss) for training, evaluation and prediction.
- :class:`ItemWeights`, :func:`count_items` (``accumulation.py``): micro-batches weighed by
  their items (``accumulate_by="items"``).
- :class:`GradSync` (``gradsync.py``): DDP gradient synchronisation under accumulation.
- :class:`NonFiniteGuard` (``nonfinite.py``): a NaN/inf loss noticed, never checkpointed.
- :class:`SchedulerStepper` (``lr_schedule.py``): the learning-rate scheduler's step.
- :class:`CustomStep`, :class:`TrainContext` (``custom.py``): the user's ``train_step`` inside
  the one step.
- :class:`OptimizerSet`, :class:`SchedulerSet` (``optimizers.py``): several named optimizers
  and schedulers as one.
- :class:`UserMetrics` (``logged.py``): values users log (``ctx.log``, ``LogMetric``).
- :class:`CommandHandler` (``control.py``): poll points, commands, the stop state.
- :class:`LogWindow` (``window.py``): aggregated training metrics and the NaN check.
- :class:`Evaluator` (``evaluation.py``): the evaluation round over the named sets.
- :class:`SetMetric`, :class:`SetTotals`, :class:`MetricFailures` (``set_metrics.py``): metrics
  of the whole evaluation set, from running sums.
- :class:`EpochData` (``data.py``): each epoch's batch iterator and the observed fetch.
- :class:`StandaloneRun` (``standalone.py``): ``evaluate()`` and ``predict()`` outside ``fit()``.
- :class:`HostOutputs` (``host.py``): prediction outputs kept on the host as they come.
- :func:`map_tensors`, :func:`detach_outputs`, :func:`join_outputs`, :class:`PadValues`,
  :class:`OutputsCheck` (``outputs.py``): model outputs of any type (a mapping, a
  ``ModelOutput``, a tuple) walked and joined per key, padded where batches differ in size,
  each batch checked as it comes.
- :class:`CheckpointWriter` (``saving.py``): saves and remembers the last checkpoint.
- :class:`Wants` (``wants.py``): which per-step events someone listens to.
- :class:`Hooks`, :class:`StepContext`, :class:`HookHandle` (``hooks.py``): inline hooks.
- :class:`FitResult`, :class:`Cancelled` (``result.py``): how a run of the loop ends.
- :func:`hint_pin_memory` (``pinning.py``): the one-time hint to pin a CUDA run's batches.
- :class:`Settings` (``settings.py``): the validated, frozen configuration.

This package imports the bus only for types and uses it through its public methods.
"""

from .control import BarrierWait as BarrierWait
from .control import CommandHandler as CommandHandler
from .custom import CustomStep as CustomStep
from .custom import TrainContext as TrainContext
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
from .phases import StepPhases as StepPhases
from .result import Cancelled as Cancelled
from .result import FitResult as FitResult
from .saving import CheckpointWriter as CheckpointWriter
from .settings import DEFAULT_BARRIERS as DEFAULT_BARRIERS
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
    "DEFAULT_BARRIERS",
    "TRAIN_METRIC_NAMES",
    "BarrierWait",
    "Cancelled",
    "CheckpointWriter",
    "CommandHandler",
    "CustomStep",
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
    "StepPhases",
    "TrainContext",
    "UserMetrics",
    "Wants",
    "eval_sets",
    "evaluation_metric_names",
    "join_outputs",
]

"""The event vocabulary: what the training loop tells the world, one frozen dataclass per fact;
:data:`Event` is their union. When each comes, in which order, and the rules every event
follows: docs/events.md.
"""

from __future__ import annotations

import time as _time
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal, TypeAlias, get_args, overload

from ._exceptions import RecordedError as RecordedError

if TYPE_CHECKING:
    import torch

    from .commands import Command

    Scalar: TypeAlias = "torch.Tensor | float"
else:
    Scalar = Any

__all__ = [
    "EVENT_TYPES",
    "SPANS",
    "TRACED_SPANS",
    "BaseEvent",
    "CheckpointLoaded",
    "CheckpointLoading",
    "CheckpointSaved",
    "CheckpointSaving",
    "CommandApplied",
    "Ending",
    "EpochEnded",
    "EpochStarted",
    "EvalBatchEnded",
    "EvalBatchStarted",
    "EvalTrigger",
    "EvaluationEnded",
    "EvaluationRoundEnded",
    "EvaluationRoundStarted",
    "EvaluationStarted",
    "Event",
    "ExternalEvaluationEnded",
    "FitEnded",
    "FitStarted",
    "GradientNormMeasured",
    "MemoryMeasured",
    "MetricsLogged",
    "OptimizerStatsMeasured",
    "Phase",
    "PredictionBatchEnded",
    "PredictionEnded",
    "PredictionStarted",
    "RecordedError",
    "ResumeSource",
    "RuntimeEstimated",
    "SchedulerStepped",
    "SpanTraced",
    "StepEnded",
    "TracedSpan",
    "TrainerBuilt",
    "WorkersRestarted",
    "as_float",
]

Phase: TypeAlias = Literal["train", "eval", "predict"]
ResumeSource: TypeAlias = Literal["path", "checkpoint_dir", "ray"]


class Ending(StrEnum):
    """How a run ended: ``FitEnded.reason`` with a stop's cause told apart (``PRUNED``,
    ``SIGNAL``: a ``StopTraining.reason`` of ``"pruned"`` or ``"signal"``; any other stop is
    ``STOPPED``). Members equal their strings (``Ending.PRUNED == "pruned"``).
    """

    COMPLETED = "completed"
    STOPPED = "stopped"
    PRUNED = "pruned"
    SIGNAL = "signal"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @classmethod
    def of(cls, reason: str, stop_reason: str | None) -> Ending:
        """The ending of a run that ended with ``reason`` (``FitEnded.reason``) and
        ``stop_reason`` (``FitEnded.stop_reason``).

        Raises:
            ValueError: ``reason`` is not one of ``FitEnded.reason``'s four values.
        """
        if reason == "stopped" and stop_reason in (cls.PRUNED, cls.SIGNAL):
            return cls(stop_reason)
        if reason not in ("completed", "stopped", "failed", "cancelled"):
            raise ValueError(
                f"{reason!r} is not an end reason (completed, stopped, failed, cancelled)"
            )
        return cls(reason)


EvalTrigger: TypeAlias = Literal["epoch", "steps", "end", "command", "standalone"]
"""Why an evaluation runs (docs/events.md, "One evaluation per step")."""
_EMPTY: Mapping[str, float] = MappingProxyType({})


def _triggers(trigger: EvalTrigger, triggers: tuple[EvalTrigger, ...]) -> tuple[EvalTrigger, ...]:
    """An evaluation event's ``triggers``: as given (a tuple again after a JSON round trip),
    ``(trigger,)`` when none were."""
    return tuple(triggers) if triggers else (trigger,)


def _frozen_mapping(value: Mapping[str, float]) -> Mapping[str, float]:
    return value if isinstance(value, MappingProxyType) else MappingProxyType(dict(value))


@overload
def as_float(value: None) -> None: ...
@overload
def as_float(value: Scalar) -> float: ...
def as_float(value: Scalar | None) -> float | None:
    """Read a scalar payload (a 0-dim tensor or a float) as a Python float: a CUDA tensor
    waits for the device on the calling thread (docs/events.md)."""
    if value is None:
        return None
    return float(value)


@dataclass(frozen=True, slots=True, kw_only=True)
class BaseEvent:
    """Fields every event carries."""

    step: int
    """Optimizer steps completed when the event was built."""
    epoch: int
    """Epoch index, from 0."""
    time: float = field(default_factory=_time.monotonic, compare=False)
    """:func:`time.monotonic` when the event was built."""


# --------------------------------------------------------------------------- run
@dataclass(frozen=True, slots=True, kw_only=True)
class TrainerBuilt(BaseEvent):
    """The :class:`~trainbus.Trainer` was built (published at the end of ``__init__``, delivered
    when the bus first runs)."""

    device: str
    callbacks: tuple[str, ...] = ()
    """Class names of the callbacks added at construction, in order."""

    def __post_init__(self) -> None:
        # A frozen event holds tuples, whatever sequence it was given (a decoded record: a list).
        object.__setattr__(self, "callbacks", tuple(self.callbacks))


@dataclass(frozen=True, slots=True, kw_only=True)
class FitStarted(BaseEvent):
    """``fit()`` began: the loop is about to fetch its first batch."""

    max_steps: int | None
    max_epochs: int | None
    device: str
    resumed_from: str | None = None
    """The checkpoint file the run loaded (``fit(resume=...)``); None for a fresh start."""
    resume_source: ResumeSource | None = None
    """Where ``resumed_from`` was found: ``"path"`` (``fit(resume=<path>)``), ``"ray"`` (Ray's
    checkpoint) or ``"checkpoint_dir"`` (its newest valid file); None for a fresh start."""
    steps_per_epoch: int | None = None
    """Optimizer steps in one full epoch (the training data's length with gradient accumulation
    applied), None when the data has no length."""
    rank: int = 0
    """This process' rank under torchrun (0 on a single process)."""
    world_size: int = 1
    """Processes training together (1 on a single process)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class FitEnded(BaseEvent):
    """``fit()`` ended, however it ended. Always the last event of a run."""

    reason: Literal["completed", "stopped", "failed", "cancelled"]
    """How the run ended, coarsely (:attr:`ending` tells a stop's cause apart)."""
    error: BaseException | None = None
    stop_reason: str | None = None
    """The ``StopTraining.reason`` when ``reason == "stopped"``."""

    @property
    def ending(self) -> Ending:
        """``reason`` with a stop's cause told apart (:class:`Ending`)."""
        return Ending.of(self.reason, self.stop_reason)


# --------------------------------------------------------------------------- epoch
@dataclass(frozen=True, slots=True, kw_only=True)
class EpochStarted(BaseEvent):
    """An epoch began."""


@dataclass(frozen=True, slots=True, kw_only=True)
class EpochEnded(BaseEvent):
    """An epoch ended (completed, cut short by ``StopEpoch``/``StopTraining``, or failed). A
    barrier event by default."""

    batches: int
    """Training batches consumed in this epoch."""
    error: BaseException | None = None


# --------------------------------------------------------------------------- step
TracedSpan: TypeAlias = Literal[
    "data_wait", "forward", "backward", "optimizer_step", "zero_grad", "scheduler_step"
]
"""A part of a step (or of an evaluation or prediction batch) that ``Trainer(trace=...)``
times: each one ends in one :class:`SpanTraced`."""

TRACED_SPANS: tuple[TracedSpan, ...] = get_args(TracedSpan)
"""Every :data:`TracedSpan`, in the order a training step runs them."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SpanTraced(BaseEvent):
    """One part of a step timed, published when it ended or raised (opt-in:
    ``Trainer(trace=...)``; docs/events.md, "Tracing")."""

    span: TracedSpan
    """Which part (:data:`TracedSpan`)."""
    started: float
    """:func:`time.monotonic` when the part began."""
    ended: float
    """:func:`time.monotonic` when it ended (or raised)."""
    phase: Phase = "train"
    batch_index: int | None = None
    """The batch's index in the epoch (or the evaluation); None for the per-step parts."""
    micro_batch: int | None = None
    """Position among the step's micro-batches (training's per-batch parts); else None."""
    dataset: str | None = None
    """The evaluation set's name (``phase="eval"``); else None."""
    error: BaseException | None = None

    @property
    def duration_s(self) -> float:
        """Seconds the part took (``ended - started``)."""
        return self.ended - self.started


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerStepped(BaseEvent):
    """The LR scheduler stepped (per step or per epoch, as configured); ``error`` set if
    ``step()`` raised."""

    lr: float
    """Learning rate of the first parameter group after the scheduler step."""
    error: BaseException | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class StepEnded(BaseEvent):
    """One optimizer step is complete: the event most subscribers want."""

    loss: Scalar
    """Mean training loss over the step's micro-batches (detached tensor)."""
    lr: float
    grad_norm: Scalar | None
    samples: int
    """Samples consumed by this step (all micro-batches)."""
    duration_s: float
    """Wall time of the step, from the first batch fetch to the end of the optimizer step."""
    data_wait_s: float = 0.0
    """Of ``duration_s``, the time spent waiting for the data iterable (all micro-batches)."""


# --------------------------------------------------------------------------- evaluation
@dataclass(frozen=True, slots=True, kw_only=True)
class EvaluationRoundStarted(BaseEvent):
    """An evaluation round began: every evaluation set, one after the other."""

    trigger: EvalTrigger
    datasets: tuple[str, ...]
    """The sets the round scores, in order."""
    triggers: tuple[EvalTrigger, ...] = ()
    """Every cadence this evaluation stands for, ``trigger`` first; default ``(trigger,)``."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "datasets", tuple(self.datasets))
        object.__setattr__(self, "triggers", _triggers(self.trigger, self.triggers))


@dataclass(frozen=True, slots=True, kw_only=True)
class EvaluationStarted(BaseEvent):
    """Evaluation of one set began."""

    trigger: EvalTrigger
    dataset: str = "val"
    """The set's name: its key in an ``eval_data`` mapping, ``"val"`` for a single loader."""
    triggers: tuple[EvalTrigger, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "triggers", _triggers(self.trigger, self.triggers))


@dataclass(frozen=True, slots=True, kw_only=True)
class EvalBatchStarted(BaseEvent):
    """An evaluation batch came out of its set and is about to be scored."""

    batch_index: int
    dataset: str = "val"


@dataclass(frozen=True, slots=True, kw_only=True)
class EvalBatchEnded(BaseEvent):
    """One evaluation batch was scored (or failed: ``error`` set, ``loss`` NaN, ``samples``
    0)."""

    batch_index: int
    loss: Scalar
    samples: int
    dataset: str = "val"
    error: BaseException | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class EvaluationEnded(BaseEvent):
    """Evaluation of one set ended; ``metrics`` as floats, keyed as docs/events.md says
    (``val_loss``, ``val_<name>``; named sets ``<set>/loss``). A barrier event by default."""

    metrics: Mapping[str, float] = field(default_factory=lambda: _EMPTY)
    trigger: EvalTrigger = "epoch"
    error: BaseException | None = None
    dataset: str = "val"
    triggers: tuple[EvalTrigger, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "metrics", _frozen_mapping(self.metrics))
        object.__setattr__(self, "triggers", _triggers(self.trigger, self.triggers))


@dataclass(frozen=True, slots=True, kw_only=True)
class EvaluationRoundEnded(BaseEvent):
    """An evaluation round ended; ``metrics`` merges every set's (keys never collide)."""

    metrics: Mapping[str, float] = field(default_factory=lambda: _EMPTY)
    trigger: EvalTrigger = "epoch"
    error: BaseException | None = None
    triggers: tuple[EvalTrigger, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "metrics", _frozen_mapping(self.metrics))
        object.__setattr__(self, "triggers", _triggers(self.trigger, self.triggers))


# --------------------------------------------------------------------------- prediction
@dataclass(frozen=True, slots=True, kw_only=True)
class PredictionStarted(BaseEvent):
    """``trainer.predict(data)`` began."""

    batches: int | None
    """Batches in ``data`` (None when it has no length)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PredictionBatchEnded(BaseEvent):
    """The model's outputs for one prediction batch, detached, on their device: write them out
    as they come (docs/events.md)."""

    batch_index: int
    outputs: Any
    samples: int


@dataclass(frozen=True, slots=True, kw_only=True)
class PredictionEnded(BaseEvent):
    """Prediction ended (``error`` set if the model or the data raised; ``stopped`` when a
    ``StopTraining`` ended it between batches)."""

    batches: int
    """Batches predicted."""
    error: BaseException | None = None
    stopped: bool = False


# --------------------------------------------------------------------------- checkpoints
@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointSaving(BaseEvent):
    """A checkpoint is about to be written (the state it will hold is final)."""

    tag: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointLoading(BaseEvent):
    """A checkpoint is about to be read and restored (``step``/``epoch``: the trainer's, 0
    before a fresh run)."""

    path: str


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointSaved(BaseEvent):
    """A checkpoint was written (atomically: the path exists and is complete)."""

    path: str
    tag: str | None = None
    metrics: Mapping[str, float] = field(default_factory=lambda: _EMPTY)

    def __post_init__(self) -> None:
        object.__setattr__(self, "metrics", _frozen_mapping(self.metrics))


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointLoaded(BaseEvent):
    """Model, optimizer, scheduler and train state were restored from ``path``."""

    path: str


# --------------------------------------------------------------------------- metrics
@dataclass(frozen=True, slots=True, kw_only=True)
class MetricsLogged(BaseEvent):
    """Training metrics aggregated over the last ``log_every`` steps, as floats (the keys:
    docs/events.md)."""

    metrics: Mapping[str, float]

    def __post_init__(self) -> None:
        object.__setattr__(self, "metrics", _frozen_mapping(self.metrics))


# --------------------------------------------------------------------------- control
@dataclass(frozen=True, slots=True, kw_only=True)
class CommandApplied(BaseEvent):
    """The loop applied (or refused: ``error``) a command from the back-channel; ``result`` is
    the event it produced (``CheckpointSaved``, ``EvaluationEnded``), which ``bus.request``
    returns."""

    command: Command
    result: BaseEvent | None = None
    error: BaseException | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkersRestarted(BaseEvent):
    """A driver's workers were started again after a failure (``trainbus.ray``; docs/events.md)."""

    attempt: int
    """The attempt starting now: 2 after the first restart, 3 after the second..."""
    reason: str | None = None
    """Why the previous attempt ended (its ``FitEnded.error``, or that rank 0 vanished); None
    when nothing is known."""


# --------------------------------------------------------------------------- monitor callbacks
@dataclass(frozen=True, slots=True, kw_only=True)
class GradientNormMeasured(BaseEvent):
    """``GradientNormMonitor`` measured the total gradient norm, before the optimizer step."""

    grad_norm: Scalar
    """Total norm of all gradients, before clipping (detached tensor on the device)."""
    norm_type: float = 2.0


@dataclass(frozen=True, slots=True, kw_only=True)
class OptimizerStatsMeasured(BaseEvent):
    """``OptimizerMonitor`` read the optimizer's hyper-parameters after an update: one entry per
    parameter group that has it, keyed ``"group<i>"``."""

    lr_by_group: Mapping[str, float]
    momentum_by_group: Mapping[str, float] = field(default_factory=lambda: _EMPTY)
    """SGD/RMSprop ``momentum``, or Adam's ``betas[0]``."""
    beta2_by_group: Mapping[str, float] = field(default_factory=lambda: _EMPTY)
    """Adam-style ``betas[1]``."""
    weight_decay_by_group: Mapping[str, float] = field(default_factory=lambda: _EMPTY)

    def __post_init__(self) -> None:
        for name in ("lr_by_group", "momentum_by_group", "beta2_by_group", "weight_decay_by_group"):
            object.__setattr__(self, name, _frozen_mapping(getattr(self, name)))


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryMeasured(BaseEvent):
    """``MemoryMonitor`` read the process and device memory, in bytes."""

    rss_bytes: int | None
    """Resident set size of the process (None when the platform gives no way to read it)."""
    rss_source: Literal["psutil", "statm", "resource"] | None = None
    """Where ``rss_bytes`` came from (``"resource"`` is the peak RSS, not the current one)."""
    device: str = "cpu"
    cuda_allocated_bytes: int | None = None
    """``torch.cuda.memory_allocated`` on the training device; None off CUDA."""
    cuda_reserved_bytes: int | None = None
    cuda_peak_bytes: int | None = None
    """``torch.cuda.max_memory_allocated`` since the process started (or the last reset)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RuntimeEstimated(BaseEvent):
    """``RuntimeEstimator`` projected when the run will end from the measured step rate."""

    elapsed_s: float
    """Seconds since ``FitStarted``."""
    remaining_s: float | None
    """Seconds left at the measured rate; None while the run's length is unknown."""
    eta: float | None
    """Expected end as a Unix timestamp (:func:`time.time` scale); None with ``remaining_s``."""
    steps_per_s: float
    total_steps: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ExternalEvaluationEnded(BaseEvent):
    """An :class:`trainbus.callbacks.EvaluateCheckpoints` job on a saved checkpoint ended
    (docs/callbacks/evaluate.md)."""

    checkpoint: str
    """Path of the evaluated checkpoint (``CheckpointSaved.path``)."""
    metrics: Mapping[str, float] = field(default_factory=lambda: _EMPTY)
    error: BaseException | None = None
    """Why the job failed (non-zero exit with its stderr tail, no JSON, timeout), else None."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "metrics", _frozen_mapping(self.metrics))


Event: TypeAlias = (
    TrainerBuilt
    | FitStarted
    | FitEnded
    | EpochStarted
    | EpochEnded
    | SpanTraced
    | SchedulerStepped
    | StepEnded
    | EvaluationRoundStarted
    | EvaluationStarted
    | EvalBatchStarted
    | EvalBatchEnded
    | EvaluationEnded
    | EvaluationRoundEnded
    | PredictionStarted
    | PredictionBatchEnded
    | PredictionEnded
    | CheckpointSaving
    | CheckpointSaved
    | CheckpointLoading
    | CheckpointLoaded
    | MetricsLogged
    | CommandApplied
    | WorkersRestarted
    | GradientNormMeasured
    | OptimizerStatsMeasured
    | MemoryMeasured
    | RuntimeEstimated
    | ExternalEvaluationEnded
)
"""Union of every event class."""

EVENT_TYPES: tuple[type[BaseEvent], ...] = Event.__args__
"""Every concrete event class, in vocabulary order."""

SPANS: Mapping[type[BaseEvent], type[BaseEvent]] = MappingProxyType(
    {
        FitStarted: FitEnded,
        EpochStarted: EpochEnded,
        EvaluationStarted: EvaluationEnded,
        EvalBatchStarted: EvalBatchEnded,
        EvaluationRoundStarted: EvaluationRoundEnded,
        PredictionStarted: PredictionEnded,
    }
)
"""Each ``XStarted`` class mapped to its ``XEnded`` class."""


REMOVED: Mapping[str, str] = MappingProxyType(
    {
        **{
            name: '``SpanTraced(span="data_wait")``'
            for name in ("DataWaitStarted", "DataWaitEnded", "BatchFetched")
        },
        **{
            name: '``SpanTraced(span="forward")`` or the hook points "after_forward" / "loss"'
            for name in ("ForwardStarted", "ForwardEnded", "LossComputed")
        },
        **{
            name: '``SpanTraced(span="backward")`` or the hook point "after_backward"'
            for name in ("BackwardStarted", "BackwardEnded", "MicroBatchEnded")
        },
        **{
            name: '``SpanTraced(span="optimizer_step")`` or the hook points '
            '"before_optimizer_step" / "after_optimizer_step"'
            for name in ("OptimizerStepStarted", "OptimizerStepEnded")
        },
        **{
            name: '``SpanTraced(span="zero_grad")``'
            for name in ("ZeroGradStarted", "ZeroGradEnded")
        },
        "SchedulerStepping": '``SpanTraced(span="scheduler_step")`` or ``SchedulerStepped``',
        "StepBegan": 'the hook point "batch" or ``SpanTraced(span="data_wait")``',
    }
)
"""Each removed per-step event's name mapped to what replaces it."""


def __getattr__(name: str) -> object:
    """A removed per-step event's name is an ``ImportError`` naming what replaces it."""
    if name in REMOVED:
        raise ImportError(
            f"trainbus.events.{name} was removed: the per-step phases are one opt-in trace "
            f"event; use {REMOVED[name]} (Trainer(trace=True) turns tracing on)"
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

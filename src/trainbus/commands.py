"""The command vocabulary: what subscribers tell the loop (``bus.send``), acknowledged with
``events.CommandApplied``; values are checked when a command is built. Each carries
``decided_at``, stamped by ``bus.send`` (docs/events.md, "When a command takes effect").
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Self, TypeAlias

from ._exceptions import ConfigError
from ._validate import check_int, check_number

__all__ = [
    "COMMAND_TYPES",
    "Command",
    "Evaluate",
    "LogMetric",
    "SaveCheckpoint",
    "ScaleLearningRate",
    "SetLearningRate",
    "StopEpoch",
    "StopTraining",
]


def _check_target(param_group: int | None, optimizer: str | None) -> None:
    """The parameter group and the optimizer a learning-rate command names."""
    check_int("param_group", param_group, 0, optional=True)
    if optimizer is not None and (not isinstance(optimizer, str) or not optimizer.isidentifier()):
        raise ConfigError.invalid("optimizer", optimizer, "an optimizer's name or None")


class _KeywordOnly:
    """The commands' base: a positional argument is a ``TypeError`` naming the keywords."""

    __slots__ = ()

    def __new__(cls, *args: Any, **kwargs: Any) -> Self:
        if args:
            names = [f"{f.name}=..." for f in fields(cls) if f.name != "decided_at"]  # type: ignore[arg-type]
            raise TypeError(
                f"{cls.__name__} takes keyword arguments only: {cls.__name__}({', '.join(names)})"
            )
        return super().__new__(cls)


@dataclass(frozen=True, slots=True, kw_only=True)
class StopTraining(_KeywordOnly):
    """Stop the run after the current step; ``FitEnded(reason="stopped")`` follows."""

    reason: str = "requested"
    decided_at: int | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class StopEpoch(_KeywordOnly):
    """End the current epoch now; training continues with the next one (if any)."""

    decided_at: int | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class SaveCheckpoint(_KeywordOnly):
    """Write a checkpoint now; answered by ``CheckpointSaved``."""

    tag: str | None = None
    """Name part of the checkpoint file (``step-<n>[-<tag>].pt``); letters, digits, ``-_.``."""
    decided_at: int | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.tag is not None and (
            not isinstance(self.tag, str)
            or not self.tag
            or not all(c.isalnum() or c in "-_." for c in self.tag)
        ):
            raise ConfigError.invalid(
                "tag", self.tag, "a non-empty string of letters, digits, '-', '_' or '.'"
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class Evaluate(_KeywordOnly):
    """Run evaluation now; answered by ``EvaluationEnded(trigger="command")``."""

    decided_at: int | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class SetLearningRate(_KeywordOnly):
    """Set the learning rate of every parameter group (or of ``param_group``) of every
    optimizer (or of the one named ``optimizer``, with several)."""

    lr: float
    param_group: int | None = None
    optimizer: str | None = None
    """The optimizer's name in ``Trainer(optimizer={name: ...})``; None: all of them."""
    decided_at: int | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        check_number("lr", self.lr)
        _check_target(self.param_group, self.optimizer)


@dataclass(frozen=True, slots=True, kw_only=True)
class ScaleLearningRate(_KeywordOnly):
    """Multiply the learning rate of every parameter group (or of ``param_group``) of every
    optimizer (or of the one named ``optimizer``, with several)."""

    factor: float
    param_group: int | None = None
    optimizer: str | None = None
    """The optimizer's name in ``Trainer(optimizer={name: ...})``; None: all of them."""
    decided_at: int | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        check_number("factor", self.factor, positive=True)
        _check_target(self.param_group, self.optimizer)


@dataclass(frozen=True, slots=True, kw_only=True)
class LogMetric(_KeywordOnly):
    """Add a named value to the training metrics: a subscriber's ``ctx.log`` (docs/trainer.md,
    "Metrics of your own")."""

    name: str
    value: float
    decided_at: int | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError.invalid("name", self.name, "a non-empty string")
        if isinstance(self.value, bool) or not isinstance(self.value, int | float):
            raise ConfigError.invalid("value", self.value, "a number")


Command: TypeAlias = (
    StopTraining
    | StopEpoch
    | SaveCheckpoint
    | Evaluate
    | SetLearningRate
    | ScaleLearningRate
    | LogMetric
)
"""Union of every command class."""

COMMAND_TYPES: tuple[type, ...] = Command.__args__
"""Every command class."""

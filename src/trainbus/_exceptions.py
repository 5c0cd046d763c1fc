"""Exceptions raised by trainbus: each derives from :class:`TrainbusError`, and one a user would
naturally catch as a builtin also inherits that builtin (``except ValueError`` keeps working
around a ``Trainer(...)`` call, the httpx/anyio habit).
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Any

__all__ = [
    "BusClosedError",
    "CheckpointError",
    "CheckpointWriteError",
    "ConfigError",
    "DistributedError",
    "EvaluationJobError",
    "LaunchError",
    "LostWorkError",
    "MissingExtraError",
    "NonFiniteLossError",
    "RecordedError",
    "TrainbusError",
    "TrainingError",
]


class TrainbusError(Exception):
    """Base class of every exception trainbus raises."""


class ConfigError(TrainbusError, ValueError):
    """A configuration value or argument is invalid.

    The message names the field, the value received and what is allowed.
    """

    @classmethod
    def invalid(cls, field: str, value: object, allowed: str) -> ConfigError:
        """Build the standard message: ``field=value is invalid: allowed``."""
        return cls(f"{field}={value!r} is invalid: {allowed}")

    @classmethod
    def wrong_kind(cls, field: str, value: object, allowed: str) -> ConfigError:
        """:meth:`invalid` naming what ``value`` is (its type's name; a class, or None, as
        such): ``optimizer=torch.optim.SGD`` is a class to build, not a wrong type."""
        if isinstance(value, type | types.FunctionType):
            kind = "class" if isinstance(value, type) else "function"
            name = value.__qualname__
            return cls(
                f"{field}=<{kind} {name}> is invalid: {allowed} (the {kind} itself was "
                f"given: pass what it builds, {name}(...))"
            )
        return cls.invalid(field, None if value is None else type(value).__name__, allowed)


class BusClosedError(TrainbusError, RuntimeError):
    """The bus is not running: it was never opened, or it has been closed."""


class LostWorkError(TrainbusError, RuntimeError):
    """Subscribers lost work (items dropped, cancelled at close, or failed) on a bus made with
    ``EventBus(on_lost="raise")``: raised by ``fit()`` once the bus closed. See docs/bus.md.

    Attributes:
        lost_work: ``{subscription name: LostWork}`` of the subscriptions that lost anything.
        result: The run's ``FitResult`` (also ``trainer.result``).
    """

    def __init__(self, lost_work: Mapping[str, Any], result: object) -> None:
        parts = ", ".join(
            f"{name}: {x.dropped} dropped, {x.cancelled} cancelled, {x.failed} failed"
            for name, x in lost_work.items()
        )
        super().__init__(
            f"subscribers lost work: {parts}. Give them a larger buffer=, a higher "
            "concurrency=, overflow='block' (never drops, can slow training) or a longer "
            "EventBus(close_timeout=); or EventBus(on_lost='warn') to accept losses"
        )
        self.lost_work = dict(lost_work)
        self.result = result


class CheckpointError(TrainbusError):
    """A checkpoint cannot be used (truncated, corrupt, foreign, or not fitting the model,
    optimizer or world size resuming it); the message names the file, the raw error is the
    ``__cause__``."""

    def __init__(self, message: str, *, path: str | None = None) -> None:
        super().__init__(f"checkpoint {path}: {message}" if path is not None else message)
        self.path = path


class CheckpointWriteError(CheckpointError, OSError):
    """The disk refused a checkpoint write (no space, a read-only file system), naming the file
    and the OS error; an ``OSError`` too (``errno``, ``strerror``). See docs/reliability.md.

    Args:
        path: The checkpoint file that was being written.
        cause: The ``OSError`` the write raised.
    """

    def __init__(self, path: str, cause: OSError) -> None:
        reason = cause.strerror or str(cause) or type(cause).__name__
        super().__init__(f"could not be written: [Errno {cause.errno}] {reason}", path=path)
        self.errno = cause.errno
        self.strerror = cause.strerror
        self.filename = path

    def __str__(self) -> str:
        # Not OSError's "[Errno N] strerror: filename", which does not say a checkpoint failed.
        return str(self.args[0])

    def __reduce__(self) -> tuple[Any, ...]:
        # Picklable (a Ray worker's error crosses processes): rebuilt from path and OS error.
        return (type(self), (self.path, OSError(self.errno, self.strerror)))


class TrainingError(TrainbusError, RuntimeError):
    """Something went wrong inside the training loop; the message names step and batch."""


class NonFiniteLossError(TrainingError):
    """The loss is NaN or infinite."""


class MissingExtraError(TrainbusError, ImportError):
    """An integration needs a package that is not installed; the message names the extra.

    Args:
        feature: What needs it (``"TensorBoardLogger"``).
        package: The missing import (``"tensorboard"``).
        extra: The trainbus extra that installs it (``"tensorboard"``).
    """

    def __init__(self, feature: str, package: str, extra: str) -> None:
        super().__init__(
            f"{feature} needs the {package!r} package, which is not installed: "
            f"run pip install 'trainbus[{extra}]'",
            name=package,
        )
        self.extra = extra


class EvaluationJobError(TrainbusError, RuntimeError):
    """An evaluation job on a checkpoint failed: it exited non-zero, printed no JSON object of
    metrics, raised, or timed out. Carried by ``ExternalEvaluationEnded.error``, never raised
    into the run.

    Attributes:
        checkpoint: The checkpoint path the job evaluated.
        returncode: The command's exit status (None for a function or a timeout).
        stderr: The last lines of the command's standard error ("" for a function).
    """

    def __init__(
        self, message: str, *, checkpoint: str, returncode: int | None = None, stderr: str = ""
    ) -> None:
        super().__init__(message + (f"; stderr tail:\n{stderr}" if stderr else ""))
        self.checkpoint = checkpoint
        self.returncode = returncode
        self.stderr = stderr


class DistributedError(TrainbusError, RuntimeError):
    """The process group could not be initialised (an unreachable master, a timeout), or the
    ranks disagree where they must agree (different metric names in one reduction)."""


class RecordedError(TrainbusError):
    """An exception of a recorded run or of a remote worker, rebuilt from its ``repr`` (the
    JSON record keeps only that: exceptions never cross as pickles)."""


class LaunchError(TrainbusError, RuntimeError):
    """A launch failed: the workers could not start, a worker died, or the driver gave up.

    Attributes:
        returncode, events, received, last_event, stop_reason, ending, signal: As
            :class:`~trainbus.LaunchResult`'s (``returncode`` None when torchrun never
            started; ``stop_reason`` ``"signal"`` when Ctrl-C stopped the launch first).
        stderr: The last lines torchrun and the workers wrote to standard error.
        rank: The rank that failed first (torchrun's root cause), or None when unknown.
        rank_exitcode: That rank's own exit status (negative: the signal that killed it).
        rank_signal: The name of that signal (``"SIGKILL"``), or None.
    """

    def __init__(
        self,
        message: str,
        *,
        returncode: int | None = None,
        events: tuple[object, ...] = (),
        received: int = 0,
        last_event: object | None = None,
        stop_reason: str | None = None,
        stderr: str = "",
        rank: int | None = None,
        rank_exitcode: int | None = None,
        rank_signal: str | None = None,
        ending: str | None = None,
        signal: int | None = None,
    ) -> None:
        super().__init__(message + (f"; stderr tail:\n{stderr}" if stderr else ""))
        self.returncode = returncode
        self.events = events
        self.received = received
        self.last_event = last_event
        self.stop_reason = stop_reason
        self.stderr = stderr
        self.rank = rank
        self.rank_exitcode = rank_exitcode
        self.rank_signal = rank_signal
        self.ending = ending
        self.signal = signal

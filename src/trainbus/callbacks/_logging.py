"""Logging built-ins: structlog lines for humans and a JSON-lines event log for machines.

- :class:`MetricsLogger` logs metrics, evaluations, checkpoints and the end of the run through
  ``structlog.get_logger("trainbus")``, with keys equal to event field names.
- :class:`JsonlEventLog` writes events to a file as JSON lines, batched in time and written in a
  worker thread, so neither the training thread nor the event loop waits for the disk.

Neither configures structlog: the application does (the CLI does for ``trainbus demo``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import anyio.to_thread
import structlog
from reactivex import operators as ops

from .. import _wire as wire
from .. import events as ev
from .._exceptions import ConfigError
from .._validate import check_optional_seconds, check_path, check_seconds
from ._base import Callback

if TYPE_CHECKING:
    from .._bus import EventBus

__all__ = ["FORMAT_VERSION", "JsonlEventLog", "MetricsLogger", "event_record"]

FORMAT_VERSION = wire.FORMAT_VERSION
"""Version of :class:`JsonlEventLog`'s records (their ``v`` field), read by
:func:`trainbus._replay`: 1 = ``{"v", "type", <event fields>}``, ``time`` in monotonic seconds."""

_RESERVED = frozenset({"event", "step", "epoch", "level", "timestamp", "logger"})


def _flatten(metrics: Mapping[str, float]) -> dict[str, float]:
    # A metric named like a structlog or event key ("event", "step") would clobber it.
    return {(f"metric_{k}" if k in _RESERVED else k): v for k, v in metrics.items()}


class MetricsLogger(Callback):
    """Logs what a human follows during a run, one structlog line per fact.

    ==================  ===================  =============================================
    event               log event            keys
    ==================  ===================  =============================================
    MetricsLogged       ``metrics_logged``   step, epoch, each metric (loss, lr, ...)
    EvaluationEnded     ``evaluation_ended`` step, epoch, trigger, each metric (val_loss..)
    CheckpointSaved     ``checkpoint_saved`` step, epoch, path, tag, each metric
    FitEnded            ``fit_ended``        step, epoch, reason, stop_reason, error
    ==================  ===================  =============================================

    Metrics are flattened into the line (a metric named ``step`` or ``event`` becomes
    ``metric_step``). Failed evaluations and failed runs are logged at error level.

    Args:
        every_s: Log at most one ``metrics_logged`` line per ``every_s`` seconds
            (``ops.throttle_first``); None logs every ``MetricsLogged`` (one per
            ``Trainer(log_every=...)`` steps).

    Raises:
        ConfigError: ``every_s`` is neither None nor a positive number.
    """

    def __init__(self, every_s: float | None = None) -> None:
        self.every_s = check_optional_seconds("every_s", every_s)

    def setup(self, bus: EventBus) -> None:
        """Subscribe the four loggers (``metrics_logged`` throttled when ``every_s`` is set)."""
        log = structlog.get_logger("trainbus")
        metrics = bus.stream(ev.MetricsLogged)
        if self.every_s is not None:
            metrics = metrics.pipe(ops.throttle_first(self.every_s))

        def metrics_logged(e: ev.MetricsLogged) -> None:
            log.info("metrics_logged", step=e.step, epoch=e.epoch, **_flatten(e.metrics))

        def evaluation_ended(e: ev.EvaluationEnded) -> None:
            fields = {"step": e.step, "epoch": e.epoch, "trigger": e.trigger}
            if e.error is not None:
                log.error("evaluation_ended", **fields, error=repr(e.error))
            else:
                log.info("evaluation_ended", **fields, **_flatten(e.metrics))

        def checkpoint_saved(e: ev.CheckpointSaved) -> None:
            log.info("checkpoint_saved", step=e.step, epoch=e.epoch, path=e.path, tag=e.tag,
                     **_flatten(e.metrics))  # fmt: skip

        def fit_ended(e: ev.FitEnded) -> None:
            level = log.error if e.reason == "failed" else log.info
            level("fit_ended", step=e.step, epoch=e.epoch, reason=e.reason,
                  stop_reason=e.stop_reason,
                  error=None if e.error is None else repr(e.error))  # fmt: skip

        metrics.subscribe(metrics_logged, name="MetricsLogger.metrics_logged")
        bus.stream(ev.EvaluationEnded).subscribe(
            evaluation_ended, name="MetricsLogger.evaluation_ended"
        )
        bus.stream(ev.CheckpointSaved).subscribe(
            checkpoint_saved, name="MetricsLogger.checkpoint_saved"
        )
        bus.stream(ev.FitEnded).subscribe(fit_ended, name="MetricsLogger.fit_ended")


# ----------------------------------------------------------------------------- JSON lines
def event_record(event: ev.BaseEvent) -> dict[str, Any]:
    """The JSON-ready record of ``event``: ``{"type": <class name>, <every field>...}``.

    Tensors become floats (lists when not scalar), exceptions their ``repr``, commands
    ``{"type": <class name>, <fields>...}``, nested events records, mappings dicts. The codec
    is :mod:`trainbus._wire`'s, shared with the launcher's socket.
    """
    return wire.record(event)


class _Writer:
    """Appends batches of events to one file, from a worker thread."""

    def __init__(self, path: Path, append: bool) -> None:
        self.path = path
        self.mode = "a" if append else "w"
        self.opened = False

    async def write(self, batch: list[ev.BaseEvent]) -> None:
        # Serialising reads tensors and formats floats: keep that off the loop too.
        await anyio.to_thread.run_sync(self._write, batch)

    def _write(self, batch: list[ev.BaseEvent]) -> None:
        text = "".join(json.dumps(wire.encode(e), allow_nan=True) + "\n" for e in batch)
        if not self.opened:  # lazily: a run that logs nothing creates nothing
            self.path.parent.mkdir(parents=True, exist_ok=True)
        # Reopened per batch (about once per flush_s): nothing to close when the run ends.
        with open(self.path, self.mode if not self.opened else "a", encoding="utf-8") as f:
            f.write(text)
        self.opened = True


class JsonlEventLog(Callback):
    """Writes events to ``path`` as JSON lines, one record per event (see :func:`event_record`),
    each with the format version ``"v": 1`` (:data:`FORMAT_VERSION`) and the event's ``time``, so
    :func:`trainbus._replay` can rebuild the run with its timing.

    Pipeline::

        events -> buffer_with_time(flush_s) -> drop empty batches
               -> async subscriber (overflow="block"): serialise + write in anyio.to_thread

    Nothing is dropped: a slow disk makes the bus wait (``"block"``), never lose a line; when
    the run ends the bus completes its streams, ``buffer_with_time`` emits its partial batch and
    the bus waits for the write, so ``FitEnded`` is in the file when ``fit()`` returns. The file
    and its parent folders are created at the first write; ``float('nan')`` is written as
    ``NaN`` (Python's ``json`` reads it back).

    Subscribing to every event (``events=None``) makes the loop build every event, micro-batch
    ones included: pass the types you need to keep the training thread's cost minimal.

    Args:
        path: The ``.jsonl`` file.
        events: Event classes to record (subclasses included); None records every event.
        flush_s: Seconds of events per written batch (> 0).
        append: Append to an existing file instead of replacing it (resumed runs).

    Raises:
        ConfigError: ``path`` is not a file path, ``events`` holds something that is not an
            event class or is empty, ``flush_s`` is not positive, ``append`` is not a bool.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        events: Iterable[type[ev.BaseEvent]] | None = None,
        flush_s: float = 1.0,
        *,
        append: bool = False,
    ) -> None:
        self.path = check_path("path", path)
        chosen: tuple[type[ev.BaseEvent], ...] | None = None
        if events is not None:
            if not isinstance(events, type | Iterable) or isinstance(events, str | bytes):
                raise ConfigError.invalid(
                    "events", events, "None (every event) or event classes, e.g. (ev.StepEnded,)"
                )
            chosen = tuple(cast(Any, [events] if isinstance(events, type) else events))
            if not chosen or not all(
                isinstance(t, type) and issubclass(t, ev.BaseEvent) for t in chosen
            ):
                raise ConfigError.invalid(
                    "events", events, "None (every event) or event classes, e.g. (ev.StepEnded,)"
                )
        self.events = chosen
        self.flush_s = check_seconds("flush_s", flush_s)
        if not isinstance(append, bool):
            raise ConfigError.invalid("append", append, "True or False")
        self.append = append

    def setup(self, bus: EventBus) -> None:
        """Subscribe the batching pipeline and its writer."""
        source = bus.events if self.events is None else bus.stream(*self.events)
        writer = _Writer(self.path, self.append)
        bus.subscribe_async(
            source.pipe(ops.buffer_with_time(self.flush_s), ops.filter(bool)),
            writer.write,
            overflow="block",
            name="JsonlEventLog",
        )

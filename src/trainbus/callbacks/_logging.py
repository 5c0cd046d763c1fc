"""Logging built-ins: structlog lines for humans, a JSON-lines event log for machines, and
:func:`write_in_batches` for every file-backed logger."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import anyio.to_thread
import structlog
from reactivex import Observable
from reactivex import operators as ops

from .. import _wire as wire
from .. import events as ev
from .._exceptions import ConfigError
from .._validate import check_bool, check_optional_seconds, check_path, check_seconds
from ._base import Callback

if TYPE_CHECKING:
    from .._bus import EventBus

__all__ = ["JsonlEventLog", "MetricsLogger", "write_in_batches"]

_RESERVED = frozenset({"event", "step", "epoch", "level", "timestamp", "logger"})


def _flatten(metrics: Mapping[str, float]) -> dict[str, float]:
    # A metric named like a structlog or event key ("event", "step") would clobber it.
    return {(f"metric_{k}" if k in _RESERVED else k): v for k, v in metrics.items()}


class MetricsLogger(Callback):
    """Logs what a human follows during a run, one structlog line per fact. See
    docs/callbacks/metrics-logger.md.

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
            log.info(
                "checkpoint_saved",
                step=e.step,
                epoch=e.epoch,
                path=e.path,
                tag=e.tag,
                **_flatten(e.metrics),
            )

        def fit_ended(e: ev.FitEnded) -> None:
            level = log.error if e.reason == "failed" else log.info
            level(
                "fit_ended",
                step=e.step,
                epoch=e.epoch,
                reason=e.reason,
                stop_reason=e.stop_reason,
                error=None if e.error is None else repr(e.error),
            )

        metrics.subscribe(metrics_logged, name="MetricsLogger.metrics_logged")
        bus.stream(ev.EvaluationEnded).subscribe(
            evaluation_ended, name="MetricsLogger.evaluation_ended"
        )
        bus.stream(ev.CheckpointSaved).subscribe(
            checkpoint_saved, name="MetricsLogger.checkpoint_saved"
        )
        bus.stream(ev.FitEnded).subscribe(fit_ended, name="MetricsLogger.fit_ended")


def write_in_batches(
    bus: EventBus,
    source: Observable[Any],
    write: Callable[[list[Any]], None],
    *,
    flush_s: float,
    name: str,
    buffer: int | None = None,
) -> None:
    """Subscribe ``write(batch)`` to ``source`` in batches of ``flush_s`` seconds, run in a
    worker thread in order; lossless (a writer that falls behind makes training wait)."""

    async def run(batch: list[Any]) -> None:
        await anyio.to_thread.run_sync(write, batch)

    bus.subscribe_async(
        source.pipe(ops.buffer_with_time(flush_s), ops.filter(bool)),
        run,
        buffer=buffer,
        overflow="block",
        name=name,
    )


class _Writer:
    """Appends batches of events to one file, created at the first batch."""

    def __init__(self, path: Path, append: bool) -> None:
        self.path = path
        self.mode = "ab" if append else "wb"

    def write(self, batch: list[ev.BaseEvent]) -> None:
        data = b"".join(wire.dumps(e) for e in batch)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Reopened per batch (about once per flush_s): nothing to close when the run ends.
        with open(self.path, self.mode) as f:
            f.write(data)
        self.mode = "ab"


class JsonlEventLog(Callback):
    """Writes events to ``path`` as JSON lines for :func:`trainbus.replay`, in batches from a
    worker thread. Tensors become floats (lists when not scalar), exceptions their ``repr``.
    See docs/callbacks/jsonl-event-log.md.

    Args:
        path: The ``.jsonl`` file.
        events: Event classes to record (subclasses included); None records every event.
        flush_s: Seconds of events per written batch (> 0).
        append: Append to an existing file instead of replacing it (resumed runs).

    Raises:
        ConfigError: a bad ``path``, ``events``, ``flush_s`` or ``append``, naming it.
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
            iterable = isinstance(events, Iterable) and not isinstance(events, str | bytes)
            chosen = tuple(cast(Any, events if iterable else [events]))
            if not chosen or not all(
                isinstance(t, type) and issubclass(t, ev.BaseEvent) for t in chosen
            ):
                raise ConfigError.invalid(
                    "events", events, "None (every event) or event classes, e.g. (ev.StepEnded,)"
                )
        self.events = chosen
        self.flush_s = check_seconds("flush_s", flush_s)
        self.append = check_bool("append", append)

    def setup(self, bus: EventBus) -> None:
        """Subscribe the batching pipeline and its writer."""
        source = bus.events if self.events is None else bus.stream(*self.events)
        writer = _Writer(self.path, self.append)
        write_in_batches(bus, source, writer.write, flush_s=self.flush_s, name="JsonlEventLog")

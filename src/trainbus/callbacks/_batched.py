"""One way for a logger to write off the training thread: batches in a worker thread.

The file-backed loggers (TensorBoard, MLflow, Weights & Biases) take their events in batches of
``flush_s`` seconds and hand each batch to a blocking ``write`` in a worker thread, one batch at
a time, losslessly (``overflow="block"``: a logger that falls behind makes training wait, with
the bus' ``training_waits_for_subscriber`` warning, rather than drop a metric).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio.to_thread
from reactivex import Observable
from reactivex import operators as ops

from .._bus import EventBus

__all__ = ["write_in_batches"]


def write_in_batches(
    bus: EventBus,
    source: Observable[Any],
    write: Callable[[list[Any]], None],
    *,
    flush_s: float,
    name: str,
    buffer: int | None = None,
) -> None:
    """Subscribe ``write(batch)`` to ``source`` in batches of ``flush_s`` seconds, each run in a
    worker thread (one at a time, in order); an empty window writes nothing.

    Args:
        bus: Where to subscribe.
        source: The events to write (a bus stream).
        write: Writes one batch; blocking is fine (it runs in a worker thread).
        flush_s: Seconds per batch.
        name: The subscription's name in logs and statistics.
        buffer: Batches that may wait (the bus' default when None).
    """

    async def run(batch: list[Any]) -> None:
        await anyio.to_thread.run_sync(write, batch)

    bus.subscribe_async(
        source.pipe(ops.buffer_with_time(flush_s), ops.filter(bool)),
        run, buffer=buffer, overflow="block", name=name,
    )  # fmt: skip

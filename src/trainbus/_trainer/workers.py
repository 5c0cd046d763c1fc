"""DataLoader worker processes seen from the trainer: which start method a run's loaders use,
and ending the persistent workers a call started.

Persistent workers outlive their iterator; a sweep of runs in one process would pile them up
(and every later fork copies the old iterators, whose ``__del__`` then fails), so
:func:`end_workers` shuts them down when a call ends. Torch has no public method for it: the
loader's ``_iterator._shutdown_workers()`` is used, guarded.

Starting multiprocessing's resource tracker (the first spawned process) unblocks SIGINT on the
calling thread, so a run whose loaders spawn workers starts it before masking SIGINT
(:meth:`~trainbus._trainer.calls.SignalWatcher.masked`).
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterable
from typing import Any

from torch.utils.data import DataLoader

__all__ = ["end_workers", "spawns_workers"]


def _start_method(loader: DataLoader[Any]) -> str:
    context = loader.multiprocessing_context
    if context is not None:
        return str(context.get_start_method())
    # allow_none: reading must not fix the default (a later set_start_method would raise).
    method = multiprocessing.get_start_method(allow_none=True)
    return method if method is not None else multiprocessing.get_all_start_methods()[0]


def spawns_workers(loaders: Iterable[object]) -> bool:
    """Whether any of ``loaders`` is a ``DataLoader`` starting workers by spawn or forkserver."""
    return any(
        isinstance(loader, DataLoader)
        and loader.num_workers > 0
        and _start_method(loader) != "fork"
        for loader in loaders
    )


def end_workers(loaders: Iterable[object]) -> None:
    """Shut down the persistent workers of the ``DataLoader``\\ s among ``loaders``; the next
    ``iter()`` of a loader starts fresh ones."""
    seen: set[int] = set()
    for loader in loaders:
        if not isinstance(loader, DataLoader) or id(loader) in seen:
            continue
        seen.add(id(loader))
        if not (loader.persistent_workers and loader.num_workers > 0):
            continue
        iterator = getattr(loader, "_iterator", None)
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if shutdown is None:
            continue
        loader._iterator = None
        shutdown()

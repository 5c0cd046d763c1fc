"""DataLoader worker processes seen from the trainer: which start method a run's loaders use,
and ending the workers a call started.

Persistent workers (``persistent_workers=True``) outlive the iterator that started them: the
loader keeps its iterator for the next ``iter()``. A sweep of runs in one process (a notebook)
then piles up worker processes, and every later fork copies the old iterators into the new
workers, where their ``__del__`` fails (``AssertionError: can only test a child process``,
printed once per copy). :func:`end_workers` shuts them down when a call ends, as a plain
loop's iterator would be at the end of its ``for``. Torch has no public method for it: the
loader's ``_iterator`` and the iterator's ``_shutdown_workers()`` (idempotent, the one its own
``__del__`` calls) are used, guarded so another torch only leaves the workers running.

A Ctrl-C in a terminal is sent to the whole process group, DataLoader workers included.
:meth:`SignalWatcher.masked` keeps it from them by blocking SIGINT on the training thread,
which workers inherit whether forked or spawned. One CPython detail needs help first: the
first spawned process of a program starts multiprocessing's resource tracker, and starting it
*unblocks* SIGINT on the calling thread (``resource_tracker.ensure_running`` blocks, spawns,
then ``SIG_UNBLOCK``\\ s instead of restoring). A run whose loaders spawn workers therefore
starts the tracker before the mask is set; a run with forked workers or none starts nothing.
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
    # allow_none: reading must not fix the program's default context (a later
    # set_start_method would raise); the first of get_all_start_methods() is the default.
    method = multiprocessing.get_start_method(allow_none=True)
    return method if method is not None else multiprocessing.get_all_start_methods()[0]


def spawns_workers(loaders: Iterable[object]) -> bool:
    """Whether any of ``loaders`` starts worker processes by spawn or forkserver.

    Args:
        loaders: The run's data (anything iterable; only ``DataLoader``\\ s with workers count).

    Returns:
        True when one is a ``DataLoader`` with ``num_workers > 0`` whose start method is not
        ``"fork"``.
    """
    return any(
        isinstance(loader, DataLoader)
        and loader.num_workers > 0
        and _start_method(loader) != "fork"
        for loader in loaders
    )


def end_workers(loaders: Iterable[object]) -> None:
    """Shut down the persistent workers of ``loaders`` (see the module docstring); the next
    ``iter()`` of a loader starts fresh ones. Loaders without persistent workers, and
    anything that is not a ``DataLoader``, are left alone (their iterators end with the loop
    that held them).

    Args:
        loaders: The data a call used (train, eval sets, prediction data).
    """
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

"""The names of this process' OS threads, read from Linux's /proc (the scripts' one reader).

A thread can end between the listing of ``/proc/self/task`` and the read of its ``comm``: the read
then fails with ``FileNotFoundError`` or, once the task is reaped, ``ProcessLookupError`` (ESRCH).
An ended thread is not running, so it is left out rather than failing the script.
"""

from __future__ import annotations

import os
from pathlib import Path

TASKS = Path("/proc/self/task")


def thread_names() -> list[str]:
    """The sorted names of this process' OS threads still running, the main one included."""
    if not TASKS.is_dir():
        return []
    names = []
    for task in os.listdir(TASKS):
        try:
            names.append((TASKS / task / "comm").read_text().strip())
        except (FileNotFoundError, ProcessLookupError):  # it ended after the listing
            continue
    return sorted(names)

"""Folders of runs: ``runs/demo/<timestamp>`` with a ``latest`` pointer to the newest, which
:func:`resolve_run` follows (``runs/demo`` means its newest run)."""

from __future__ import annotations

import os
import time
from pathlib import Path

__all__ = ["LATEST", "new_run_dir", "resolve_run"]

LATEST = "latest"
"""The pointer in a folder of runs (``runs/demo/latest``) to its newest run: a symbolic link,
or a text file naming the run's folder where links cannot be made."""


def resolve_run(path: str | os.PathLike[str]) -> Path:
    """The event log a path names: the ``.jsonl`` file itself, ``<run dir>/events.jsonl``, or
    for a folder of runs the newest run's log, by its ``latest`` pointer. The file may not
    exist."""
    file = Path(path)
    if not file.is_dir():
        return file
    latest = file / LATEST
    if not (file / "events.jsonl").exists():
        if latest.is_dir():  # a symbolic link
            return latest / "events.jsonl"
        if latest.is_file():  # a pointer file
            name = latest.read_text(encoding="utf-8").strip()
            if name and Path(name).name == name:  # a folder beside it, never a path elsewhere
                return file / name / "events.jsonl"
    return file / "events.jsonl"


def new_run_dir(root: Path) -> Path:
    """Create and return the empty run folder ``root/<timestamp>`` (``-2``, ``-3``... on a
    clash) and point ``root/latest`` at it."""
    root.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_dir, n = root / stamp, 1
    while True:
        try:
            run_dir.mkdir()
            break
        except FileExistsError:
            n += 1
            run_dir = root / f"{stamp}-{n}"
    latest = root / LATEST
    if latest.is_symlink() or latest.is_file():
        latest.unlink()
    try:
        latest.symlink_to(run_dir.name, target_is_directory=True)
    except OSError:  # no symbolic links here (Windows without the privilege)
        latest.write_text(run_dir.name + "\n", encoding="utf-8")
    return run_dir

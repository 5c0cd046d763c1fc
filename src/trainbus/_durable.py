"""fsync of files and of the folders holding them (a name is durable once its folder is);
folders on POSIX only: NTFS journals renames."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["fsync_file", "fsync_folder", "fsync_tree"]


def fsync_file(path: Path) -> None:
    """Flush ``path``'s data to disk."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_folder(path: Path) -> None:
    """Flush ``path``'s entries (the names created, renamed or removed in it) to disk."""
    if os.name != "posix":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """Flush every file under the folder ``path``, then every folder, ``path`` last."""
    for root, _, files in os.walk(path, topdown=False):
        for name in files:
            fsync_file(Path(root, name))
        fsync_folder(Path(root))

"""Making what was written survive a power cut: fsync of files and of the folders holding them.

A file's data is durable once the file is fsynced; its name (a create or an ``os.replace``)
once its folder is. Every checkpoint writer uses these: the store's single files, a sharded
run's folders, the copy of a best checkpoint. POSIX only for folders: Windows cannot open a
folder for fsync, and NTFS journals renames.
"""

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

"""Reading checkpoints safely, a file or a sharded run's folder: every file checked before
anything is loaded (a zip's CRCs, then ``torch.load(weights_only=True)``, then the payload's
structure); whatever is wrong is a :class:`~trainbus.CheckpointError` naming the file.
"""

from __future__ import annotations

import os
import pickle
import zipfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from .._exceptions import CheckpointError
from ._state import Checkpoint, parse_payload

__all__ = [
    "STATE_FILE",
    "one_line_reason",
    "rank_file",
    "read_file",
    "read_folder",
    "read_rank_file",
]

STATE_FILE = "trainbus.pt"
"""The file of a checkpoint folder holding trainbus' own state (rank 0 writes it)."""
_METADATA = ".metadata"


def one_line_reason(exc: BaseException) -> str:
    """An exception in one line (torch.load's refusals are a page around one line)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    for i, line in enumerate(lines):
        if "WeightsUnpickler error" in line:
            return " ".join(lines[i : i + 2])
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def _refuse(path: Path, what: str, cause: BaseException | None = None) -> CheckpointError:
    error = CheckpointError(what, path=str(path))
    error.__cause__ = cause
    return error


def read_file(path: Path, *, map_location: Any = "cpu") -> Checkpoint:
    """:func:`~trainbus.checkpoint.read_checkpoint` of a file."""
    p = path
    if not p.is_file():
        raise _refuse(p, "no such file")
    if p.stat().st_size == 0:
        raise _refuse(p, "empty file (0 bytes): a write that never completed")
    # A damaged zip raises many kinds (BadZipFile, EOFError, struct.error, zlib.error...).
    try:
        with zipfile.ZipFile(p) as z:
            bad = z.testzip()
    except MemoryError:
        raise
    except Exception as exc:
        raise _refuse(p, f"not a complete checkpoint archive (truncated or not a torch "
                         f"file): {exc}", exc) from exc  # fmt: skip
    if bad is not None:
        raise _refuse(p, f"corrupt: the archive member {bad!r} fails its CRC check")
    try:
        payload = torch.load(p, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        what = ("refused by safe loading (weights_only=True): it holds objects other than "
                "tensors and plain containers, so it is not a trainbus checkpoint and may be "
                f"crafted to run code ({one_line_reason(exc)})")  # fmt: skip
        raise _refuse(p, what, exc) from exc
    except MemoryError:
        raise
    except Exception as exc:
        raise _refuse(p, f"torch.load cannot read it: {one_line_reason(exc)}", exc) from exc
    return parse_payload(payload, p)


def rank_file(rank: int) -> str:
    """Rank ``rank``'s own file in a checkpoint folder."""
    return f"rank-{rank}.pt"


def _check_dcp_files(folder: Path) -> None:
    """The DCP index parses and names files that are all present and long enough."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    if not (folder / _METADATA).is_file():
        raise CheckpointError("no DCP index (.metadata): not a complete sharded checkpoint",
                              path=str(folder))  # fmt: skip
    try:
        metadata = FileSystemReader(str(folder)).read_metadata()
    except Exception as exc:
        raise CheckpointError(f"its DCP index (.metadata) cannot be read: {one_line_reason(exc)}",
                              path=str(folder)) from exc  # fmt: skip
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = int(info.offset) + int(info.length)
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for relative, end in sorted(needed.items()):
        file = folder / relative
        if not file.is_file():
            raise CheckpointError(f"missing the shard file {relative} (a rank's part of the "
                                  "model and optimizer state)", path=str(folder))  # fmt: skip
        size = file.stat().st_size
        if size < end:
            raise CheckpointError(f"the shard file {relative} is truncated ({size} bytes, the "
                                  f"index needs {end})", path=str(folder))  # fmt: skip


def read_folder(folder: str | os.PathLike[str]) -> Checkpoint:
    """Read and check a sharded checkpoint folder; nothing is applied to a model yet.

    Args:
        folder: The checkpoint folder (``step-<n>[-<tag>]/``).

    Returns:
        The :class:`~trainbus.checkpoint.Checkpoint` of ``trainbus.pt`` (``meta["sharded"]``
        True; empty ``model`` and ``optimizer``: they are in the DCP files).

    Raises:
        CheckpointError: not a folder, the DCP index is missing or unreadable, a shard file
            or a rank's ``rank-<r>.pt`` is missing or truncated, or ``trainbus.pt`` is not a
            valid trainbus payload. The message names the folder.
    """
    path = Path(folder)
    if not path.is_dir():
        raise CheckpointError("no such checkpoint folder", path=str(path))
    _check_dcp_files(path)
    if not (path / STATE_FILE).is_file():
        raise CheckpointError(f"missing {STATE_FILE} (trainbus' own state, written by rank 0)",
                              path=str(path))  # fmt: skip
    inner = read_file(path / STATE_FILE)
    checkpoint = replace(inner, path=path)
    if not checkpoint.meta.get("sharded"):
        raise CheckpointError(f"its {STATE_FILE} is not a sharded checkpoint's",
                              path=str(path))  # fmt: skip
    world = int(checkpoint.meta["world_size"])
    missing = [rank_file(r) for r in range(world) if not (path / rank_file(r)).is_file()]
    if missing:
        raise CheckpointError(f"missing {', '.join(missing)} (each rank's RNG and data order; "
                              f"written by {world} ranks)", path=str(path))  # fmt: skip
    return checkpoint


def read_rank_file(folder: Path, rank: int) -> dict[str, Any]:
    """Rank ``rank``'s RNG states and data order; ``CheckpointError`` when it is missing,
    damaged or foreign."""
    path = folder / rank_file(rank)
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError as exc:
        raise CheckpointError(f"missing {rank_file(rank)}", path=str(folder)) from exc
    except Exception as exc:
        why = one_line_reason(exc)
        raise CheckpointError(f"{rank_file(rank)} cannot be read (damaged, or not written by "
                              f"trainbus): {why}", path=str(folder)) from exc  # fmt: skip
    if not isinstance(saved, dict) or not {"rng", "data_order"} <= set(saved):
        raise CheckpointError(f"{rank_file(rank)} is not a trainbus rank file", path=str(folder))
    return saved

"""Reading one checkpoint file safely: the zip's CRCs first, then
``torch.load(weights_only=True)``, then the payload's structure; whatever is wrong is a
:class:`~trainbus.CheckpointError` naming the file.
"""

from __future__ import annotations

import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch

from .._exceptions import CheckpointError
from ._state import Checkpoint, parse_payload

__all__ = ["one_line_reason", "read_file"]


def one_line_reason(exc: BaseException) -> str:
    """An exception in one line: torch.load's refusals are a page of advice around one line
    of diagnosis (``WeightsUnpickler error: ...``)."""
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
    """Read and check one checkpoint file, as :func:`trainbus.checkpoint.read_checkpoint` does
    for a file (its docstring says what is refused); nothing is applied to a model yet.

    Raises:
        CheckpointError: naming the file; the low-level error is the ``__cause__``.
    """
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

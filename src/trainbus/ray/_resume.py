"""Resuming from the checkpoint Ray hands a restarted worker (``ray.train.get_checkpoint()``):
``fit(resume="latest")`` asks here first, since restarted workers may not see the old ones'
disks but do see Ray's storage. Ray is never imported here.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from .._exceptions import CheckpointError
from .._log import get_logger
from ..checkpoint import Checkpoint, read_checkpoint

__all__ = ["read_ray_checkpoint"]

log = get_logger(__name__)


def _handed() -> Any:
    """Ray's checkpoint for this worker, or None (no Ray Train here, none handed)."""
    train = sys.modules.get("ray.train")
    if train is None:
        return None
    try:
        return train.get_checkpoint()
    except RuntimeError:  # Ray Train is imported, but this is not one of its workers
        return None


def read_ray_checkpoint() -> Checkpoint | None:
    """Read the trainbus checkpoint in the Ray checkpoint handed to this worker: the first
    file in its folder that reads as one.

    Returns:
        The checkpoint (not applied yet), or None: not a Ray Train worker, Ray handed none, or
        none of its files is readable (logged as ``resume_ray_checkpoint_unreadable``).
    """
    handed = _handed()
    if handed is None:
        return None
    errors: list[str] = []
    with handed.as_directory() as folder:
        for path in sorted(p for p in Path(folder).iterdir() if p.is_file()):
            try:
                checkpoint = read_checkpoint(path, map_location="cpu")
            except CheckpointError as exc:
                errors.append(str(exc))
                continue
            log.info("resume_ray_checkpoint", path=str(path), step=checkpoint.state.step)
            return checkpoint
    log.warning("resume_ray_checkpoint_unreadable", ray_checkpoint=str(handed.path),
                errors=errors or ["no file in it"],
                action="resuming from checkpoint_dir instead")  # fmt: skip
    return None

"""Resuming a sharded run: every rank finds, checks and restores its part of a checkpoint
folder (:mod:`trainbus.checkpoint._sharded` writes and reads it), agreed across ranks."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .._exceptions import CheckpointError
from .._log import get_logger
from ._reading import one_line_reason
from ._sharded import (
    RankFailure,
    dcp_state,
    gather_errors,
    rank_and_world,
    read_folder,
    read_rank_file,
)
from ._state import Checkpoint
from ._store import CheckpointStore

__all__ = ["load_sharded"]

log = get_logger(__name__)


def _agree_path(path: str) -> None:
    """Every rank resumes the same checkpoint (a collective)."""
    _, world = rank_and_world()
    if world == 1:
        return
    paths: list[str | None] = [None] * world
    dist.all_gather_object(paths, path)
    if len(set(paths)) > 1:
        raise CheckpointError("the ranks found different checkpoints to resume ("
                              + "; ".join(f"rank {r}: {p or 'none'}" for r, p in enumerate(paths))
                              + "): every rank must see the same checkpoint folder")  # fmt: skip


def _find_sharded(
    resume: str | os.PathLike[str], checkpoint_dir: Path | None
) -> tuple[Checkpoint | None, str]:
    """The sharded checkpoint to resume, this rank's view: ``"latest"`` in
    ``checkpoint_dir`` or a folder. Returns it (None: ``"latest"`` found none) and what the folder
    held, in words; ``CheckpointError`` for a one-file checkpoint or a damaged folder.
    """
    advice = ("a sharded (fully_shard) model resumes from a checkpoint folder written by a "
              "sharded run; to start from an unsharded run's weights, load them into the model "
              "before fully_shard and start a fresh run")  # fmt: skip
    if resume == "latest":
        assert checkpoint_dir is not None
        scan = CheckpointStore(checkpoint_dir).find_latest(map_location="cpu")
        found = scan.checkpoint
        if found is not None and not found.meta.get("sharded"):
            raise CheckpointError(f"the newest checkpoint is a one-file checkpoint (an "
                                  f"unsharded run's): {advice}", path=str(found.path))  # fmt: skip
        return found, scan.describe()
    path = Path(resume)
    if path.is_file():
        raise CheckpointError(f"a one-file checkpoint (an unsharded run's): {advice}",
                              path=str(path))  # fmt: skip
    return read_folder(path), ""


def load_sharded(
    resume: str | os.PathLike[str],
    checkpoint_dir: Path | None,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any | None,
    scaler: Any | None,
) -> tuple[Checkpoint | None, str]:
    """Find, check and restore a sharded checkpoint on every rank (every rank calls it).

    Each rank reads and checks the folder and its own ``rank-<r>.pt``; the ranks agree that
    every one succeeded and found the same folder; then DCP loads each rank's shards of the
    model and optimizer state (resharded when the world size changed), and the scheduler and
    grad scaler are restored.

    Args:
        resume: ``"latest"`` or a checkpoint folder.
        checkpoint_dir: The run's checkpoint folder (for ``"latest"``).
        model, optimizer: The sharded model and its optimizer, restored in place.
        scheduler, scaler: Restored when present here and in the checkpoint.

    Returns:
        ``(checkpoint, found)``: the checkpoint with this rank's RNG states and data order
        (None when ``"latest"`` found none on every rank), and what the folder held.

    Raises:
        CheckpointError: on every rank, when any rank could not read or check its part
            (naming the rank and why), the ranks found different checkpoints, or DCP could
            not load the state; nothing is trained from a half-restored model.
    """
    rank, world = rank_and_world()
    checkpoint: Checkpoint | None = None
    found = ""
    own: dict[str, Any] | None = None
    error: BaseException | None = None
    try:
        checkpoint, found = _find_sharded(resume, checkpoint_dir)
        if checkpoint is not None:
            saved_world = int(checkpoint.meta["world_size"])
            checkpoint.check_compatible(model=model, optimizer=optimizer, world_size=saved_world)
            if rank < saved_world:
                own = read_rank_file(checkpoint.path, rank)
    except BaseException as exc:  # agreed below, then raised on every rank
        error = exc
    _raise_load(error, gather_errors(error))
    _agree_path("" if checkpoint is None else str(checkpoint.path))
    if checkpoint is None:
        return None, found
    try:
        _restore_state(checkpoint, model=model, optimizer=optimizer, scheduler=scheduler,
                       scaler=scaler)  # fmt: skip
    except BaseException as exc:
        error = exc
    _raise_load(error, gather_errors(error), checkpoint.path)
    if own is None:
        log.warning("resume_rng_not_saved", rank=rank, world_size=world,
                    saved_world_size=int(checkpoint.meta["world_size"]),
                    action="this rank keeps its seeded random state")  # fmt: skip
        return replace(checkpoint, rng=None), found
    order = own["data_order"] if own["data_order"] is not None else checkpoint.data_order
    return replace(checkpoint, rng=own["rng"], data_order=order), found


def _raise_load(
    error: BaseException | None, failed: list[RankFailure], path: Path | None = None
) -> None:
    if not failed:
        return
    if isinstance(error, CheckpointError):
        raise error
    what = "; ".join(f"rank {f.rank}: {f.text}" for f in failed)
    raise CheckpointError(f"cannot resume: {what}",
                          path=None if path is None else str(path)) from error  # fmt: skip


def _restore_state(
    checkpoint: Checkpoint,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any | None,
    scaler: Any | None,
) -> None:
    from torch.distributed.checkpoint.state_dict import set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    state = dcp_state(model, optimizer)
    try:
        dcp_load(state, checkpoint_id=str(checkpoint.path))  # a collective, errors agreed
    except Exception as exc:
        why = one_line_reason(exc)
        raise CheckpointError(f"DCP could not load the model and optimizer shards: {why}",
                              path=str(checkpoint.path)) from exc  # fmt: skip
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])  # fmt: skip
    if scheduler is not None and checkpoint.scheduler is not None:
        scheduler.load_state_dict(checkpoint.scheduler)
    if scaler is not None and checkpoint.scaler is not None:
        scaler.load_state_dict(checkpoint.scaler)

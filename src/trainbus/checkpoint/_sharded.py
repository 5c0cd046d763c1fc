"""Sharded checkpoints: one folder per save, written and resumed by every rank of an FSDP2 run
through ``torch.distributed.checkpoint`` (DCP), and exported as one plain file. The folder's
layout and its guarantees are docs/distributed.md's (FSDP2).
"""

from __future__ import annotations

import os
import secrets
import shutil
import warnings
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import torch
import torch.distributed as dist

from .._durable import fsync_file, fsync_folder
from .._exceptions import CheckpointError, CheckpointWriteError, ConfigError
from .._log import get_logger
from ._rng import capture_rng
from ._state import Checkpoint, TrainState, build_payload, check_plain, restore_scheduler_scaler
from ._store import (
    STATE_FILE,
    CheckpointStore,
    folder_name,
    one_line_reason,
    rank_file,
    read_folder,
    read_rank_file,
    temp_name,
    write_atomic,
)

__all__ = ["export_full", "folder_name", "load_sharded", "save_sharded"]

log = get_logger(__name__)

_PREFIX = "model."  # the model entries of a DCP index
T = TypeVar("T")


def rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _gather(value: T) -> list[T]:
    """Every rank's ``value``, in rank order (a collective)."""
    _, world = rank_and_world()
    out = [value] * world
    if world > 1:
        dist.all_gather_object(out, value)
    return out


class RankFailure(NamedTuple):
    """One rank's failure, ``"<type>: <message>"`` (and a refused write's errno)."""

    rank: int
    text: str
    errno: int | None = None
    strerror: str | None = None


def gather_errors(error: BaseException | None) -> list[RankFailure]:
    """A collective: every rank's failure, given this rank's error (or None)."""
    mine: tuple[str, int | None, str | None] | None = None
    if isinstance(error, CheckpointWriteError):
        mine = (f"{type(error).__name__}: {error}", error.errno, error.strerror)
    elif error is not None:
        mine = (f"{type(error).__name__}: {error}", None, None)
    return [RankFailure(r, *f) for r, f in enumerate(_gather(mine)) if f is not None]


def _torch_save(obj: object, path: Path) -> None:
    torch.save(obj, path)
    fsync_file(path)


def dcp_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optim_state}


def save_sharded(
    directory: Path,
    *,
    name: str,
    state: TrainState,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any | None,
    scaler: Any | None,
    metrics: Mapping[str, float],
    data_order: dict[str, Any] | None = None,
    callback_states: Mapping[str, Mapping[str, Any]] | None = None,
    run: Mapping[str, Any] | None = None,
) -> Path:
    """Write a sharded checkpoint folder ``directory / name`` atomically; every rank calls it.

    Args:
        name: The checkpoint's folder name (``step-<n>[-<tag>]``).
        model, optimizer: The sharded model and its optimizer (saved through DCP).
        data_order: This rank's :func:`~trainbus.checkpoint.capture_data_order`.
        directory, state, scheduler, scaler, metrics, callback_states, run: As for
            :func:`~trainbus.checkpoint.save_checkpoint` (rank 0's written).

    Returns:
        The folder's path, the same on every rank; complete when this returns.

    Raises:
        ConfigError: a callback state or the data order cannot be saved safely (on every rank).
        CheckpointWriteError: this rank's or another rank's part could not be written (an
            ``OSError``, on every rank).
        CheckpointError: another rank's part failed otherwise (naming it).
    """
    rank, world = rank_and_world()
    final = directory / name
    payload: dict[str, Any] | None = None
    tmp_name = ""
    error: BaseException | None = None
    try:  # the local part that may fail, agreed before the first collective write
        check_plain(data_order, "data_order")
        if rank == 0:
            payload = build_payload(
                state=state,
                model=model,
                optimizer=optimizer,
                scheduler=scheduler,
                scaler=scaler,
                metrics=metrics,
                rng=None,
                data_order=data_order,
                callback_states=callback_states,
                world_size=world,
                sharded=True,
                run=run,
            )
            try:
                directory.mkdir(parents=True, exist_ok=True)
                tmp_name = temp_name(name)
                (directory / tmp_name).mkdir()
            except OSError as exc:
                raise CheckpointWriteError(str(final), exc) from exc
    except BaseException as exc:  # raised below on this rank, after the others heard of it
        error = exc
    _raise_agreed(error, final, None)
    tmp = directory / _gather(tmp_name)[0]  # rank 0's
    try:
        from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

        # A collective: DCP gathers every rank's failure and raises it on every rank.
        dcp_save(dcp_state(model, optimizer), checkpoint_id=str(tmp))
        _torch_save({"rng": capture_rng(), "data_order": data_order}, tmp / rank_file(rank))
        if payload is not None:
            _torch_save(payload, tmp / STATE_FILE)
    except OSError as exc:
        error = CheckpointWriteError(str(final), exc)
    except BaseException as exc:
        error = exc
    _raise_agreed(error, final, tmp)
    if rank == 0:
        try:
            _publish(tmp, final)
        except OSError as exc:
            error = CheckpointWriteError(str(final), exc)
    _raise_agreed(error, final, tmp)
    return final


def _raise_agreed(error: BaseException | None, final: Path, tmp: Path | None) -> None:
    """A collective: when any rank failed, remove the temporary folder and raise on every rank,
    of the same kind (this rank's own error, else the others' as the error of that kind)."""
    failed = gather_errors(error)
    if not failed:
        return
    rank, _ = rank_and_world()
    if rank == 0 and tmp is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    if error is not None:
        raise error
    for f in failed:
        if f.errno is not None:
            raise CheckpointWriteError(
                str(final), OSError(f.errno, f"{f.strerror} (on rank {f.rank})")
            )
    for f in failed:
        if f.text.startswith("ConfigError: "):  # a state that cannot be saved: the same error
            raise ConfigError(f"{f.text.removeprefix('ConfigError: ')} (on rank {f.rank})")
    what = "; ".join(f"rank {f.rank}: {f.text}" for f in failed)
    raise CheckpointError(
        f"not written: another rank's part failed ({what}); the earlier checkpoints are untouched",
        path=str(final),
    )


def _publish(tmp: Path, final: Path) -> None:
    """Rank 0: rename the complete folder into place (over an older one of its name)."""
    fsync_folder(tmp)
    old: Path | None = None
    if final.exists():
        old = final.with_name(f".{final.name}.{os.getpid()}.{secrets.token_hex(4)}.old-tmp")
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_folder(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _agree_path(path: str) -> None:
    """Every rank resumes the same checkpoint (a collective)."""
    paths = _gather(path)
    if len(set(paths)) > 1:
        raise CheckpointError(
            "the ranks found different checkpoints to resume ("
            + "; ".join(f"rank {r}: {p or 'none'}" for r, p in enumerate(paths))
            + "): every rank must see the same checkpoint folder"
        )


def _find_sharded(
    resume: str | os.PathLike[str], checkpoint_dir: Path | None
) -> tuple[Checkpoint | None, str]:
    """This rank's view of the checkpoint to resume (None: none found) and what the folder
    held; ``CheckpointError`` for a one-file checkpoint or a damaged folder."""
    advice = (
        "a sharded (fully_shard) model resumes from a checkpoint folder written by a "
        "sharded run; to start from an unsharded run's weights, load them into the model "
        "before fully_shard and start a fresh run"
    )
    if resume == "latest":
        assert checkpoint_dir is not None
        scan = CheckpointStore(checkpoint_dir).find_latest(map_location="cpu")
        found = scan.checkpoint
        if found is not None and not found.meta.get("sharded"):
            raise CheckpointError(
                f"the newest checkpoint is a one-file checkpoint (an unsharded run's): {advice}",
                path=str(found.path),
            )
        return found, scan.describe()
    path = Path(resume)
    if path.is_file():
        raise CheckpointError(
            f"a one-file checkpoint (an unsharded run's): {advice}", path=str(path)
        )
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
    """Find, check and restore a sharded checkpoint (every rank calls it; DCP reshards for
    another world size).

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
            not load the state.
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
    _raise_load(error)
    _agree_path("" if checkpoint is None else str(checkpoint.path))
    if checkpoint is None:
        return None, found
    try:
        _restore_state(
            checkpoint, model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler
        )
    except BaseException as exc:
        error = exc
    _raise_load(error, checkpoint.path)
    if own is None:
        log.warning(
            "resume_rng_not_saved",
            rank=rank,
            world_size=world,
            saved_world_size=int(checkpoint.meta["world_size"]),
            action="this rank keeps its seeded random state",
        )
        return replace(checkpoint, rng=None), found
    order = own["data_order"] if own["data_order"] is not None else checkpoint.data_order
    return replace(checkpoint, rng=own["rng"], data_order=order), found


def _raise_load(error: BaseException | None, path: Path | None = None) -> None:
    """A collective: when any rank failed to load, raise on every rank."""
    failed = gather_errors(error)
    if not failed:
        return
    if isinstance(error, CheckpointError):
        raise error
    what = "; ".join(f"rank {f.rank}: {f.text}" for f in failed)
    raise CheckpointError(
        f"cannot resume: {what}", path=None if path is None else str(path)
    ) from error


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
        raise CheckpointError(
            f"DCP could not load the model and optimizer shards: {why}", path=str(checkpoint.path)
        ) from exc
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
    )
    restore_scheduler_scaler(checkpoint, scheduler=scheduler, scaler=scaler)


def _allocate(folder: Path) -> dict[str, torch.Tensor]:
    """An empty full-size tensor for every model entry of the DCP index."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(str(folder)).read_metadata()
    out: dict[str, torch.Tensor] = {}
    for key, item in metadata.state_dict_metadata.items():
        if key.startswith(_PREFIX) and isinstance(item, TensorStorageMetadata):
            out[key[len(_PREFIX) :]] = torch.empty(item.size, dtype=item.properties.dtype)
    return out


def export_full(folder: str | os.PathLike[str], path: str | os.PathLike[str]) -> Path:
    """Write the full model state of a sharded checkpoint folder as one plain file, in one
    process (no process group, no GPU), atomically.

    Args:
        folder: A sharded run's checkpoint folder (``step-<n>[-<tag>]/``).
        path: The file to write (``model.pt``); its folder must exist.

    Returns:
        ``path``: a ``torch.save`` file of ``{parameter or buffer name: full tensor}`` (each equal
        to its sharded parameter's ``full_tensor()``), for ``model.load_state_dict``.

    Raises:
        CheckpointError: ``folder`` is not a valid sharded checkpoint folder (a one-file
            checkpoint is refused: it is plain already), or its shards cannot be read.
        CheckpointWriteError: ``path`` cannot be written (an ``OSError``).
    """
    source = Path(folder)
    if source.is_file():
        raise CheckpointError(
            "a one-file checkpoint: its 'model' entry is the full state "
            "already; export_full reads a sharded run's checkpoint folder",
            path=str(source),
        )
    read_folder(source)  # the folder checks first: index, shard files, trainbus.pt
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    model = _allocate(source)
    try:
        with warnings.catch_warnings():
            # DCP warns that it loads in one process: what this call means to do.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp_load({"model": model}, checkpoint_id=str(source), no_dist=True)
    except Exception as exc:
        raise CheckpointError(f"its shards cannot be read: {exc}", path=str(source)) from exc
    target = Path(path)
    try:
        write_atomic(model, target)
    except OSError as exc:
        raise CheckpointWriteError(str(target), exc) from exc
    return target

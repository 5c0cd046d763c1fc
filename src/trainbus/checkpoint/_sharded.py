"""Sharded checkpoints: one folder per save, written and resumed by every rank of an FSDP2 run.

Under ``fully_shard`` each rank holds its own part of every parameter and optimizer moment, so
every rank writes its part through ``torch.distributed.checkpoint`` (DCP) into one folder::

    step-00000042[-tag]/
        .metadata            DCP's index: which file holds which shard of which tensor
        __0_0.distcp ...     DCP's per-rank files: model and optimizer state
        trainbus.pt          rank 0: everything else of a one-file checkpoint (train state,
                             metrics, scheduler, scaler, callbacks, metadata with full
                             ``param_shapes`` and ``sharded``); empty ``model``/``optimizer``
        rank-<r>.pt          each rank's RNG states and data order

The write is atomic: every rank writes into a hidden temporary folder, the ranks agree that
every part was written, rank 0 renames it into place; a failure on any rank removes it and is
raised on every rank. Reading checks every file before anything is loaded; resuming
(:func:`load_sharded`) agrees across ranks that each read its part of the same folder, then
DCP loads the shards (resharded when the world size changed).
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from .._durable import fsync_file, fsync_folder
from .._exceptions import CheckpointError, CheckpointWriteError, ConfigError
from .._log import get_logger
from ._reading import one_line_reason, read_file
from ._rng import capture_rng
from ._state import Checkpoint, TrainState, build_payload, check_plain

__all__ = [
    "STATE_FILE",
    "RankFailure",
    "dcp_state",
    "folder_name",
    "gather_errors",
    "rank_and_world",
    "read_folder",
    "read_rank_file",
    "save_sharded",
]

log = get_logger(__name__)

STATE_FILE = "trainbus.pt"
"""The file of a checkpoint folder holding trainbus' own state (rank 0 writes it)."""

_METADATA = ".metadata"
_TEMP_SUFFIX = ".trainbus-tmp"


def folder_name(step: int, tag: str | None) -> str:
    """``step-00000042`` or ``step-00000042-best``: a sharded checkpoint's folder name."""
    return f"step-{step:08d}" + (f"-{tag}" if tag else "")


def _rank_file(rank: int) -> str:
    """The name of rank ``rank``'s own file in a checkpoint folder (``rank-<r>.pt``)."""
    return f"rank-{rank}.pt"


def rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class RankFailure(NamedTuple):
    """One rank's failure as every rank hears of it: ``text`` is ``"<type>: <message>"``;
    ``errno`` / ``strerror`` those of a write the disk refused, else None.
    """

    rank: int
    text: str
    errno: int | None = None
    strerror: str | None = None


def gather_errors(error: BaseException | None) -> list[RankFailure]:
    """Every rank's error, for the ranks that had one (``error``: this rank's, or None): a
    collective, the same list on every rank.
    """
    rank, world = rank_and_world()
    mine: tuple[str, int | None, str | None] | None = None
    if isinstance(error, CheckpointWriteError):
        mine = (f"{type(error).__name__}: {error}", error.errno, error.strerror)
    elif error is not None:
        mine = (f"{type(error).__name__}: {error}", None, None)
    if world == 1:
        return [] if mine is None else [RankFailure(rank, *mine)]
    found: list[tuple[str, int | None, str | None] | None] = [None] * world
    dist.all_gather_object(found, mine)
    return [RankFailure(r, *f) for r, f in enumerate(found) if f is not None]


def _broadcast(value: str) -> str:
    _, world = rank_and_world()
    if world == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return str(box[0])


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
    """Write a sharded checkpoint folder ``directory / name``; every rank calls it.

    Args:
        directory: The checkpoint folder (created on the first save).
        name: The checkpoint's folder name (``step-<n>[-<tag>]``).
        state: Where the loop is.
        model, optimizer: The sharded model and its optimizer (saved through DCP).
        scheduler, scaler: Saved through their ``state_dict()`` by rank 0 (None: absent).
        metrics: The last evaluation's metrics.
        data_order: This rank's :func:`~trainbus.checkpoint.capture_data_order`.
        callback_states: ``{name: state dict}`` (rank 0's are written).
        run: The run's cadences and data shape, compared by a resume (``meta["run"]``).

    Returns:
        The folder's path, the same on every rank; complete when this returns.

    Raises:
        ConfigError: a callback state or the data order cannot be saved safely (on every rank).
        CheckpointWriteError: this rank's or another rank's part could not be written (an
            ``OSError``, on every rank).
        CheckpointError: another rank's part failed otherwise (naming it). Nothing is
            left half-written: the temporary folder is removed, earlier checkpoints stay.
    """
    rank, world = rank_and_world()
    final = directory / name
    payload: dict[str, Any] | None = None
    tmp_name = ""
    error: BaseException | None = None
    try:  # the local part that may fail, agreed before the first collective write
        check_plain(data_order, "data_order")
        if rank == 0:
            payload = build_payload(state=state, model=model, optimizer=optimizer,
                                    scheduler=scheduler, scaler=scaler, metrics=metrics,
                                    rng=None, data_order=data_order,
                                    callback_states=callback_states, world_size=world,
                                    sharded=True, run=run)  # fmt: skip
            try:
                directory.mkdir(parents=True, exist_ok=True)
                tmp_name = f".{name}.{os.getpid()}.{secrets.token_hex(4)}{_TEMP_SUFFIX}"
                (directory / tmp_name).mkdir()
            except OSError as exc:
                raise CheckpointWriteError(str(final), exc) from exc
    except BaseException as exc:  # raised below on this rank, after the others heard of it
        error = exc
    _raise_agreed(error, gather_errors(error), final, None)
    tmp = directory / _broadcast(tmp_name)
    try:
        from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

        # A collective: DCP gathers every rank's failure and raises it on every rank.
        dcp_save(dcp_state(model, optimizer), checkpoint_id=str(tmp))
        _torch_save({"rng": capture_rng(), "data_order": data_order}, tmp / _rank_file(rank))
        if payload is not None:
            _torch_save(payload, tmp / STATE_FILE)
    except OSError as exc:
        error = CheckpointWriteError(str(final), exc)
    except BaseException as exc:
        error = exc
    _raise_agreed(error, gather_errors(error), final, tmp)
    if rank == 0:
        try:
            _publish(tmp, final)
        except OSError as exc:
            error = CheckpointWriteError(str(final), exc)
    _raise_agreed(error, gather_errors(error), final, tmp)
    return final


def _raise_agreed(
    error: BaseException | None, failed: list[RankFailure], final: Path, tmp: Path | None
) -> None:
    """After an agreement: when any rank failed, remove the temporary folder (rank 0) and
    raise on every rank, of the same kind, so every rank's loop takes the same path: this
    rank's own error; else the disk's refusal on another rank as a ``CheckpointWriteError``, a
    state that cannot be saved as a ``ConfigError``, anything else as a ``CheckpointError``
    naming the others' errors."""
    if not failed:
        return
    rank, _ = rank_and_world()
    if rank == 0 and tmp is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    if error is not None:
        raise error
    for f in failed:
        if f.errno is not None:
            raise CheckpointWriteError(str(final), OSError(f.errno, f"{f.strerror} (on rank "
                                                                    f"{f.rank})"))  # fmt: skip
    for f in failed:
        if f.text.startswith("ConfigError: "):  # a state that cannot be saved: the same error
            raise ConfigError(f"{f.text.removeprefix('ConfigError: ')} (on rank {f.rank})")
    what = "; ".join(f"rank {f.rank}: {f.text}" for f in failed)
    raise CheckpointError(f"not written: another rank's part failed ({what}); the earlier "
                          "checkpoints are untouched", path=str(final))  # fmt: skip


def _publish(tmp: Path, final: Path) -> None:
    """Rename the complete temporary folder into place (rank 0), replacing an older folder of
    the same name (a final save at a step saved before) only once the new one is complete."""
    fsync_folder(tmp)
    old: Path | None = None
    if final.exists():
        old = final.with_name(f".{final.name}.{os.getpid()}.{secrets.token_hex(4)}.old-tmp")
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_folder(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


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
    missing = [_rank_file(r) for r in range(world) if not (path / _rank_file(r)).is_file()]
    if missing:
        raise CheckpointError(f"missing {', '.join(missing)} (each rank's RNG and data order; "
                              f"written by {world} ranks)", path=str(path))  # fmt: skip
    return checkpoint


def read_rank_file(folder: Path, rank: int) -> dict[str, Any]:
    """Rank ``rank``'s RNG states and data order from a checkpoint folder.

    Raises:
        CheckpointError: the file is missing, damaged or not what trainbus writes.
    """
    path = folder / _rank_file(rank)
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError as exc:
        raise CheckpointError(f"missing {_rank_file(rank)}", path=str(folder)) from exc
    except Exception as exc:
        why = one_line_reason(exc)
        raise CheckpointError(f"{_rank_file(rank)} cannot be read (damaged, or not written by "
                              f"trainbus): {why}", path=str(folder)) from exc  # fmt: skip
    if not isinstance(saved, dict) or not {"rng", "data_order"} <= set(saved):
        raise CheckpointError(f"{_rank_file(rank)} is not a trainbus rank file", path=str(folder))
    return saved

"""The three calls the loop and the trainer make: save, load, find the latest."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from .._exceptions import ConfigError
from .._tensors import is_sharded_model
from ._rng import capture_rng
from ._state import TrainState, build_payload
from ._store import CheckpointStore, read_checkpoint

__all__ = ["latest_checkpoint", "load_checkpoint", "save_checkpoint"]


def save_checkpoint(
    directory: Path,
    *,
    tag: str | None,
    state: TrainState,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any | None,
    scaler: Any | None,
    metrics: Mapping[str, float],
    rng: dict[str, Any] | None = None,
    data_order: dict[str, Any] | None = None,
    callback_states: Mapping[str, Mapping[str, Any]] | None = None,
    world_size: int = 1,
    run: Mapping[str, Any] | None = None,
) -> Path:
    """Write a checkpoint atomically and return its path.

    Args:
        directory: The checkpoint folder (created on the first save).
        tag: Name part of the file (``step-<n>-<tag>.pt``), or None.
        state: Where the loop is.
        model, optimizer, scheduler, scaler: Saved through their ``state_dict()``.
        metrics: The last evaluation's metrics.
        rng: RNG states to store (:func:`~trainbus.checkpoint.capture_rng`); None captures the
            current ones.
        data_order: :func:`~trainbus.checkpoint.capture_data_order` of the epoch in progress.
        callback_states: ``{name: state dict}`` of tensors and plain containers.
        world_size: Processes training together.
        run: The run's cadences and data shape, compared by a resume (``meta["run"]``).

    Returns:
        The checkpoint's path; the file is complete when this returns.

    Raises:
        ConfigError: a callback state or the data order cannot be saved safely, or the
            model is sharded (FSDP2: each rank holds only its shards; every rank saves a
            folder with :func:`~trainbus.checkpoint.save_sharded`, as the Trainer does).
        OSError: the folder cannot be written; earlier checkpoints are untouched.
    """
    if is_sharded_model(model):
        raise ConfigError.invalid(
            "model", type(model).__name__, "an unsharded model: a fully_shard model's "
            "state_dict holds only this rank's shards; save it from every rank with "
            "trainbus.checkpoint.save_sharded (the Trainer does)",
        )  # fmt: skip
    payload = build_payload(
        state=state, model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler,
        metrics=metrics, rng=capture_rng() if rng is None else rng, data_order=data_order,
        callback_states=callback_states, world_size=world_size, run=run,
    )  # fmt: skip
    return CheckpointStore(directory).save(payload, step=state.step, tag=tag)


def latest_checkpoint(directory: Path) -> Path | None:
    """The newest valid checkpoint in ``directory`` (highest step, then latest written), or
    None. Damaged and foreign files are skipped with a ``checkpoint_skipped`` warning; stale temp
    files are removed.
    """
    return CheckpointStore(directory).latest_valid()


def load_checkpoint(
    path: Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any | None,
    scaler: Any | None,
    map_location: torch.device | str = "cpu",
    restore_rng: bool = True,
    world_size: int = 1,
) -> tuple[TrainState, dict[str, float]]:
    """Restore everything saved by :func:`save_checkpoint`; return the train state and metrics.

    Use :func:`~trainbus.checkpoint.read_checkpoint` to also get the data order and the
    callback states.

    Args:
        path: The checkpoint file.
        model, optimizer, scheduler, scaler: Restored in place.
        map_location: Where tensors are loaded.
        restore_rng: Set the random generators to the saved states (the default).
        world_size: Processes training together now.

    Raises:
        CheckpointError: the file is missing, damaged, not a trainbus checkpoint, or does not
            fit the model, optimizer or world size (nothing is restored then).
    """
    checkpoint = read_checkpoint(path, map_location=map_location)
    checkpoint.restore(model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler,
                       world_size=world_size, rng=restore_rng)  # fmt: skip
    return checkpoint.state, dict(checkpoint.metrics)

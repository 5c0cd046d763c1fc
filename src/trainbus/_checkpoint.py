"""Atomic checkpoints: model, optimizer, scheduler, grad scaler and train state in one file.

A checkpoint is written to a temporary file in the same folder, flushed and fsynced, then
renamed over its final name (``os.replace`` is atomic on POSIX and Windows), so a crash or a
SIGKILL mid-write never leaves a truncated ``.pt`` where a complete one is expected. The folder
is created on the first save, never before.
"""

from __future__ import annotations

import os
import random
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ._exceptions import ConfigError

__all__ = [
    "TrainState",
    "checkpoint_name",
    "latest_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
]

FORMAT_VERSION = 1


@dataclass(slots=True, kw_only=True)
class TrainState:
    """Where the loop is: enough to resume exactly."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    """Training batches of ``epoch`` already consumed (a mid-epoch save resumes after them)."""


def checkpoint_name(step: int, tag: str | None) -> str:
    """``step-00000042.pt`` or ``step-00000042-best.pt``."""
    return f"step-{step:08d}" + (f"-{tag}" if tag else "") + ".pt"


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    directory: Path,
    *,
    tag: str | None,
    state: TrainState,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any | None,
    scaler: Any | None,
    metrics: dict[str, float],
) -> Path:
    """Write a checkpoint atomically and return its path."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / checkpoint_name(state.step, tag)
    payload = {
        "format": FORMAT_VERSION,
        "state": asdict(state),
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "scaler": scaler.state_dict() if scaler is not None else None,
        "metrics": dict(metrics),
        "rng": _rng_state(),
    }
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        # mkstemp creates 0600; give the checkpoint the mode a plain open() would (umask).
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def latest_checkpoint(directory: Path) -> Path | None:
    """The checkpoint with the highest step in ``directory`` (None if there is none)."""
    if not directory.is_dir():
        return None
    found = sorted(directory.glob("step-*.pt"), key=lambda p: (p.name[5:13], p.stat().st_mtime))
    return found[-1] if found else None


def load_checkpoint(
    path: Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any | None,
    scaler: Any | None,
    map_location: torch.device | str = "cpu",
) -> tuple[TrainState, dict[str, float]]:
    """Restore everything saved by :func:`save_checkpoint`; return the train state and metrics.

    Raises:
        ConfigError: the file is missing or is not a trainbus checkpoint.
    """
    if not path.is_file():
        raise ConfigError.invalid("resume_from", str(path), "an existing checkpoint file")
    # weights_only=False: the payload holds RNG states and plain containers written by us.
    payload = torch.load(path, map_location=map_location, weights_only=False)
    if not isinstance(payload, dict) or payload.get("format") != FORMAT_VERSION:
        raise ConfigError.invalid("resume_from", str(path), "a checkpoint written by trainbus")
    model.load_state_dict(payload["model"])
    optimizer.load_state_dict(payload["optimizer"])
    if scheduler is not None and payload["scheduler"] is not None:
        scheduler.load_state_dict(payload["scheduler"])
    if scaler is not None and payload["scaler"] is not None:
        scaler.load_state_dict(payload["scaler"])
    _set_rng_state(payload["rng"])
    return TrainState(**payload["state"]), dict(payload["metrics"])

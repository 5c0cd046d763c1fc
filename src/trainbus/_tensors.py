"""Small tensor utilities for the loop: device moves and batch sizes, without device syncs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["batch_size", "move_to_device", "resolve_device"]


def resolve_device(device: str | torch.device) -> torch.device:
    """``"auto"`` picks CUDA, then Apple MPS, then the CPU; anything else goes to torch."""
    if isinstance(device, str) and device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        mps = getattr(torch.backends, "mps", None)
        if mps is not None and mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    return torch.device(device)


def move_to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor in a (nested) batch to ``device``.

    Copies to CUDA are ``non_blocking``: with a pinned-memory loader the copy overlaps with
    compute instead of stalling the training thread. On the same device this is a no-op.
    """
    if isinstance(batch, torch.Tensor):
        if batch.device == device:
            return batch
        return batch.to(device, non_blocking=device.type == "cuda")
    if isinstance(batch, tuple | list):
        moved = [move_to_device(b, device) for b in batch]
        return type(batch)(moved) if not hasattr(batch, "_fields") else type(batch)(*moved)
    if isinstance(batch, Mapping):
        return {k: move_to_device(v, device) for k, v in batch.items()}
    return batch


def batch_size(batch: Any) -> int:
    """Samples in a batch: the leading dimension of its first tensor (1 if there is none)."""
    if type(batch) is tuple and batch and type(batch[0]) is torch.Tensor and batch[0].dim():
        return int(batch[0].shape[0])  # the (inputs, targets) case, without the walk
    while True:
        if isinstance(batch, torch.Tensor):
            return int(batch.shape[0]) if batch.dim() else 1
        if isinstance(batch, tuple | list) and batch:
            batch = batch[0]
        elif isinstance(batch, Mapping) and batch:
            batch = next(iter(batch.values()))
        else:
            return 1

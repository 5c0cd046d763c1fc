"""A one-time hint when a CUDA run's ``DataLoader`` does not pin its batches.

Host-to-GPU copies of pageable memory go through a staging buffer and block the training
thread; from pinned memory (``DataLoader(pin_memory=True)``) they are asynchronous
(``non_blocking=True``, which the loop uses) and overlap with the step. The hint is a structlog
warning (``pin_memory_hint``), logged once per process, at the start of the first such run.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader

from .._log import get_logger

__all__ = ["hint_pin_memory"]

log = get_logger(__name__)

_hinted = False
"""The hint was logged in this process (it is not repeated for every run)."""


def hint_pin_memory(data: Any, device: torch.device) -> bool:
    """Log ``pin_memory_hint`` once per process when ``device`` is CUDA and ``data`` is a
    ``DataLoader`` with ``pin_memory=False``. Reads no device state.

    Args:
        data: The training data.
        device: The run's device.

    Returns:
        True when the hint was logged by this call.
    """
    global _hinted
    if _hinted or device.type != "cuda" or not isinstance(data, DataLoader) or data.pin_memory:
        return False
    _hinted = True
    log.warning(
        "pin_memory_hint",
        device=str(device),
        reason="DataLoader(pin_memory=False) on a CUDA run: each batch's copy to the GPU "
        "blocks the training thread; DataLoader(..., pin_memory=True) lets it overlap the step",
    )
    return True

"""Random number generator states as tensors and plain containers (``weights_only=True`` safe):
Python's and NumPy's states become an int64 tensor plus plain numbers, and back on restore.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from .._log import get_logger

__all__ = ["capture_rng", "isolated_rng", "restore_rng"]

log = get_logger(__name__)


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:  # NumPy is optional: no NumPy, no NumPy state to keep
        return None
    return numpy


def capture_rng() -> dict[str, Any]:
    """The state of every random number generator a training step may draw from.

    Returns:
        ``{"python": ..., "torch": ..., "cuda": [...], "numpy": ...}`` (``cuda`` and ``numpy``
        when available) of tensors and plain containers, loadable with ``weights_only=True``.
    """
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "python": {
            "version": int(version),
            "internal": torch.tensor(internal, dtype=torch.int64),
            "gauss": gauss,
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    np = _numpy()
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        state["numpy"] = {
            "kind": str(kind),
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Set every generator from a :func:`capture_rng` result (CUDA's only when available, GPU
    ``i``'s to GPU ``i``; NumPy's only when installed).

    Args:
        state: What :func:`capture_rng` returned (possibly after a save/load round trip).

    Raises:
        KeyError, TypeError, ValueError: ``state`` is malformed.
    """
    py = state["python"]
    internal = tuple(int(x) for x in py["internal"].tolist())
    gauss = py["gauss"]
    random.setstate((int(py["version"]), internal, None if gauss is None else float(gauss)))
    torch.set_rng_state(state["torch"].cpu())  # a no-op for a checkpoint loaded to the host
    if "cuda" in state and torch.cuda.is_available():
        _restore_cuda(list(state["cuda"]))
    np = _numpy()
    if "numpy" in state and np is not None:
        n = state["numpy"]
        keys = n["keys"].numpy().astype(np.uint32)
        np.random.set_state(
            (n["kind"], keys, int(n["pos"]), int(n["has_gauss"]), float(n["cached_gaussian"]))
        )


def _restore_cuda(states: list[torch.Tensor]) -> None:
    """Set each existing CUDA device's generator from its saved state."""
    count = torch.cuda.device_count()
    if len(states) != count:
        log.warning(
            "rng_cuda_devices_differ",
            saved_devices=len(states),
            devices=count,
            restored=min(len(states), count),
            reason="the checkpoint was written where another number of GPUs was visible; "
            "each GPU seen by both is restored, the others keep their state",
        )
    for index, saved in enumerate(states[:count]):
        torch.cuda.set_rng_state(saved.cpu(), index)


@contextmanager
def isolated_rng(device: torch.device) -> Iterator[None]:
    """Run a block (an evaluation) whose random draws leave the training's generators (Python,
    torch's CPU one, NumPy's, ``device``'s CUDA one) where they were, so a run with evaluations
    trains as the same run without."""
    py = random.getstate()
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    np = _numpy()
    npstate = np.random.get_state(legacy=False) if np is not None else None
    try:
        yield
    finally:
        random.setstate(py)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)
        if np is not None:
            np.random.set_state(npstate)

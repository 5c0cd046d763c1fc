"""Random number generator states as tensors and plain containers (``weights_only=True`` safe).

Python's ``random`` state is a tuple of 625 ints, NumPy's a tuple holding an ``ndarray``: neither
is something ``torch.load(weights_only=True)`` may build, so both are converted to an int64
tensor plus plain numbers here, and back on restore.
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
        ``{"python": ..., "torch": ..., "cuda": [...], "numpy": ...}``: ``cuda`` only when CUDA
        is available, ``numpy`` only when NumPy is installed; every value is a tensor or a plain
        container, so the result can be saved and loaded with ``weights_only=True``.
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
    """Set every generator from a :func:`capture_rng` result.

    A saved CUDA state is restored only when CUDA is available (a GPU run resumed on a CPU keeps
    going, its CUDA draws are simply not reproduced), and only for the devices that exist: GPU
    ``i``'s saved state goes to GPU ``i`` for each GPU both the saving and this process see; a
    checkpoint from a host that saw more (or fewer) GPUs logs ``rng_cuda_devices_differ``
    naming both counts. A saved NumPy state is restored only when NumPy is installed.

    Args:
        state: What :func:`capture_rng` returned (possibly after a save/load round trip).

    Raises:
        KeyError, TypeError, ValueError: ``state`` is malformed (the loader checks its shape
            first and reports a ``CheckpointError``).
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
    """Set each CUDA device's generator from its saved state, for the devices that exist.

    The states are CPU byte tensors (checkpoints load to the host), the form
    ``torch.cuda.set_rng_state`` takes.
    """
    count = torch.cuda.device_count()
    if len(states) != count:
        log.warning(
            "rng_cuda_devices_differ", saved_devices=len(states), devices=count,
            restored=min(len(states), count),
            reason="the checkpoint was written where another number of GPUs was visible; "
            "each GPU seen by both is restored, the others keep their state",
        )  # fmt: skip
    for index, saved in enumerate(states[:count]):
        torch.cuda.set_rng_state(saved.cpu(), index)


@contextmanager
def isolated_rng(device: torch.device) -> Iterator[None]:
    """Run a block whose random draws leave the training's generators where they were.

    An evaluation draws from the global generators (a ``DataLoader`` draws its iterator's base
    seed from torch's CPU generator, shuffled or not; a metric or a model in eval mode may
    draw too). Saved before and set back after, those draws never shift the training's
    stream: a run with evaluations trains as the same run without, and a resumed run that
    does not repeat an evaluation the interrupted one ran before its checkpoint still draws
    what it would have. Python's ``random``, torch's CPU generator, NumPy's global state
    (when installed) and, on CUDA, the run's device's generator are kept.

    Cost, measured on a 2-core CPU host: about 0.35 ms per round, most of it NumPy's state
    (torch's CPU state, a 5 KB copy, about 1 µs; Python's 625 ints about 50 µs); a CUDA
    device's generator state is its seed and offset, kept on the host: reading and setting it
    launches no kernel and waits for no stream. Paid once per evaluation round, never per
    step.

    Args:
        device: The run's device (its CUDA generator is kept when it is a CUDA device).

    Yields:
        Nothing: the block runs with the generators as they were, and they are set back after.
    """
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

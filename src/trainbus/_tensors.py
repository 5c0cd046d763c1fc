"""The run's device, device moves and batch sizes, without device syncs."""

from __future__ import annotations

import copy
import dataclasses
import sys
from collections.abc import Mapping
from typing import Any

import torch

from ._exceptions import ConfigError

__all__ = [
    "batch_size",
    "bf16_supported",
    "is_dtensor",
    "is_sharded_model",
    "local_part",
    "move_to_device",
    "plain_value",
    "resolve_device",
    "use_device",
]

_DEVICE_FORMS = "'auto', 'cpu', 'cuda', 'cuda:N', 'mps' or a torch.device"


def _cuda_devices(count: int) -> str:
    """What exists, for an error message: ``"cuda:0, cuda:1 (2 CUDA devices)"``."""
    if count == 0:
        return "no CUDA device"
    names = ", ".join(f"cuda:{i}" for i in range(count))
    return f"{names} ({count} CUDA device{'s' if count != 1 else ''})"


def resolve_device(device: str | torch.device) -> torch.device:
    """The run's device: ``"auto"`` picks CUDA, MPS, then the CPU; a CUDA device gets the
    calling thread's current index, so every thread can make it current (:func:`use_device`).
    ``ConfigError`` for a device torch does not know or this process does not see."""
    if isinstance(device, str) and device == "auto":
        if torch.cuda.is_available():
            resolved = torch.device("cuda")
        else:
            mps = getattr(torch.backends, "mps", None)
            if mps is not None and mps.is_available():
                return torch.device("mps")
            return torch.device("cpu")
    else:
        try:
            resolved = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ConfigError.invalid("device", device, _DEVICE_FORMS) from exc
    if resolved.type != "cuda":
        return resolved
    if not torch.cuda.is_available():
        raise ConfigError.invalid(
            "device",
            str(device),
            "'auto' or 'cpu': CUDA is not available here "
            "(torch.cuda.is_available() is False; no CUDA device or a CPU-only torch)",
        )
    count = torch.cuda.device_count()
    index = resolved.index
    if index is None:
        # Before CUDA starts nobody can have made another device current: 0, without starting
        # CUDA here (a process that forks after building its Trainer stays fork-safe).
        index = torch.cuda.current_device() if torch.cuda.is_initialized() else 0
    if index >= count:
        raise ConfigError.invalid(
            "device",
            str(device),
            f"a device this process sees: {_cuda_devices(count)}, "
            "or 'auto' (CUDA_VISIBLE_DEVICES limits which GPUs a process sees)",
        )
    return torch.device("cuda", index)


def bf16_supported(device: torch.device) -> bool:
    """Whether the resolved ``device`` computes in bfloat16 natively: not NVIDIA GPUs before
    Ampere (8.0), which emulate it slower than fp32."""
    if device.type != "cuda":
        return True
    if torch.version.hip:
        return True
    return bool(torch.cuda.get_device_properties(device).major >= 8)


def use_device(device: torch.device) -> None:
    """Make ``device`` the calling thread's current CUDA device (per thread, 0 on a new one):
    every thread doing the run's torch work calls this first; nothing off CUDA."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def move_to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor of a (nested) batch to ``device``: tuples, lists and mappings walked,
    an object with ``.to()`` moved by it, a dataclass copied with its fields moved; copies to
    CUDA ``non_blocking`` (docs/trainer.md, "On a GPU")."""
    if isinstance(batch, torch.Tensor):
        if batch.device == device:
            return batch
        return batch.to(device, non_blocking=device.type == "cuda")
    if isinstance(batch, tuple | list):
        moved = [move_to_device(b, device) for b in batch]
        return type(batch)(moved) if not hasattr(batch, "_fields") else type(batch)(*moved)
    if isinstance(batch, Mapping):
        return {k: move_to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, type | str | bytes):
        return batch
    to = getattr(batch, "to", None)
    if callable(to):
        return to(device)  # its own move: it knows its fields (and returns the moved batch)
    if dataclasses.is_dataclass(batch):
        return _move_dataclass(batch, device)
    return batch


def _move_dataclass(batch: Any, device: torch.device) -> Any:
    """A shallow copy of a dataclass instance with every field moved (``__post_init__`` not run
    again)."""
    names = [f.name for f in dataclasses.fields(batch)]
    old = {name: getattr(batch, name) for name in names}
    new = {name: move_to_device(value, device) for name, value in old.items()}
    if all(new[name] is old[name] for name in names):
        return batch
    moved = copy.copy(batch)
    for name, value in new.items():
        object.__setattr__(moved, name, value)
    return moved


def batch_size(batch: Any) -> int:
    """Samples in a batch: the leading dimension of its first tensor (1 if there is none)."""
    if type(batch) is tuple and batch and type(batch[0]) is torch.Tensor:  # (inputs, targets)
        try:
            return batch[0].size(0)  # one call, where dim() then shape[0] are two
        except IndexError:
            return 1  # a 0-d tensor
    while True:
        if isinstance(batch, torch.Tensor):
            return int(batch.shape[0]) if batch.dim() else 1
        if isinstance(batch, tuple | list) and batch:
            batch = batch[0]
        elif isinstance(batch, Mapping) and batch:
            batch = next(iter(batch.values()))
        else:
            return 1


def is_dtensor(value: object) -> bool:
    """Whether ``value`` is a ``torch.distributed.tensor.DTensor`` (an FSDP2 parameter, its
    gradient, or a norm computed over them)."""
    # Only a process that built a DTensor has imported the module: no import cost for others.
    cls = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    return cls is not None and isinstance(value, cls)


def is_sharded_model(model: torch.nn.Module) -> bool:
    """Whether ``model`` is sharded with FSDP2 (``fully_shard``): it or a submodule is an
    ``FSDPModule``, or a parameter is a DTensor."""
    module_cls = getattr(sys.modules.get("torch.distributed.fsdp"), "FSDPModule", None)
    if module_cls is not None and any(isinstance(m, module_cls) for m in model.modules()):
        return True
    return any(is_dtensor(p) for p in model.parameters())


def plain_value(value: torch.Tensor) -> torch.Tensor:
    """The whole value of a DTensor as a plain tensor (``full_tensor()``: no communication when
    it is replicated, as a clipped norm is; a collective otherwise, so every rank must call
    it); any other tensor as it is."""
    return value.full_tensor() if is_dtensor(value) else value  # type: ignore[attr-defined]


def local_part(value: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor as a plain tensor (``to_local()``); any other tensor as
    it is. Reads nothing from the other ranks."""
    return value.to_local() if is_dtensor(value) else value  # type: ignore[attr-defined]

"""Sharded (FSDP2) models under trainbus: what the run checks before any step.

A model sharded with ``torch.distributed.fsdp.fully_shard`` holds DTensor parameters and
reduces its own gradients: it is never wrapped in ``DistributedDataParallel`` (which cannot
flatten unevenly sharded tensors, and has no broadcast rule for DTensors). Its device mesh must
span the whole process group, since the run's collectives (command agreement, metrics, the
checkpoint's agreement) run over every rank.
"""

from __future__ import annotations

import torch

from .._exceptions import ConfigError
from .._tensors import is_dtensor, is_sharded_model

__all__ = ["check_ddp", "check_mesh"]


def check_ddp(ddp: object, model: torch.nn.Module) -> bool:
    """Whether the run wraps ``model`` in DDP, from ``Trainer(ddp=...)`` (None: unless it is
    sharded); ``ConfigError`` for another value, or True for a sharded model."""
    if ddp is not None and not isinstance(ddp, bool):
        raise ConfigError.invalid("ddp", ddp, "None (DDP unless the model is sharded with "
                                  "fully_shard), True or False")  # fmt: skip
    sharded = is_sharded_model(model)
    if ddp is True and sharded:
        raise ConfigError.invalid(
            "ddp", True, "None (the default) or False for a model sharded with fully_shard: "
            "FSDP2 reduces its own gradients, and DistributedDataParallel cannot wrap its "
            "DTensor parameters",
        )  # fmt: skip
    return not sharded if ddp is None else ddp


def check_mesh(model: torch.nn.Module, world_size: int) -> None:
    """``ConfigError`` naming both sizes when a sharded model's device mesh does not span the
    ``world_size`` ranks."""
    for name, param in model.named_parameters():
        if not is_dtensor(param):
            continue
        size = int(param.device_mesh.size())  # type: ignore[attr-defined]
        if size != world_size:
            raise ConfigError.invalid(
                "model", f"parameter {name!r} sharded over a device mesh of {size} rank(s)",
                f"a mesh over all {world_size} ranks of the process group "
                f"(init_device_mesh(device_type, ({world_size},)) or fully_shard's default)",
            )  # fmt: skip

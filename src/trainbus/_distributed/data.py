"""The model and the data under ``torchrun``: DDP wrapping, the checks of a sharded (FSDP2)
model, per-rank shards, a loader rebuilt around another sampler (a shard, a seeded order);
docs/distributed.md, "What runs where" and FSDP2."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler, Sampler

from .._exceptions import ConfigError
from .._log import get_logger
from .._tensors import is_dtensor, is_sharded_model
from .group import ProcessGroup

__all__ = [
    "check_ddp",
    "check_mesh",
    "release_model",
    "shard_loader",
    "unwrap_model",
    "with_sampler",
    "wrap_model",
]

_GROUP_HOLDERS = ("logger", "reducer", "process_group")

log = get_logger(__name__)


def with_sampler(data: DataLoader[Any], sampler: Sampler[Any]) -> DataLoader[Any]:
    """A new loader like ``data`` (map-style, with a ``batch_size``) drawing indices from
    ``sampler``; ``data`` is left as it is."""
    workers = data.num_workers > 0
    return DataLoader(
        data.dataset,
        batch_size=data.batch_size,
        sampler=sampler,
        num_workers=data.num_workers,
        collate_fn=data.collate_fn,
        pin_memory=data.pin_memory,
        drop_last=data.drop_last,
        timeout=data.timeout,
        worker_init_fn=data.worker_init_fn,
        multiprocessing_context=data.multiprocessing_context if workers else None,
        generator=data.generator,
        prefetch_factor=data.prefetch_factor if workers else None,
        persistent_workers=data.persistent_workers if workers else False,
        pin_memory_device=data.pin_memory_device,
        in_order=data.in_order,
    )


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The module a ``DistributedDataParallel`` wraps (the model itself otherwise)."""
    if isinstance(model, DistributedDataParallel):
        inner: torch.nn.Module = model.module
        return inner
    return model


def wrap_model(model: torch.nn.Module, group: ProcessGroup) -> torch.nn.Module:
    """``DistributedDataParallel(model)`` on the group's device, or ``model`` when it is
    already wrapped or the group is a single process."""
    if not group.distributed or isinstance(model, DistributedDataParallel):
        return model
    device_ids = [group.device] if group.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids)


def check_ddp(ddp: object, model: torch.nn.Module) -> bool:
    """Whether the run wraps ``model`` in DDP, from ``Trainer(ddp=...)`` (None: unless it is
    sharded); ``ConfigError`` for another value, or True for a sharded model."""
    if ddp is not None and not isinstance(ddp, bool):
        raise ConfigError.invalid(
            "ddp", ddp, "None (DDP unless the model is sharded with fully_shard), True or False"
        )
    sharded = is_sharded_model(model)
    if ddp is True and sharded:
        raise ConfigError.invalid(
            "ddp",
            True,
            "None (the default) or False for a model sharded with fully_shard: "
            "FSDP2 reduces its own gradients, and DistributedDataParallel cannot wrap its "
            "DTensor parameters",
        )
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
                "model",
                f"parameter {name!r} sharded over a device mesh of {size} rank(s)",
                f"a mesh over all {world_size} ranks of the process group "
                f"(init_device_mesh(device_type, ({world_size},)) or fully_shard's default)",
            )


def release_model(model: torch.nn.Module) -> None:
    """After the ranks' last barrier, drop what a ``DistributedDataParallel`` holds of the
    process group (left to interpreter exit, gloo's threads can abort the process); the
    wrapper cannot train afterwards, ``model.module`` is untouched."""
    if not isinstance(model, DistributedDataParallel):
        return
    for name in _GROUP_HOLDERS:
        if name in model.__dict__:
            del model.__dict__[name]


def shard_loader(data: Iterable[Any], group: ProcessGroup, *, seed: int, train: bool) -> Any:
    """This rank's shard of ``data`` (training data keeps its shuffling, evaluation data is
    never shuffled; ``seed`` is the same on every rank)."""
    if not group.distributed:
        return data
    module = type(data).__module__  # not importing Ray
    if module == "ray.data" or module.startswith("ray.data."):
        return data  # ray.train.get_dataset_shard(...): each rank's own rows already
    if not isinstance(data, DataLoader) or isinstance(data.dataset, IterableDataset):
        log.warning(
            "data_not_sharded",
            kind=type(data).__name__,
            rank=group.rank,
            reason="only a map-style DataLoader can be sharded; every rank reads all of it",
        )
        return data
    if isinstance(data.sampler, DistributedSampler):
        return data
    if data.batch_size is None:
        log.warning(
            "data_not_sharded",
            kind="DataLoader(batch_sampler=...)",
            rank=group.rank,
            reason="a custom batch sampler cannot be rebuilt per rank",
        )
        return data
    shuffle = train and isinstance(data.sampler, RandomSampler)
    sampler: DistributedSampler[Any] = DistributedSampler(
        data.dataset,
        num_replicas=group.world_size,
        rank=group.rank,
        shuffle=shuffle,
        seed=seed,
        drop_last=False,
    )
    return with_sampler(data, sampler)

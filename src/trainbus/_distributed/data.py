"""The model and the data under ``torchrun``: DDP wrapping (:func:`wrap_model`; checkpoints
save :func:`unwrap_model`'s module, the same with or without DDP) and per-rank shards
(:func:`shard_loader`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler

from .._loaders import with_sampler
from .._log import get_logger
from .group import ProcessGroup

__all__ = ["is_ray_data_shard", "release_model", "shard_loader", "unwrap_model", "wrap_model"]

# What a DistributedDataParallel holds that keeps the process group (and gloo's threads) alive.
_GROUP_HOLDERS = ("logger", "reducer", "process_group")

log = get_logger(__name__)


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The module a ``DistributedDataParallel`` wraps (the model itself otherwise)."""
    if isinstance(model, DistributedDataParallel):
        inner: torch.nn.Module = model.module
        return inner
    return model


def wrap_model(model: torch.nn.Module, group: ProcessGroup) -> torch.nn.Module:
    """``DistributedDataParallel(model)`` on the group's device, or ``model`` when it is
    already wrapped or the group is a single process.

    Args:
        model: The model, already on ``group.device``.
        group: The process group.

    Returns:
        The module the loop trains.
    """
    if not group.distributed or isinstance(model, DistributedDataParallel):
        return model
    device_ids = [group.device] if group.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids)


def release_model(model: torch.nn.Module) -> None:
    """Let go of the process group a ``DistributedDataParallel`` made by :func:`wrap_model`
    holds (its reducer, logger and group), after the ranks' last barrier: left to interpreter
    exit, gloo's threads can abort the finished process (SIGABRT). The wrapper cannot train
    afterwards; ``model.module`` is untouched.

    Args:
        model: The module :func:`wrap_model` returned (anything else is left alone).
    """
    if not isinstance(model, DistributedDataParallel):
        return
    for name in _GROUP_HOLDERS:
        if name in model.__dict__:
            del model.__dict__[name]


def is_ray_data_shard(data: object) -> bool:
    """Whether ``data`` is a Ray Data iterable (a ``DataIterator`` from
    ``ray.train.get_dataset_shard(name)``, or what its ``iter_torch_batches()`` /
    ``iter_batches()`` return): Ray Data already gives each worker its own shard. Told by the
    type's module (``ray.data...``), so Ray is never imported here."""
    module = type(data).__module__
    return module == "ray.data" or module.startswith("ray.data.")


def shard_loader(data: Iterable[Any], group: ProcessGroup, *, seed: int, train: bool) -> Any:
    """Each rank's shard of ``data``.

    A map-style ``DataLoader`` is rebuilt around a seeded ``DistributedSampler`` (shuffling when
    its sampler was a ``RandomSampler`` and ``train``); an iterable, a list of batches or a custom
    batch sampler is returned unchanged with a ``data_not_sharded`` warning (every rank reads all
    of it); a Ray Data shard is returned unchanged (it is this rank's part already).

    Args:
        data: The training or evaluation data.
        group: The process group.
        seed: The sampler's seed (the same on every rank, so the shards partition the data).
        train: Training data (shuffling kept) or evaluation data (never shuffled).

    Returns:
        The data this rank iterates.
    """
    if not group.distributed:
        return data
    if is_ray_data_shard(data):
        return data  # ray.train.get_dataset_shard(...): each rank's own rows already
    if not isinstance(data, DataLoader) or isinstance(data.dataset, IterableDataset):
        log.warning("data_not_sharded", kind=type(data).__name__, rank=group.rank,
                    reason="only a map-style DataLoader can be sharded; every rank reads all "
                    "of it")  # fmt: skip
        return data
    if isinstance(data.sampler, DistributedSampler):
        return data
    if data.batch_size is None:
        log.warning("data_not_sharded", kind="DataLoader(batch_sampler=...)", rank=group.rank,
                    reason="a custom batch sampler cannot be rebuilt per rank")  # fmt: skip
        return data
    shuffle = train and isinstance(data.sampler, RandomSampler)
    sampler: DistributedSampler[Any] = DistributedSampler(
        data.dataset, num_replicas=group.world_size, rank=group.rank, shuffle=shuffle,
        seed=seed, drop_last=False,
    )  # fmt: skip
    return with_sampler(data, sampler)

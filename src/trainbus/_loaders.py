"""A DataLoader rebuilt around another sampler, every other option kept: a shard per rank
under torchrun and a seeded data order both hand a run such a copy of the user's loader."""

from __future__ import annotations

from typing import Any

from torch.utils.data import DataLoader, Sampler

__all__ = ["with_sampler"]


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

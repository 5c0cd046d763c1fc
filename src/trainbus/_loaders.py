"""A DataLoader rebuilt around another sampler, every other option kept.

Two places hand a run a loader of their own in place of the user's (who keeps theirs as it is):
a shard per rank under torchrun (:func:`trainbus._distributed.data.shard_loader`) and a seeded data
order (:func:`trainbus._seeding.seeded_run`). Both need the same copy of the loader's options.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import DataLoader, Sampler

__all__ = ["with_sampler"]


def with_sampler(data: DataLoader[Any], sampler: Sampler[Any]) -> DataLoader[Any]:
    """A loader like ``data`` drawing indices from ``sampler``.

    Args:
        data: A map-style loader with a ``batch_size`` (not a ``batch_sampler``).
        sampler: The sampler to draw from.

    Returns:
        A new loader; ``data`` is left as it is.
    """
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

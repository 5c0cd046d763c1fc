"""The data order: the generator state captured before ``iter(loader)`` that draws an epoch's
permutation again after a resume (docs/reliability.md tables which kinds resume exactly)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import (
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from .._exceptions import CheckpointError
from .._log import get_logger
from ._rng import restore_rng

__all__ = ["EpochSampler", "capture_data_order", "replay_epoch", "set_sampler_epoch"]

log = get_logger(__name__)

EXACT_KINDS = frozenset({"generator", "sampler", "global", "sequential", "sequence", "distributed"})


def _kind(data: Iterable[Any]) -> tuple[str, torch.Generator | None]:
    """The kind of ``data`` and the generator its order comes from (None: global or none)."""
    if isinstance(data, DataLoader):
        if isinstance(data.dataset, IterableDataset):
            return "iterable", None
        if data.generator is not None:
            return "generator", data.generator
        sampler = data.sampler
        if isinstance(sampler, DistributedSampler):
            return "distributed", None  # its order is (seed, epoch): no generator state
        if isinstance(sampler, RandomSampler) and sampler.generator is not None:
            return "sampler", sampler.generator
        if isinstance(sampler, SequentialSampler) and data.batch_sampler is not None:
            return "sequential", None
        return "global", None
    if isinstance(data, Sequence):
        return "sequence", None
    return "iterable", None


class EpochSampler(RandomSampler):
    """A shuffling sampler whose order is a function of ``(seed, epoch)`` only, so an epoch's
    order survives a resume: what ``Trainer(seed=)`` puts in place of ``shuffle=True``'s.

    Args:
        data_source: The dataset.
        seed: The run's seed.
    """

    def __init__(self, data_source: Any, seed: int) -> None:
        super().__init__(data_source)
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose order the next ``iter()`` draws."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        # Python's hash of a tuple of ints is the same in every process (no hash seed).
        gen = torch.Generator().manual_seed(hash((self.seed, self.epoch)) & (2**63 - 1))
        yield from torch.randperm(len(self.data_source), generator=gen).tolist()


def capture_data_order(data: Iterable[Any], *, epoch: int) -> dict[str, Any]:
    """The state that reproduces ``epoch``'s batch order; call it right BEFORE ``iter(data)``.

    Args:
        data: The training data (a ``DataLoader``, a sequence of batches or another iterable).
        epoch: The epoch about to start; :func:`replay_epoch` replays only this epoch.

    Returns:
        ``{"kind", "epoch", "exact", "state"}`` of plain values and tensors (``state`` is the
        generator's state, or None when the order has no randomness or cannot be replayed).
    """
    kind, generator = _kind(data)
    state: torch.Tensor | None = None
    if generator is not None:
        state = generator.get_state()
    elif kind == "global":
        state = torch.get_rng_state()
    order: dict[str, Any] = {
        "kind": kind,
        "epoch": int(epoch),
        "exact": kind in EXACT_KINDS,
        "state": state,
    }
    if kind == "distributed":
        sampler = data.sampler  # type: ignore[attr-defined]
        order["sampler"] = {
            "seed": int(sampler.seed),
            "num_replicas": int(sampler.num_replicas),
            "shuffle": bool(sampler.shuffle),
        }
    return order


def set_sampler_epoch(data: Iterable[Any], epoch: int) -> None:
    """``sampler.set_epoch(epoch)`` when ``data`` is a ``DataLoader`` over a
    ``DistributedSampler`` or an :class:`EpochSampler`; nothing otherwise. Call it before
    ``iter(data)``.
    """
    if isinstance(data, DataLoader) and isinstance(data.sampler, DistributedSampler | EpochSampler):
        data.sampler.set_epoch(epoch)


def replay_epoch(
    data: Iterable[Any],
    order: dict[str, Any] | None,
    *,
    epoch: int,
    skip: int,
    rng: dict[str, Any] | None = None,
) -> tuple[Iterator[Any], dict[str, Any]]:
    """An iterator over ``epoch`` of ``data`` after its first ``skip`` batches, with the random
    generators in the state ``rng`` holds, as if the run had never stopped.

    Args:
        data: The training data, built as in the interrupted run.
        order: What :func:`capture_data_order` returned at the start of the saved epoch (used
            only when captured for ``epoch``).
        epoch: The epoch being resumed (``TrainState.epoch``).
        skip: Batches of it already consumed (``TrainState.batch_in_epoch``).
        rng: The checkpoint's RNG states (:func:`~trainbus.checkpoint.capture_rng`); None leaves
            the generators alone.

    Returns:
        ``(iterator, order)``: the iterator, whose next batch is batch ``skip``, and the data
        order in effect for this epoch, to save with the epoch's later checkpoints.

    Raises:
        CheckpointError: ``order`` was captured from a different kind of loader.
    """
    if order is not None and int(order.get("epoch", -1)) != epoch:
        order = None
    kind, generator = _kind(data)
    if order is not None and order.get("kind") != kind:
        raise CheckpointError(
            f"the data order was saved for a {order.get('kind')!r} loader but the training "
            f"data now is a {kind!r} one; build the loader as in the saved run, or resume "
            "without the data order"
        )
    if skip == 0 and rng is not None:
        restore_rng(rng)
    if order is None:
        order = capture_data_order(data, epoch=epoch)
    else:
        if not order.get("exact", False):
            log.warning(
                "data_order_inexact",
                kind=kind,
                epoch=epoch,
                batch_in_epoch=skip,
                reason="an iterable cannot be rewound; the consumed batches are skipped",
            )
        state = order.get("state")
        # Generator states are CPU byte tensors, whatever device the generator draws for.
        if generator is not None and state is not None:
            generator.set_state(state.cpu())
        elif kind == "global" and state is not None:
            torch.set_rng_state(state.cpu())
    it = iter(data)
    for _ in range(skip):
        if next(it, _END) is _END:
            break
    if skip > 0 and rng is not None:
        # The skipped batches drew from the generators as in the saved run (a lazy sampler seed,
        # random transforms); the saved states are the ones after them.
        restore_rng(rng)
    return it, order


_END = object()

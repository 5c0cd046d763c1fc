"""Seeds: make two runs equal, and keep one run's randomness its own (docs/trainer.md,
"Seeds")."""

from __future__ import annotations

import dataclasses
import random

import torch
from torch.utils.data import DataLoader, IterableDataset, RandomSampler

from ._distributed.data import with_sampler
from ._loop import Settings
from ._validate import check_int
from .checkpoint import EpochSampler

__all__ = ["seed_everything", "seeded_run"]


def seed_everything(seed: int) -> None:
    """Seed Python's ``random``, NumPy's global generator (if NumPy is installed) and torch's
    generators (CPU and every GPU) with ``seed``; call it before building the model. See
    docs/trainer.md, "Seeds".

    Args:
        seed: An int >= 0 (NumPy takes it modulo 2**32).

    Raises:
        ConfigError: ``seed`` is not an int >= 0.
    """
    check_int("seed", seed, 0)
    random.seed(seed)
    try:
        import numpy as np
    except ImportError:  # NumPy is optional
        pass
    else:
        np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # CPU and every CUDA device (torch seeds them all)


def seeded_run(s: Settings) -> Settings:
    """The settings a run with ``s.seed`` trains with (``s`` itself without a seed): the
    generators seeded, a ``DataLoader(shuffle=True)`` without a ``generator`` rebuilt around an
    :class:`~trainbus.checkpoint.EpochSampler` (the user's loader is left as it is)."""
    if s.seed is None:
        return s
    seed_everything(s.seed)
    data = s.train_data
    if not _shuffles_globally(data):
        return s
    assert isinstance(data, DataLoader)
    loader = with_sampler(data, EpochSampler(data.dataset, s.seed))
    return dataclasses.replace(s, train_data=loader)


def _shuffles_globally(data: object) -> bool:
    """A map-style ``DataLoader(shuffle=True)`` whose order comes from the global generator
    (no ``generator`` of its own or its sampler's), with an ordinary batch size."""
    return (
        isinstance(data, DataLoader)
        and not isinstance(data.dataset, IterableDataset)
        and data.generator is None
        and type(data.sampler) is RandomSampler
        and data.sampler.generator is None
        and not data.sampler.replacement
        and data.sampler.num_samples == len(data.dataset)  # type: ignore[arg-type]
        and data.batch_size is not None
    )

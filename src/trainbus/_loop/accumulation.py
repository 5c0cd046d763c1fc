"""How the micro-batches of one optimizer step are weighed (``Accumulate(n, by=...)``).

``"batches"`` (the default) weighs each by ``1 / n``; ``"items"`` or a counting function by
``n_i / N``, its items over the step's (docs/trainer.md, "Gradient accumulation"). ``N`` is
needed before the first backward, so a step weighed by items fetches its batches first.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, TypeAlias

import torch

from .._exceptions import TrainingError
from .forward import metric_targets

__all__ = ["IGNORE_INDEX", "AccumulateBy", "ItemWeights", "count_items"]

AccumulateBy: TypeAlias = Literal["batches", "items"] | Callable[[Any], int]
"""``Accumulate.by``: ``"batches"``, ``"items"`` or ``fn(batch) -> items``."""

IGNORE_INDEX = -100
"""The label value that marks an item the loss ignores (PyTorch's and Hugging Face's)."""


def count_items(batch: Any) -> int:
    """The items of ``batch`` that a token-level loss counts: its labels ``!= -100`` (a mapping
    batch's ``"labels"`` or an ``(inputs, targets)`` batch's targets), read before the batch
    moves to the device.

    Raises:
        TrainingError: the batch has no labels tensor there (pass ``Accumulate(n, by=fn)``).
    """
    labels: Any = None
    if isinstance(batch, Mapping | tuple | list):
        try:
            labels = metric_targets(batch)
        except TrainingError:  # a mapping without "labels"
            labels = None
    if not isinstance(labels, torch.Tensor):
        raise TrainingError(
            'Accumulate(n, by="items") counts the labels != -100 of a mapping batch\'s "labels" or '
            "of the targets of an (inputs, targets) batch; this batch "
            f"({type(batch).__name__}) has no labels tensor there: pass Accumulate(n, by=fn), "
            "fn(batch) -> the number of items its loss averages over"
        )
    return int((labels != IGNORE_INDEX).sum())


class ItemWeights:
    """The weight of each micro-batch of a step weighed by items.

    Args:
        count: ``count(batch) -> items`` (:func:`count_items` for ``"items"``).
    """

    def __init__(self, count: Callable[[Any], int]) -> None:
        self._count = count

    def weights(self, batches: Sequence[Any]) -> list[float]:
        """``n_i / N`` for each of the step's ``batches`` (all 0 when the step holds no item).

        Raises:
            TrainingError: the count is not a non-negative int (naming the function), or
                :func:`count_items` found no labels.
        """
        counts = [self._checked(self._count(batch)) for batch in batches]
        total = sum(counts)
        return [n / total if total else 0.0 for n in counts]

    def _checked(self, n: Any) -> int:
        if isinstance(n, torch.Tensor) and n.numel() == 1 and not n.is_floating_point():
            n = int(n)
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            name = getattr(self._count, "__qualname__", repr(self._count))
            raise TrainingError(
                f"Accumulate(by={name}) returned {n!r} for a batch: it must return the number "
                "of items the batch's loss averages over, an int >= 0"
            )
        return n

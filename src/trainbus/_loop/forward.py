"""The forward: the model's outputs for a batch and their loss, for training (the
``after_forward`` hooks run between the two), evaluation and prediction. The batch conventions
are docs/trainer.md's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from .._exceptions import TrainingError

if TYPE_CHECKING:
    from .settings import Settings

__all__ = ["loss_of", "metric_targets", "model_outputs"]

_PAIR = (tuple, list)
"""The types of an ``(inputs, targets)`` batch (of two elements)."""


def metric_targets(batch: Any) -> Any:
    """What a metric function receives as ``targets`` for ``batch`` (docs/trainer.md); a
    mapping without ``"labels"`` is a ``TrainingError``."""
    if isinstance(batch, _PAIR) and len(batch) == 2:
        return batch[1]
    if isinstance(batch, Mapping):
        if "labels" not in batch:
            raise TrainingError(
                "metric functions get batch['labels'] for mapping batches, but this batch has "
                f"only the keys {sorted(map(str, batch))}: add a 'labels' entry"
            )
        return batch["labels"]
    return batch


def model_outputs(s: Settings, batch: Any, *, targets: bool = True) -> tuple[Any, Any]:
    """``(outputs, targets)`` for ``batch``; targets is None without ``loss_fn``. With
    ``targets=False`` (prediction) a batch that is not ``(inputs, targets)`` is the model's
    input as a whole instead of a ``TrainingError``."""
    model = s.model
    if s.loss_fn is not None:
        if isinstance(batch, _PAIR) and len(batch) == 2:
            return model(batch[0]), batch[1]
        if targets:
            raise TrainingError(
                f"with loss_fn, each batch must be (inputs, targets); got {type(batch).__name__}"
                + (f" of length {len(batch)}" if isinstance(batch, _PAIR) else "")
            )
    try:
        return (model(**batch) if isinstance(batch, Mapping) else model(batch)), None
    except TypeError as exc:
        if s.loss_fn is None and isinstance(batch, _PAIR):
            exc.add_note(
                f"trainbus: without loss_fn the model is called with the whole batch (a "
                f"{type(batch).__name__} of {len(batch)}); for (inputs, targets) batches pass "
                "loss_fn= (e.g. torch.nn.CrossEntropyLoss())"
            )
        raise


def loss_of(s: Settings, outputs: Any, targets: Any) -> Any:
    """``loss_fn(outputs, targets)``, or the loss the model returned (not yet checked to be a
    scalar that requires grad); ``TrainingError`` when the outputs carry none."""
    if s.loss_fn is not None:
        return s.loss_fn(outputs, targets)
    if isinstance(outputs, torch.Tensor):
        return outputs
    if isinstance(outputs, Mapping) and "loss" in outputs:
        return outputs["loss"]
    loss = getattr(outputs, "loss", None)
    if loss is not None:
        return loss
    raise TrainingError(
        f"the model returned {type(outputs).__name__} with no loss: without loss_fn the model "
        "must return the loss, a mapping with a 'loss' key, or an object with a .loss attribute"
    )

"""The one forward of training, evaluation and prediction (batch conventions: docs/trainer.md)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from .._exceptions import TrainingError

if TYPE_CHECKING:
    from .settings import Settings

__all__ = ["loss_of", "metric_targets", "model_outputs"]

_PAIR = (tuple, list)  # the types of an (inputs, targets) batch


def metric_targets(batch: Any) -> Any:
    """What a metric function receives as ``targets`` for ``batch``."""
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
    """``(outputs, targets)`` (targets None without ``loss_fn``); ``targets=False``: a batch
    that is not ``(inputs, targets)`` is the model's input as a whole (prediction)."""
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
    """``loss_fn(outputs, targets)``, or the loss the model returned (unchecked)."""
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

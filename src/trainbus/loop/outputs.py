"""Model outputs taken apart and put back together with the type users index.

A Hugging Face model returns a ``ModelOutput`` (a dataclass that is also an ordered mapping:
``out.logits`` and ``out["logits"]``), often with a scalar ``loss`` when the batch carries
labels; other models return tensors, tuples, named tuples or dicts. Detaching outputs, copying
them to the host and concatenating a prediction's batches all walk that structure: they rebuild
each container as its own type (a ``ModelOutput`` stays one, so ``.logits`` works on a streamed
``PredictionBatchEnded.outputs`` and on what ``predict(return_outputs=True)`` returns), and a
scalar per batch (the loss) is stacked into one value per batch instead of concatenated.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

__all__ = ["detach_outputs", "join_outputs", "map_tensors"]


def _mapping_like(template: Mapping[Any, Any], items: dict[Any, Any]) -> Any:
    """``items`` as ``template``'s type: a dataclass mapping (``ModelOutput``) by keyword, any
    other mapping type from the dict; a plain dict, or a type that cannot be rebuilt so, as
    the dict itself."""
    cls = type(template)
    if cls is dict:
        return items
    try:
        if dataclasses.is_dataclass(template):
            return cls(**items)
        return cls(items)  # type: ignore[call-arg]
    except (TypeError, ValueError):
        return items


def _sequence_like(template: Sequence[Any], items: list[Any]) -> Any:
    """``items`` as ``template``'s type (a named tuple by position)."""
    cls = type(template)
    if cls is list:
        return items
    if cls is tuple:
        return tuple(items)
    if isinstance(template, tuple) and hasattr(template, "_fields"):
        return cls(*items)
    try:
        return cls(items)  # type: ignore[call-arg]
    except (TypeError, ValueError):
        return items


def map_tensors(fn: Callable[[torch.Tensor], Any], outputs: Any) -> Any:
    """``outputs`` with ``fn`` applied to every tensor, through tuples, lists and mappings,
    each container rebuilt as its own type; anything else as is.

    Args:
        fn: Applied to each tensor.
        outputs: A model's outputs.

    Returns:
        The same structure with ``fn``'s results in place of the tensors.
    """
    if isinstance(outputs, torch.Tensor):
        return fn(outputs)
    if isinstance(outputs, tuple | list):
        return _sequence_like(outputs, [map_tensors(fn, o) for o in outputs])
    if isinstance(outputs, Mapping):
        return _mapping_like(outputs, {k: map_tensors(fn, v) for k, v in outputs.items()})
    return outputs


def detach_outputs(outputs: Any) -> Any:
    """``outputs`` with every tensor detached (kept on its device), through tuples, lists and
    mappings (each kept as its own type, a ``ModelOutput`` included); anything else as is."""
    return map_tensors(torch.Tensor.detach, outputs)


def join_outputs(batches: Sequence[Any]) -> Any:
    """Concatenate per-batch outputs along the first dimension.

    Tensors are concatenated, scalars (a batch's loss) stacked into one value per batch;
    tuples/lists and mappings of them are joined element by element, per key, and keep their
    type (a ``ModelOutput`` stays one); anything else comes back as the list of per-batch
    outputs. No batch gives ``[]``.

    Args:
        batches: One output per batch, in order.

    Returns:
        The joined outputs.
    """
    if not batches:
        return []
    first = batches[0]
    if isinstance(first, torch.Tensor):
        if all(isinstance(b, torch.Tensor) and b.dim() == 0 for b in batches):
            return torch.stack(list(batches))
        return torch.cat(list(batches))
    if isinstance(first, tuple | list) and all(
        isinstance(b, type(first)) and len(b) == len(first) for b in batches
    ):
        return _sequence_like(first, [join_outputs([b[i] for b in batches])
                                      for i in range(len(first))])  # fmt: skip
    if isinstance(first, Mapping) and all(
        isinstance(b, Mapping) and b.keys() == first.keys() for b in batches
    ):
        return _mapping_like(first, {k: join_outputs([b[k] for b in batches]) for k in first})
    return list(batches)

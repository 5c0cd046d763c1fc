"""A prediction's outputs: walked and rebuilt as their own types (a Hugging Face ``ModelOutput``
stays one), copied to the host, checked batch by batch and joined (``Trainer.predict``)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from .._exceptions import ConfigError, TrainingError

__all__ = [
    "KeptOutputs",
    "PadValue",
    "PadValues",
    "ignored_keys",
    "join_outputs",
    "map_tensors",
    "without_keys",
]

PadValue = bool | int | float

DEFAULT_PAD = -100  # of signed integer and floating tensors (Hugging Face's padding_index)


def _mapping_like(template: Mapping[Any, Any], items: dict[Any, Any]) -> Any:
    """``items`` as ``template``'s type (a dataclass by keyword), else the dict itself."""
    cls = type(template)
    try:
        if dataclasses.is_dataclass(template):
            return cls(**items)
        return cls(items)  # type: ignore[call-arg]
    except (TypeError, ValueError):
        return items


def _sequence_like(template: Sequence[Any], items: list[Any]) -> Any:
    """``items`` as ``template``'s type (a named tuple by position)."""
    cls = type(template)
    if isinstance(template, tuple) and hasattr(template, "_fields"):
        return cls(*items)
    try:
        return cls(items)  # type: ignore[call-arg]
    except (TypeError, ValueError):
        return items


def map_tensors(fn: Callable[[torch.Tensor], Any], outputs: Any) -> Any:
    """``outputs`` with ``fn`` applied to every tensor in its tuples, lists and mappings."""
    if isinstance(outputs, torch.Tensor):
        return fn(outputs)
    if isinstance(outputs, tuple | list):
        return _sequence_like(outputs, [map_tensors(fn, o) for o in outputs])
    if isinstance(outputs, Mapping):
        return _mapping_like(outputs, {k: map_tensors(fn, v) for k, v in outputs.items()})
    return outputs


def ignored_keys(model: Any, ignore_keys: Iterable[str] | None) -> frozenset[str]:
    """The output keys ``predict`` drops: ``ignore_keys`` as given; with None, as Hugging
    Face's ``predict`` decides (a ``config``'s ``keys_to_ignore_at_inference``, else
    ``["cache"]``; no ``config``: none)."""
    if ignore_keys is None:
        config = getattr(model, "config", None)
        keys = () if config is None else getattr(config, "keys_to_ignore_at_inference", ["cache"])
        return frozenset(k for k in keys or () if isinstance(k, str))
    if isinstance(ignore_keys, str) or not isinstance(ignore_keys, Iterable):
        raise ConfigError.invalid("ignore_keys", ignore_keys, "None or a list of output keys")
    keys = list(ignore_keys)
    if not all(isinstance(k, str) for k in keys):
        raise ConfigError.invalid("ignore_keys", keys, "None or a list of output keys (str)")
    return frozenset(keys)


def without_keys(outputs: Any, keys: frozenset[str]) -> Any:
    """A mapping's ``outputs`` without ``keys`` (kept as its type); anything else as is."""
    if not keys or not isinstance(outputs, Mapping) or not keys.intersection(outputs):
        return outputs
    return _mapping_like(outputs, {k: v for k, v in outputs.items() if k not in keys})


def _representable(value: PadValue, dtype: torch.dtype) -> bool:
    """Whether ``dtype`` holds ``value`` exactly (a float beyond the dtype's range does not)."""
    if dtype == torch.bool:
        return isinstance(value, bool) or value in (0, 1)
    if dtype.is_complex:
        return True
    if dtype.is_floating_point:
        return not math.isfinite(value) or abs(value) <= torch.finfo(dtype).max
    if isinstance(value, float) and not value.is_integer():
        return False  # 0.5, inf and nan included
    info = torch.iinfo(dtype)
    return info.min <= int(value) <= info.max


def _check_scalar(field: str, value: Any) -> PadValue:
    if not isinstance(value, bool | int | float):
        raise ConfigError.invalid(field, value, "a number or a bool")
    return value


@dataclasses.dataclass(frozen=True, slots=True)
class PadValues:
    """What ``predict(return_outputs=True)`` pads a tensor under the (innermost) key ``k``
    of dtype ``d`` with: ``by_key[k]``, else ``by_dtype[d]``, else ``value``, else the
    default of ``d`` (-100; 0 unsigned; False). Build it with :meth:`check`."""

    value: PadValue | None = None
    by_key: Mapping[str, PadValue] = dataclasses.field(default_factory=dict)
    by_dtype: Mapping[torch.dtype, PadValue] = dataclasses.field(default_factory=dict)

    @classmethod
    def check(cls, pad_value: Any) -> PadValues:
        """``predict``'s ``pad_value`` checked (see ``Trainer.predict``)."""
        if pad_value is None:
            return cls()
        if not isinstance(pad_value, Mapping):
            return cls(value=_check_scalar("pad_value", pad_value))
        by_key: dict[str, PadValue] = {}
        by_dtype: dict[torch.dtype, PadValue] = {}
        for key, value in pad_value.items():
            field = f"pad_value[{key!r}]"
            if isinstance(key, torch.dtype):
                by_dtype[key] = _check_scalar(field, value)
                if not _representable(value, key):
                    raise ConfigError.invalid(field, value, f"a value {key} can hold")
            elif isinstance(key, str):
                by_key[key] = _check_scalar(field, value)
            else:
                raise ConfigError.invalid(
                    "pad_value", key, "keys that are output keys (str) or torch dtypes"
                )
        return cls(by_key=by_key, by_dtype=by_dtype)

    def for_tensor(self, key: str | None, dtype: torch.dtype) -> PadValue:
        """The pad of a tensor under ``key`` (None: none) of ``dtype``; ``ConfigError`` for a
        value ``dtype`` cannot hold."""
        if key is not None and key in self.by_key:
            value, field = self.by_key[key], f"pad_value[{key!r}]"
        elif dtype in self.by_dtype:
            return self.by_dtype[dtype]  # checked by check()
        elif self.value is not None:
            value, field = self.value, "pad_value"
        elif dtype == torch.bool:
            return False
        elif not dtype.is_floating_point and not dtype.is_complex and torch.iinfo(dtype).min == 0:
            return 0  # unsigned: -100 does not fit
        else:
            return DEFAULT_PAD
        if not _representable(value, dtype):
            where = f"output {key!r}" if key is not None else "an output"
            raise ConfigError.invalid(
                field,
                value,
                f"a value {dtype} can hold ({where} is {dtype}); give that "
                f"output its own: pad_value={{{(key or dtype)!r}: ...}}",
            )
        return value


def _layout(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"shape {tuple(x.shape)}, {x.dtype}"
    return f"a {type(x).__name__}, not a tensor"


def _alike(first: Any, other: Any) -> bool:
    """Whether :func:`join_outputs` joins ``other`` with ``first`` per element or key."""
    if isinstance(first, tuple | list):
        return isinstance(other, type(first)) and len(other) == len(first)
    return (
        isinstance(first, Mapping) and isinstance(other, Mapping) and other.keys() == first.keys()
    )


def _concat(tensors: list[torch.Tensor], pad: PadValues, key: str | None) -> torch.Tensor:
    """Concatenated along the first dimension, the others padded at their end to the largest
    size."""
    tail = [max(sizes) for sizes in zip(*(t.shape[1:] for t in tensors), strict=True)]
    if all(list(t.shape[1:]) == tail for t in tensors):
        return torch.cat(tensors)
    first = tensors[0]
    value = pad.for_tensor(key, first.dtype)
    out = first.new_full((sum(len(t) for t in tensors), *tail), value)
    row = 0
    for t in tensors:
        out[(slice(row, row + len(t)), *(slice(0, n) for n in t.shape[1:]))] = t
        row += len(t)
    return out


def join_outputs(
    batches: Sequence[Any], pad: PadValues | None = None, *, _key: str | None = None
) -> Any:
    """The per-batch outputs concatenated along the first dimension, as ``Trainer.predict``
    says (padded with ``pad``; None: the defaults); no batch: ``[]``."""
    if not batches:
        return []
    pad = pad or PadValues()
    first = batches[0]
    if isinstance(first, torch.Tensor):
        if first.dim() == 0:
            return torch.stack(list(batches))
        return _concat(list(batches), pad, _key)
    if not all(_alike(first, b) for b in batches):
        return list(batches)
    if isinstance(first, tuple | list):
        return _sequence_like(
            first,
            [join_outputs([b[i] for b in batches], pad, _key=_key) for i in range(len(first))],
        )
    return _mapping_like(
        first, {k: join_outputs([b[k] for b in batches], pad, _key=str(k)) for k in first}
    )


class KeptOutputs:
    """The outputs ``predict(return_outputs=True)`` keeps: each batch checked as it comes to
    join with the first, and copied to the host (CUDA: pinned, non-blocking)."""

    def __init__(self, pad: PadValues, device: torch.device) -> None:
        self._pad = pad
        self._first: Any = None
        self._loose: set[str] = set()  # the paths of the containers that join as lists
        self._device = device
        self._pin = device.type == "cuda"
        self._queued = False
        self._batches: list[Any] = []

    def add(self, outputs: Any, index: int) -> None:
        """Keep batch ``index``'s outputs; ``TrainingError`` for outputs that cannot join."""
        if self._batches:
            self._check(self._first, outputs, index, "outputs", None)
        else:
            self._first = map_tensors(lambda t: t.to("meta"), outputs)
            keys = _keys(outputs)
            unknown = sorted(set(self._pad.by_key) - keys)
            if unknown:
                raise ConfigError.invalid(
                    f"pad_value[{unknown[0]!r}]",
                    self._pad.by_key[unknown[0]],
                    f"keys of the outputs ({', '.join(sorted(keys)) or 'they have none'}) or "
                    "torch dtypes",
                )
        self._batches.append(map_tensors(self._tensor_to_host, outputs))

    def _check(self, first: Any, other: Any, index: int, path: str, key: str | None) -> None:
        if path in self._loose:
            return
        if isinstance(first, torch.Tensor):
            if (
                not isinstance(other, torch.Tensor)
                or other.dim() != first.dim()
                or other.dtype != first.dtype
            ):
                raise TrainingError(
                    f"predict(return_outputs=True) cannot join {path}: batch {index} gives "
                    f"{_layout(other)} where batch 0 gave {_layout(first)}; padding joins "
                    "tensors whose sizes differ, not their number of dimensions or dtype. "
                    "Return one layout per batch, or leave return_outputs False and collect "
                    "PredictionBatchEnded.outputs yourself"
                )
            if other.shape[1:] != first.shape[1:]:
                self._pad.for_tensor(key, first.dtype)  # padding is needed: can it pad?
        elif not _alike(first, other):
            self._loose.add(path)
        elif isinstance(first, Mapping):
            for k, v in first.items():
                self._check(v, other[k], index, f"{path}[{k!r}]", str(k))
        else:
            for i, (v, o) in enumerate(zip(first, other, strict=True)):
                self._check(v, o, index, f"{path}[{i}]", key)

    def _tensor_to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type == "cpu":
            return tensor
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=self._pin)
        host.copy_(tensor, non_blocking=self._pin)
        self._queued = self._queued or self._pin
        return host

    def batches(self) -> list[Any]:
        """The host copies of every batch kept, in order."""
        if self._queued:
            torch.cuda.synchronize(self._device)
            self._queued = False
        return self._batches


def _keys(outputs: Any) -> set[str]:
    """Every mapping key in ``outputs``, at any depth."""
    if isinstance(outputs, Mapping):
        return {str(k) for k in outputs}.union(*(_keys(v) for v in outputs.values()))
    if isinstance(outputs, tuple | list):
        return set().union(*(_keys(o) for o in outputs))
    return set()

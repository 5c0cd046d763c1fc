"""A model's weights as the weight-swapping callbacks see them: the distinct tensors of its
state dict (tied weights once), found through the wrappers, and exchanged bit for bit."""

from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = ["ModelTensors", "exchange", "unwrapped"]


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose weights a checkpoint holds: ``DistributedDataParallel`` /
    ``DataParallel``'s ``.module`` and ``torch.compile``'s original module, unwrapped."""
    while True:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel | torch.nn.DataParallel):
            model = model.module
            continue
        inner = getattr(model, "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner


class ModelTensors:
    """The model's tensors a state dict holds, each once (tied weights share one entry).

    Attributes:
        unique: ``{name: tensor}`` of the distinct tensors, first name of each.
        aliases: ``{state dict key: name in unique}`` for every key, in the state dict's order.
        params: The names in ``unique`` that are parameters (the rest are buffers).

    Args:
        model: The model, wrapped or not (:func:`unwrapped` gives the names).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        seen: dict[int, str] = {}
        self.unique: dict[str, torch.Tensor] = {}
        self.aliases: dict[str, str] = {}
        params: list[str] = []
        # keep_vars: the live parameters (as Parameters) and buffers, not detached copies. One
        # walk of the modules, at every update and swap: a model moved with .to() (its buffers
        # replaced) or a buffer reassigned is followed, never a stale tensor averaged.
        for key, value in unwrapped(model).state_dict(keep_vars=True).items():
            if not isinstance(value, torch.Tensor):
                continue  # a module's extra state: not a weight
            name = seen.setdefault(id(value), key)
            self.aliases[key] = name
            if name == key:
                self.unique[key] = value
                if isinstance(value, torch.nn.Parameter):
                    params.append(key)
        self.params = frozenset(params)

    def mismatch(self, other: Mapping[str, torch.Tensor]) -> str | None:
        """What differs between these tensors and ``other`` (names, shapes, dtypes), or None."""
        missing = sorted(set(self.unique) - set(other))
        extra = sorted(set(other) - set(self.unique))
        problems = []
        if missing:
            problems.append(f"{missing[:5]} are in the model but not in the average")
        if extra:
            problems.append(f"{extra[:5]} are in the average but not in the model")
        for name in sorted(set(self.unique) & set(other)):
            a, b = self.unique[name], other[name]
            if a.shape != b.shape or a.dtype != b.dtype:
                problems.append(f"{name!r} is {tuple(a.shape)} {a.dtype} in the model but "
                                f"{tuple(b.shape)} {b.dtype} in the average")  # fmt: skip
        return "; ".join(problems[:6]) or None


@torch.no_grad()
def exchange(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Exchange the contents of each pair, bit for bit (either may be on another device).

    All or nothing: when one exchange fails (out of memory), the ones done are undone first.
    """
    done = 0
    try:
        for a, b in pairs:
            held = a.clone()  # one tensor's worth of extra memory at a time
            a.copy_(b)
            b.copy_(held)
            done += 1
    except BaseException:
        for a, b in pairs[:done]:
            held = a.clone()
            a.copy_(b)
            b.copy_(held)
        raise

"""Parameter names as checkpoints write them: the module's own, whatever wraps it.

``torch.compile(model)`` returns a wrapper whose state dict prefixes every key with
``_orig_mod.`` (and a compiled submodule, ``model.encoder = torch.compile(model.encoder)``, puts
``_orig_mod`` in the middle of its keys). A checkpoint keyed so would load only into a model
compiled the same way. So checkpoints store the original module's keys (every ``_orig_mod``
part left out) and loading maps them onto the live model's keys, compiled or not: a compiled
run's checkpoint loads into the plain model and back, and a checkpoint with ``_orig_mod.`` keys
written before (or by hand from a compiled model) loads too. ``model.compile()`` compiles in
place and keeps the plain keys, so it needs none of this.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

import torch

__all__ = ["canonical_key", "canonical_names", "canonical_state", "live_state"]

_WRAPPER = "_orig_mod"  # the attribute torch.compile's OptimizedModule keeps the module under
V = TypeVar("V")


def canonical_key(key: str) -> str:
    """``key`` without its ``_orig_mod`` parts (``"_orig_mod.0.weight"`` -> ``"0.weight"``)."""
    if _WRAPPER not in key:
        return key
    return ".".join(part for part in key.split(".") if part != _WRAPPER)


def canonical_names(items: Iterable[tuple[str, V]]) -> dict[str, V]:
    """``{canonical_key(name): value}`` for ``(name, value)`` pairs (``named_parameters()``)."""
    return {canonical_key(name): value for name, value in items}


def canonical_state(state: Mapping[str, Any]) -> OrderedDict[str, Any]:
    """A model's ``state_dict()`` with canonical keys, its ``_metadata`` (module versions, read
    by ``load_state_dict``) keyed the same way.

    Args:
        state: ``model.state_dict()``.

    Returns:
        The same tensors under the original module's keys.
    """
    out: OrderedDict[str, Any] = OrderedDict((canonical_key(k), v) for k, v in state.items())
    metadata = getattr(state, "_metadata", None)
    if metadata is not None:
        # Wrapper and wrapped module map to one prefix: the wrapped one (listed later) wins.
        out._metadata = OrderedDict(  # type: ignore[attr-defined]
            (canonical_key(k), v) for k, v in metadata.items()
        )
    return out


def live_state(saved: Mapping[str, Any], model: torch.nn.Module) -> Mapping[str, Any]:
    """A saved state dict (canonical keys, or a compiled model's) keyed as ``model`` names
    its entries, to hand to ``model.load_state_dict``.

    Args:
        saved: The checkpoint's model state.
        model: The live model, compiled (whole or in parts) or not.

    Returns:
        ``saved`` itself when its keys are the model's already; else the same tensors under
        the model's keys (a key the model lacks stays as it is, so ``load_state_dict`` names
        it).
    """
    live_keys = list(model.state_dict().keys())
    if set(saved) == set(live_keys):
        return saved
    to_live = {canonical_key(k): k for k in live_keys}
    out: OrderedDict[str, Any] = OrderedDict()
    for key, value in saved.items():
        canonical = canonical_key(key)
        out[to_live.get(canonical, canonical)] = value
    metadata = getattr(saved, "_metadata", None)
    if metadata is not None:
        prefixes = {canonical_key(name): name for name, _ in model.named_modules()}
        out._metadata = OrderedDict(  # type: ignore[attr-defined]
            (prefixes.get(canonical_key(k), k), v) for k, v in metadata.items()
        )
    return out

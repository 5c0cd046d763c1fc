"""Metrics of the user's own (``ctx.log``, ``LogMetric``), closed with the log window's
(docs/trainer.md, "Metrics of your own"). Tensors stay on their device until the window reads
them: logging never syncs the step.
"""

from __future__ import annotations

from typing import Any

import torch

from .._exceptions import ConfigError
from .nonfinite import mean

__all__ = ["TRAIN_METRIC_NAMES", "UserMetrics", "check_metric"]

TRAIN_METRIC_NAMES = frozenset(
    {"loss", "lr", "steps_per_s", "samples_per_s", "grad_norm", "skipped_nonfinite"}
)
"""The log window's own keys in ``MetricsLogged.metrics`` (and ``lr/<name>`` per optimizer):
names a user's metric may not take."""


def check_metric(name: object, value: object) -> None:
    """``ConfigError`` for a logged metric's name that is empty or one of the window's own, or
    a value that is not a real number or a one-element tensor."""
    reserved = isinstance(name, str) and (name in TRAIN_METRIC_NAMES or name.startswith("lr/"))
    if not isinstance(name, str) or not name or reserved:
        raise ConfigError.invalid(
            "name", name, "a non-empty string other than the window's own metrics ("
            + ", ".join(sorted(TRAIN_METRIC_NAMES)) + ", lr/<optimizer>)",
        )  # fmt: skip
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ConfigError.invalid(
                f"value of {name!r}", f"a tensor of shape {tuple(value.shape)}",
                "a number or a one-element tensor",
            )  # fmt: skip
    elif isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError.invalid(
            f"value of {name!r}", type(value).__name__, "a number or a one-element tensor"
        )


class UserMetrics:
    """The values logged since the last window close, per name, in the order logged (used on
    the training thread only)."""

    def __init__(self) -> None:
        self._values: dict[str, list[Any]] = {}

    def log(self, name: str, value: torch.Tensor | float) -> None:
        """Add one value of ``name`` to the open window (checked by :func:`check_metric`)."""
        check_metric(name, value)
        kept = value.detach().reshape(()) if isinstance(value, torch.Tensor) else float(value)
        values = self._values.get(name)
        if values is None:
            self._values[name] = [kept]
        else:
            values.append(kept)

    def take(self) -> dict[str, float]:
        """``{name: mean}`` of the values since the last call, in the order first logged (one
        device read per name), and forget them."""
        out: dict[str, float] = {}
        for name, values in self._values.items():
            tensors = [v for v in values if isinstance(v, torch.Tensor)]
            floats = [v for v in values if not isinstance(v, torch.Tensor)]
            if tensors:
                floats += [float(x) for x in torch.stack([t.float() for t in tensors]).tolist()]
            out[name] = mean(floats)
        self._values = {}
        return out

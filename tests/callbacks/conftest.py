"""Helpers for the built-in callback tests: a tiny trainer and scripted validation metrics."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from trainbus import Callback, Trainer
from trainbus.testing import tiny_loader, tiny_model


def scripted(values: Sequence[float]) -> Callable[[Any, Any], float]:
    """A metric function returning ``values`` one evaluation after the other (then the last).

    The evaluation loader of :func:`make_trainer` has one batch, so the function is called
    once per evaluation and ``val_<name>`` takes exactly these values.
    """
    it = iter(values)
    last = [values[0]]

    def metric(outputs: Any, targets: Any) -> float:
        last[0] = next(it, last[0])
        return float(last[0])

    return metric


def make_trainer(
    callbacks: Iterable[Callback] = (),
    *,
    epochs: int = 2,
    batches: int = 4,
    score: Sequence[float] | None = None,
    lr: float = 0.1,
    **kwargs: Any,
) -> Trainer:
    """The 32-64-10 MLP on ``batches`` generated batches, one evaluation batch per evaluation.

    ``score`` scripts ``val_score`` (see :func:`scripted`); else ``metrics=`` goes to the Trainer.
    """
    model = tiny_model()
    if score is not None:
        kwargs["metrics"] = {"score": scripted(score)}
    kwargs.setdefault("eval_data", tiny_loader(1, seed=1))
    return Trainer(
        model, torch.optim.SGD(model.parameters(), lr=lr), tiny_loader(batches),
        loss_fn=F.cross_entropy, max_epochs=epochs, on_signal=None,
        callbacks=list(callbacks), **kwargs,
    )  # fmt: skip


@pytest.fixture
def trainer_factory() -> Callable[..., Trainer]:
    """``trainer_factory([callbacks], epochs=..., score=[...], **Trainer kwargs)``."""
    return make_trainer

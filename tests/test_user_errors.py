"""The user's exception reaches the caller as itself: a subscriber with on_error="raise" or a
hook that raises fails the run with that exception (``except MyError`` matches at fit() and
run()), a note saying where trainbus caught it, and the run's end as for any failure."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from trainbus import Trainer
from trainbus import events as ev
from trainbus._hookpoints import StepContext
from trainbus.testing import EventRecorder, tiny_loader, tiny_model


class TrialPruned(Exception):
    """A user's own exception type (as optuna.TrialPruned is)."""


def make_trainer(tmp: Path, **overrides: Any) -> Trainer:
    model = tiny_model()
    kwargs: dict[str, Any] = dict(
        loss_fn=F.cross_entropy, max_steps=6, device="cpu", handle_signals=False,
        progress=False, checkpoint_dir=tmp,
    )  # fmt: skip
    kwargs.update(overrides)
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_loader(6), **kwargs)


def trainbus_notes(exc: BaseException) -> list[str]:
    return [n for n in getattr(exc, "__notes__", []) if n.startswith("trainbus:")]


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_a_subscribers_exception_comes_out_of_fit_as_itself(
    kind: str, tmp_path: Path
) -> None:
    trainer = make_trainer(tmp_path)
    bus = trainer.bus
    recorder = EventRecorder(bus)

    def prune(e: ev.StepEnded) -> None:
        if e.step == 2:
            raise TrialPruned(f"pruned at {e.step}")

    async def prune_async(e: ev.StepEnded) -> None:
        prune(e)

    if kind == "sync":
        bus.subscribe(bus.stream(ev.StepEnded), prune, on_error="raise", name="pruner")
    else:
        bus.subscribe_async(bus.stream(ev.StepEnded), prune_async, on_error="raise",
                            name="pruner")  # fmt: skip
    try:
        await trainer.fit()
    except TrialPruned as exc:
        caught: TrialPruned = exc
    else:
        pytest.fail("fit() returned")
    assert str(caught) == "pruned at 2"
    (note,) = trainbus_notes(caught)
    assert "subscriber 'pruner'" in note and "StepEnded (step 2, epoch 0)" in note
    (end,) = recorder.of_type(ev.FitEnded)
    assert end.reason == "failed" and end.error is caught
    assert trainer.result is not None and trainer.result.reason == "failed"
    # A failed run writes no final checkpoint (as before): nothing was saved.
    assert not any(name.endswith(".pt") for name in os.listdir(tmp_path))
    # The next call on the same Trainer starts without the failure.
    metrics = await trainer.evaluate(tiny_loader(1, seed=1))
    assert "val_loss" in metrics


def test_a_hooks_exception_comes_out_of_run_as_itself(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path)
    recorder = EventRecorder(trainer.bus)

    def scale_loss(ctx: StepContext) -> None:
        if ctx.step == 3:
            raise TrialPruned("from a hook")

    trainer.add_hook("loss", scale_loss)
    with pytest.raises(TrialPruned, match="from a hook") as caught:
        trainer.fit_sync()
    (note,) = trainbus_notes(caught.value)
    assert "hook" in note and "scale_loss" in note and "'loss'" in note and "step 3" in note
    (end,) = recorder.of_type(ev.FitEnded)
    assert end.reason == "failed" and end.error is caught.value

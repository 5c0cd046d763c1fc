"""A ``request()`` the loop can no longer apply raises ``BusClosedError`` at the call's end: it
never holds ``fit()`` (whose end waits for async subscribers up to ``close_timeout``, 300 s)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trainbus import Trainer
from trainbus import commands as cmd
from trainbus import events as ev
from trainbus.bus import BusClosedError
from trainbus.testing import tiny_loader, tiny_model

pytestmark = pytest.mark.timeout(60)  # the bug this pins was a hang


def _trainer(steps: int = 4) -> Trainer:
    model = tiny_model()
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_loader(steps),
                   loss_fn=F.cross_entropy, max_epochs=1, progress=False)  # fmt: skip


def test_a_request_made_on_fit_ended_raises_and_fit_returns() -> None:
    trainer = _trainer()
    outcomes: list[BaseException | ev.BaseEvent] = []

    async def late(e: ev.FitEnded) -> None:
        try:
            outcomes.append(await trainer.bus.request(cmd.SaveCheckpoint(tag="late")))
        except BusClosedError as exc:
            outcomes.append(exc)

    trainer.bus.subscribe_async(trainer.bus.stream(ev.FitEnded), late)
    result = trainer.fit_sync()
    assert result.reason == "completed"
    assert len(outcomes) == 1 and isinstance(outcomes[0], BusClosedError)
    assert "last poll point" in str(outcomes[0])


def test_the_next_call_runs_after_a_refused_request() -> None:
    trainer = _trainer()
    refused: list[BusClosedError] = []

    async def late(e: ev.FitEnded) -> None:
        try:
            await trainer.bus.request(cmd.StopTraining(reason="too late"))
        except BusClosedError as exc:
            refused.append(exc)

    trainer.bus.subscribe_async(trainer.bus.stream(ev.FitEnded), late)
    trainer.fit_sync()
    assert len(refused) == 1
    metrics = trainer.evaluate_sync(tiny_loader(2))  # the next call: nothing carried over
    assert "val_loss" in metrics

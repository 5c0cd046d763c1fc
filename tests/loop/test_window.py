"""The log window's rate is timed after its device read: the window's steps are done only
once the device ran them, so the read's wait belongs to the window (before the fix, the first
window after a start or resume overstated steps/s by the queued GPU work)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from trainbus import Trainer
from trainbus._loop import window as window_module
from trainbus._loop.window import LogWindow
from trainbus.testing import tiny_loader, tiny_model


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


def test_steps_per_s_counts_the_wait_of_the_windows_read(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    monkeypatch.setattr(window_module.time, "monotonic", clock.monotonic)
    read = window_module._read

    def slow_read(losses: list[Any]) -> list[float]:
        clock.now += 3.0  # the device runs the queued steps: the read waits 3 s
        return read(losses)

    monkeypatch.setattr(window_module, "_read", slow_read)
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.5)
    settings = SimpleNamespace(optimizer=opt, optimizers={"default": opt}, on_nonfinite="raise")
    state = SimpleNamespace(step=0, epoch=0)
    guard = SimpleNamespace(active=True, skipped=0, per_step=False, tripped=False)
    bus = SimpleNamespace(publish=lambda e: None)
    window = LogWindow(settings, bus, state, guard=guard)  # type: ignore[arg-type]
    for _ in range(10):  # launched in 1 s
        clock.now += 0.1
        state.step += 1
        window.add(torch.tensor(1.0), None, 4)
    window.close(publish=False)
    # 10 steps in 1 s of launching + 3 s of running them: 2.5 steps/s, not 10
    assert window.metrics["steps_per_s"] == pytest.approx(2.5)
    assert window.metrics["samples_per_s"] == pytest.approx(10.0)
    # the next window starts after the read
    for _ in range(4):
        clock.now += 0.5
        state.step += 1
        window.add(torch.tensor(1.0), None, 4)
    window.close(publish=False)
    assert window.metrics["steps_per_s"] == pytest.approx(4 / 5.0)


# FitResult.train_metrics for a run of any length: the mean of its last window, partial or not.


def _trainer(**kwargs: Any) -> Trainer:
    model = tiny_model()
    kwargs.setdefault("max_steps", 4)
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_loader(8, 4),
                   loss_fn=F.cross_entropy, progress=False, **kwargs)  # fmt: skip


@pytest.mark.parametrize(
    ("max_steps", "log_every", "on_nonfinite"),
    [
        (3, 50, "raise"),
        (7, 5, "raise"),
        (3, 50, "skip"),
        (1, 2, "raise"),
        (3, 50, "ignore"),
        (7, 5, "ignore"),
    ],
)
def test_train_metrics_hold_the_last_loss_for_any_run_length(
    max_steps: int, log_every: int, on_nonfinite: str
) -> None:
    trainer = _trainer(max_steps=max_steps, log_every=log_every, on_nonfinite=on_nonfinite)
    losses: list[float] = []
    trainer.add_hook("loss", lambda ctx: losses.append(float(ctx.loss.detach())))  # type: ignore[arg-type]
    result = trainer.fit_sync()
    assert result.steps == max_steps
    # The partial last window: the mean of the steps after the last log step.
    tail = losses[(max_steps // log_every) * log_every :]
    assert result.train_metrics["loss"] == pytest.approx(sum(tail) / len(tail), rel=1e-6)
    assert result.train_metrics["lr"] == pytest.approx(0.1)
    assert result.train_metrics["steps_per_s"] > 0


@pytest.mark.parametrize("on_nonfinite", ["raise", "ignore"])
def test_a_run_ending_on_a_log_step_keeps_that_windows_metrics(on_nonfinite: str) -> None:
    # The window's mean over its steps, also when no guard and no subscriber reads each step.
    trainer = _trainer(max_steps=4, log_every=2, on_nonfinite=on_nonfinite)
    losses: list[float] = []
    trainer.add_hook("loss", lambda ctx: losses.append(float(ctx.loss.detach())))  # type: ignore[arg-type]
    result = trainer.fit_sync()
    assert result.train_metrics["loss"] == pytest.approx(sum(losses[2:]) / 2, rel=1e-6)

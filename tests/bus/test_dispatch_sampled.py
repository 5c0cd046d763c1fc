"""``bus.stream(T, every_s=s)``: a sampled subscription takes the first event, then none stamped
less than ``s`` seconds after the last one it took; ``every_steps=n`` takes the multiples of n."""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from trainbus import ConfigError, EventBus, Trainer
from trainbus import events as ev
from trainbus.testing import tiny_loader, tiny_model


def _step(step: int, time: float) -> ev.StepEnded:
    return ev.StepEnded(step=step, epoch=0, loss=1.0, lr=0.1, grad_norm=None, samples=1,
                        data_wait_s=0.0, duration_s=0.0, time=time)  # fmt: skip


def test_takes_the_first_event_then_none_closer_than_every_s() -> None:
    bus = EventBus()
    got: list[int] = []
    bus.stream(ev.StepEnded, every_s=1.0).subscribe(lambda e: got.append(e.step))
    for step, t in enumerate([10.0, 10.5, 10.99, 11.0, 11.2, 12.5, 12.6, 13.49, 13.5]):
        bus.publish(_step(step, t))
    bus.flush()
    assert got == [0, 3, 5, 8]  # 10.0, 11.0, 12.5, 13.5


def test_each_sampled_subscription_keeps_its_own_clock() -> None:
    bus = EventBus()
    slow: list[int] = []
    fast: list[int] = []
    every: list[int] = []
    bus.stream(ev.StepEnded, every_s=2.0).subscribe(lambda e: slow.append(e.step))
    bus.stream(ev.StepEnded, every_s=0.5).subscribe(lambda e: fast.append(e.step))
    bus.stream(ev.StepEnded).subscribe(lambda e: every.append(e.step))
    for step in range(10):
        bus.publish(_step(step, step * 0.5))
    bus.flush()
    assert slow == [0, 4, 8] and fast == list(range(10)) and every == list(range(10))


def test_a_sampled_subscription_is_a_demand_until_disposed() -> None:
    bus = EventBus()
    sampled = bus.stream(ev.StepEnded, every_s=1.0).subscribe(lambda e: None)
    assert bus.wants(ev.StepEnded)
    sampled.dispose()
    assert not bus.wants(ev.StepEnded)


@pytest.mark.parametrize("every_s", [0, -1.0, True, "1", math.nan])
def test_a_bad_every_s_is_a_config_error(every_s: Any) -> None:
    with pytest.raises(ConfigError, match="every_s"):
        EventBus().stream(ev.StepEnded, every_s=every_s)


def _trainer(steps: int) -> Trainer:
    model = tiny_model()
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05), tiny_loader(steps, 8),
                   loss_fn=F.cross_entropy, max_epochs=1, on_signal=None,
                   progress=False)  # fmt: skip


def test_a_run_s_sampled_subscriber_gets_one_event_per_interval() -> None:
    trainer = _trainer(600)
    got: list[ev.StepEnded] = []
    trainer.bus.stream(ev.StepEnded, every_s=0.05).subscribe(got.append)
    span: list[float] = []
    trainer.bus.stream(ev.FitStarted, ev.FitEnded).subscribe(lambda e: span.append(e.time))
    result = trainer.fit_sync()
    assert result.steps == 600 and got[0].step == 1
    times = [e.time for e in got]
    assert all(b - a >= 0.05 for a, b in itertools.pairwise(times))
    assert len(got) <= (span[1] - span[0]) / 0.05 + 1


def test_a_subscriber_of_every_step_still_gets_every_step() -> None:
    trainer = _trainer(200)
    sampled: list[int] = []
    every: list[int] = []
    # One sample a day: the first step's only, however slow the run (a GPU host under load
    # took over 10 s for these 200 steps, and its second sample failed the test).
    trainer.bus.stream(ev.StepEnded, every_s=86_400.0).subscribe(lambda e: sampled.append(e.step))
    trainer.bus.stream(ev.StepEnded).subscribe(lambda e: every.append(e.step))
    trainer.fit_sync()
    assert every == list(range(1, 201)) and sampled == [1]


def test_every_steps_takes_the_multiples() -> None:
    bus = EventBus()
    got: list[int] = []
    bus.stream(ev.StepEnded, every_steps=4).subscribe(lambda e: got.append(e.step))
    for step in range(1, 14):
        bus.publish(_step(step, float(step)))
    bus.flush()
    assert got == [4, 8, 12]


@pytest.mark.parametrize("every_steps", [0, -2, 1.5, True])
def test_a_bad_every_steps_is_a_config_error(every_steps: Any) -> None:
    with pytest.raises(ConfigError, match="every_steps"):
        EventBus().stream(ev.StepEnded, every_steps=every_steps)


def test_every_s_and_every_steps_together_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="every_steps"):
        EventBus().stream(ev.StepEnded, every_s=1.0, every_steps=10)


def test_a_run_s_step_sampled_subscribers_get_the_multiples() -> None:
    trainer = _trainer(300)
    tens: list[int] = []
    sevens: list[int] = []
    trainer.bus.stream(ev.StepEnded, every_steps=10).subscribe(lambda e: tens.append(e.step))
    trainer.bus.stream(ev.StepEnded, every_steps=7).subscribe(lambda e: sevens.append(e.step))
    trainer.fit_sync()
    assert tens == list(range(10, 301, 10)) and sevens == list(range(7, 301, 7))

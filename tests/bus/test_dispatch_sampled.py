"""``bus.stream(T, every_s=s)``: a sampled subscription takes the first event, then none stamped
less than ``s`` seconds after the last one it took; the training loop sees the sample and, while
nobody takes every ``StepEnded``, builds one only when one is due."""

from __future__ import annotations

import itertools
import math
import random
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from reactivex import operators as ops

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


def test_the_demand_follows_the_sampled_subscriptions() -> None:
    bus = EventBus()
    demand = bus.port().demand(ev.StepEnded)
    assert not demand.sampled and not demand.takes(1, 1e9)  # nobody samples
    sub = bus.stream(ev.StepEnded, every_s=1.0).subscribe(lambda e: None)
    assert demand.sampled and demand.takes(1, -1e9)  # the first event is always taken
    bus.publish(_step(1, 100.0))
    bus.flush()
    assert not demand.takes(2, 100.5) and demand.takes(2, 101.0)  # every_s after the last
    # The one due at 101.0 is being built: none other before 102.0, though not yet delivered.
    assert not demand.takes(3, 101.5) and demand.takes(3, 102.0)
    assert bus.port().demand(ev.StepEnded) is demand  # one object the loop can keep
    sub.dispose()
    assert not demand.sampled and not demand.takes(3, 1e9)


def test_a_refused_event_puts_the_demand_back_on_the_exact_due_time() -> None:
    """The publisher's own estimate of the next due time (set when it is told to build) can
    get ahead of the gate's exact one, and the event it built then be refused (stamped short
    of it, or racing the delivery that set it): the refusal tells the table, so the next
    step's event is built at the exact due time, not an interval later."""
    bus = EventBus()
    demand = bus.port().demand(ev.StepEnded)
    got: list[int] = []
    bus.stream(ev.StepEnded, every_s=1.0).subscribe(lambda e: got.append(e.step))
    assert demand.takes(1, 100.0)
    bus.publish(_step(1, 100.5))
    bus.flush()  # passed: due again at 101.5
    assert demand.takes(2, 101.5)  # the estimate moves on to 102.5
    bus.publish(_step(2, 101.45))  # short of 101.5: refused
    bus.flush()
    assert got == [1]
    assert demand.takes(3, 101.6)  # at the exact due time again
    bus.publish(_step(3, 101.6))
    bus.flush()
    assert got == [1, 3]


@pytest.mark.parametrize("delivery", ["every_40_steps", "one_event_late"])
def test_with_the_event_loop_held_every_event_built_is_a_sample_on_time(delivery: str) -> None:
    """The loop's way, with late deliveries (a slow sync subscriber holds the event loop):
    the publisher asks at each step's start, builds the event stamped at its end and tells the
    demand that stamp; the loop delivers what queued every 40 steps, or each event only once
    the next one is built. Every event built then passes the gate, and two samples are never
    more than every_s and two steps apart. Before, an event was built short of the due time
    (from the step's start), or a delivery took the due time back to an older event's and had
    one built at once; the gate refused it and its sample came an interval later (gaps of
    2 x every_s, 4 to 6 in 1,000 steps of a real run with a 0.2 s sync subscriber)."""
    rng = random.Random(5)
    bus = EventBus()
    demand = bus.port().demand(ev.StepEnded)
    got: list[float] = []
    bus.stream(ev.StepEnded, every_s=0.05).subscribe(lambda e: got.append(e.time))
    waiting: list[ev.StepEnded] = []
    built, t = 0, 0.0
    for step in range(1, 2001):
        start, t = t, t + rng.uniform(0.001, 0.010)  # steps of 1 to 10 ms
        if demand.takes(step, start):
            built += 1
            event = _step(step, t)
            demand.built(event.time)
            waiting.append(event)
        if delivery == "one_event_late" and len(waiting) > 1:
            bus.publish(waiting.pop(0))
            bus.flush()
        elif delivery == "every_40_steps" and step % 40 == 0:
            for event in waiting:
                bus.publish(event)
            waiting.clear()
            bus.flush()
    for event in waiting:
        bus.publish(event)
    bus.flush()
    assert len(got) == built and built <= t / 0.05 + 1
    assert max(b - a for a, b in itertools.pairwise(got)) <= 0.05 + 2 * 0.010


def test_the_demand_tells_sampled_from_every_event() -> None:
    bus = EventBus()
    demand = bus.port().demand(ev.StepEnded)
    sampled = bus.stream(ev.StepEnded, every_s=1.0).subscribe(lambda e: None)
    assert bus.wants(ev.StepEnded) and demand.sampled and not demand.each
    piped = bus.stream(ev.StepEnded).pipe(ops.throttle_first(1.0)).subscribe(lambda e: None)
    # A pipe the bus cannot see into takes every event.
    assert demand.each and not demand.sampled and demand.takes(7, -1e9)
    piped.dispose()
    sampled.dispose()
    assert not bus.wants(ev.StepEnded) and not demand.each and not demand.sampled


@pytest.mark.parametrize("every_s", [0, -1.0, True, "1", math.nan])
def test_a_bad_every_s_is_a_config_error(every_s: Any) -> None:
    with pytest.raises(ConfigError, match="every_s"):
        EventBus().stream(ev.StepEnded, every_s=every_s)


def _trainer(steps: int) -> Trainer:
    model = tiny_model()
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05), tiny_loader(steps, 8),
                   loss_fn=F.cross_entropy, max_epochs=1, on_signal=None,
                   progress=False)  # fmt: skip


OTHERS = 10
"""Events of a one-epoch run other than StepEnded when nothing else is subscribed (at most)."""


def test_the_loop_builds_step_ended_only_when_a_sample_is_due() -> None:
    trainer = _trainer(600)
    got: list[ev.StepEnded] = []
    trainer.bus.stream(ev.StepEnded, every_s=0.05).subscribe(got.append)
    span: list[float] = []
    trainer.bus.stream(ev.FitStarted, ev.FitEnded).subscribe(lambda e: span.append(e.time))
    result = trainer.fit_sync()
    assert result.steps == 600
    times = [e.time for e in got]
    assert got and all(b - a >= 0.05 for a, b in itertools.pairwise(times))
    # Built only when due, one per 0.05 s of the run however late the event loop delivers
    # them: far fewer than one a step. Every other event of the run is a handful.
    published = result.statistics.published
    assert published <= (span[1] - span[0]) / 0.05 + 1 + OTHERS, (published, span)


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
    demand = bus.port().demand(ev.StepEnded)
    sub = bus.stream(ev.StepEnded, every_steps=4).subscribe(lambda e: got.append(e.step))
    assert demand.sampled and demand.takes(8, 0.0) and not demand.takes(9, 1e9)
    for step in range(1, 14):
        bus.publish(_step(step, float(step)))
    bus.flush()
    assert got == [4, 8, 12]
    sub.dispose()
    assert not demand.sampled and not demand.takes(8, 1e9)


@pytest.mark.parametrize("every_steps", [0, -2, 1.5, True])
def test_a_bad_every_steps_is_a_config_error(every_steps: Any) -> None:
    with pytest.raises(ConfigError, match="every_steps"):
        EventBus().stream(ev.StepEnded, every_steps=every_steps)


def test_every_s_and_every_steps_together_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="every_steps"):
        EventBus().stream(ev.StepEnded, every_s=1.0, every_steps=10)


def test_the_loop_builds_step_ended_only_at_the_sampled_steps() -> None:
    trainer = _trainer(300)
    tens: list[int] = []
    sevens: list[int] = []
    trainer.bus.stream(ev.StepEnded, every_steps=10).subscribe(lambda e: tens.append(e.step))
    trainer.bus.stream(ev.StepEnded, every_steps=7).subscribe(lambda e: sevens.append(e.step))
    result = trainer.fit_sync()
    assert tens == list(range(10, 301, 10)) and sevens == list(range(7, 301, 7))
    # 30 + 42 - 4 (multiples of 70) StepEnded, plus a handful of other events: not 300.
    assert result.statistics.published < 100, result.statistics.published

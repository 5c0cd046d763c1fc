"""trainbus.testing: the recorder, virtual time, and the tiny model and loader."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
from reactivex import operators as ops

from trainbus import ConfigError, EventBus
from trainbus import events as ev
from trainbus.testing import EventRecorder, VirtualTimeScheduler, tiny_loader, tiny_model


# ----------------------------------------------------------------------------- EventRecorder
def test_recorder_records_every_event_in_order(vbus: EventBus, step_event, make_event) -> None:
    rec = EventRecorder(vbus)
    events = [make_event(ev.EpochStarted), step_event(1), step_event(2), make_event(ev.EpochEnded)]
    for e in events:
        vbus.publish(e)
    assert len(rec) == 0  # nothing before the bus dispatches
    vbus.flush()
    assert rec.items == events and list(rec) == events and len(rec) == 4
    assert rec.of_type(ev.StepEnded) == events[1:3]
    assert rec.of_type(ev.BaseEvent) == events
    assert rec.names() == ["EpochStarted", "StepEnded", "StepEnded", "EpochEnded"]
    rec.clear()
    assert rec.items == [] and len(rec) == 0
    assert rec.subscription.statistics().received == 4


def test_recorder_with_a_source(vbus: EventBus, step_event) -> None:
    rec = EventRecorder(vbus, vbus.stream(ev.StepEnded).pipe(ops.map(lambda e: e.step)))
    vbus.publish(ev.EpochStarted(step=0, epoch=0))
    for i in range(3):
        vbus.publish(step_event(i))
    vbus.flush()
    assert rec.items == [0, 1, 2]


def test_recorder_dispose_stops_recording(vbus: EventBus, step_event) -> None:
    rec = EventRecorder(vbus)
    vbus.publish(step_event(1))
    vbus.flush()
    rec.subscription.dispose()
    vbus.publish(step_event(2))
    vbus.flush()
    assert [e.step for e in rec] == [1]


@pytest.mark.asyncio
async def test_recorder_completed_when_the_bus_closes(step_event) -> None:
    bus = EventBus(flush_interval=0.001)
    rec = EventRecorder(bus)
    async with bus:
        bus.publish(step_event(1))
        assert not rec.completed
    assert rec.completed
    assert [e.step for e in rec] == [1]


# ----------------------------------------------------------------------------- virtual time
def test_virtual_time_runs_actions_when_due() -> None:
    vts = VirtualTimeScheduler()
    ran: list[tuple[str, float]] = []
    vts.schedule_relative(1.5, lambda s, _: ran.append(("a", vts.seconds)))
    vts.schedule_relative(timedelta(seconds=0.5), lambda s, _: ran.append(("b", vts.seconds)))
    cancelled = vts.schedule_relative(1.0, lambda s, _: ran.append(("c", vts.seconds)))
    cancelled.dispose()
    assert vts.seconds == 0.0
    vts.advance_by(1.0)
    assert ran == [("b", 0.5)]
    assert vts.seconds == 1.0
    vts.advance_by(timedelta(seconds=0.5))
    assert ran == [("b", 0.5), ("a", 1.5)]
    assert vts.seconds == 1.5


def test_virtual_time_initial_clock_and_add() -> None:
    vts = VirtualTimeScheduler(10)
    assert vts.seconds == 10.0
    assert VirtualTimeScheduler.add(1.5, timedelta(seconds=2)) == 3.5
    ran: list[float] = []
    vts.schedule_relative(2.0, lambda s, _: ran.append(vts.seconds))
    vts.advance_by(2.0)
    assert ran == [12.0]


def test_virtual_time_drives_rx_time_operators(vts: VirtualTimeScheduler) -> None:
    from reactivex.subject import Subject

    subject: Subject[int] = Subject()
    out: list[int] = []
    subject.pipe(ops.debounce(1.0, scheduler=vts)).subscribe(out.append)
    subject.on_next(1)
    vts.advance_by(0.5)
    subject.on_next(2)
    vts.advance_by(0.9)
    assert out == []
    vts.advance_by(0.2)
    assert out == [2]


# ----------------------------------------------------------------------------- tiny model/loader
def test_tiny_model_shape_and_determinism() -> None:
    model = tiny_model()
    x = torch.randn(5, 32)
    assert model(x).shape == (5, 10)
    params = [p.shape for p in model.parameters()]
    assert params == [(64, 32), (64,), (10, 64), (10,)]
    again = tiny_model()
    pairs = zip(model.parameters(), again.parameters(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
    other = tiny_model(seed=1)
    assert not torch.equal(next(model.parameters()), next(other.parameters()))
    assert tiny_model(8, 16, 3)(torch.randn(2, 8)).shape == (2, 3)


def test_tiny_loader_shapes_and_determinism() -> None:
    batches = tiny_loader(batches=4, batch_size=8)
    assert len(batches) == 4
    for x, y in batches:
        assert x.shape == (8, 32) and x.dtype == torch.float32
        assert y.shape == (8,) and y.dtype == torch.int64
        assert 0 <= int(y.min()) and int(y.max()) < 10
    again = tiny_loader(batches=4, batch_size=8)
    for (x1, y1), (x2, y2) in zip(batches, again, strict=True):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
    other = tiny_loader(batches=4, batch_size=8, seed=1)
    assert not torch.equal(batches[0][0], other[0][0])
    x, y = tiny_loader(batches=1, batch_size=4, in_features=6, classes=3)[0]
    assert x.shape == (4, 6) and int(y.max()) < 3


def test_tiny_loader_is_learnable_by_tiny_model() -> None:
    torch.manual_seed(0)
    model = tiny_model()
    data = tiny_loader(batches=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn = torch.nn.functional.cross_entropy

    def total() -> float:
        with torch.no_grad():
            return sum(float(loss_fn(model(x), y)) for x, y in data)

    first = total()
    for _ in range(5):
        for x, y in data:
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
    assert total() < first / 2


@pytest.mark.parametrize(("field", "value"), [("batches", 0), ("batch_size", -1), ("batches", 1.5)])
def test_tiny_loader_rejects_bad_sizes(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=rf"^{field}="):
        tiny_loader(**{field: value})  # type: ignore[arg-type]

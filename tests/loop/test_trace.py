"""The opt-in trace (``Trainer(trace=...)``, ``_loop/wants.py``): one ``SpanTraced`` per part
of a step, off by default, with the error of a part that raised."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from trainbus import ConfigError, Trainer
from trainbus import events as ev
from trainbus.testing import EventRecorder, tiny_loader, tiny_model


def make(**kwargs: Any) -> Trainer:
    model = tiny_model()
    kwargs.setdefault("max_steps", 2)
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_loader(4),
                   loss_fn=F.cross_entropy, device="cpu", on_signal=None, progress=False,
                   **kwargs)  # fmt: skip


def traced(trainer: Trainer) -> list[ev.SpanTraced]:
    rec = EventRecorder(trainer.bus, trainer.bus.stream(ev.SpanTraced))
    try:
        trainer.fit_sync()
    finally:
        trainer.close()
    return list(rec.items)


def test_off_by_default_nothing_is_published_even_to_a_subscriber() -> None:
    assert traced(make()) == []


def test_on_without_a_subscriber_publishes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    def published(subscribed: bool) -> int:
        trainer = make(trace=True)
        port = trainer.bus.port()  # the loop publishes through the bus' loop face
        real, count = port.publish, [0]

        def counting(event: ev.BaseEvent) -> None:
            count[0] += isinstance(event, ev.SpanTraced)
            real(event)

        monkeypatch.setattr(port, "publish", counting)
        if subscribed:
            trainer.bus.stream(ev.SpanTraced).subscribe(lambda e: None)
        trainer.fit_sync()
        trainer.close()
        return count[0]

    assert published(False) == 0
    assert published(True) > 0  # the count sees what a subscriber makes the loop publish


def test_a_set_of_names_traces_only_those_parts() -> None:
    got = traced(make(trace={"optimizer_step", "zero_grad"}, accumulate=2))
    assert [(e.span, e.step) for e in got] == [
        ("optimizer_step", 0), ("zero_grad", 1), ("optimizer_step", 1), ("zero_grad", 2),
    ]  # fmt: skip


def test_every_part_in_order_with_its_times_under_accumulation() -> None:
    got = traced(make(trace=True, accumulate=2, max_steps=1))
    assert [(e.span, e.batch_index, e.micro_batch) for e in got] == [
        ("data_wait", 0, 0), ("forward", 0, 0), ("backward", 0, 0),
        ("data_wait", 1, 1), ("forward", 1, 1), ("backward", 1, 1),
        ("optimizer_step", None, None), ("zero_grad", None, None),
    ]  # fmt: skip
    assert all(e.started <= e.ended and e.duration_s == e.ended - e.started for e in got)
    assert all(a.ended <= b.started for a, b in itertools.pairwise(got))


def test_an_error_in_a_part_is_in_its_event_before_it_propagates() -> None:
    trainer = make(trace=True)
    boom = RuntimeError("optimizer broke")

    def broken_step(*args: Any, **kwargs: Any) -> None:
        raise boom

    trainer.settings.optimizer.step = broken_step  # type: ignore[method-assign]
    rec = EventRecorder(trainer.bus)
    with pytest.raises(RuntimeError, match="optimizer broke") as caught:
        trainer.fit_sync()
    assert caught.value is boom
    (failed,) = [e for e in rec.of_type(ev.SpanTraced) if e.error is not None]
    assert (failed.span, failed.step, failed.error) == ("optimizer_step", 0, boom)
    # Published before the exception left the step: the epoch's end (which the loop publishes
    # while handling it) comes after.
    names = rec.names()
    assert names.index("EpochEnded") > rec.items.index(failed)


@pytest.mark.parametrize("value", ["forward", 1, None, {"forward", "nope"}, [True]], ids=repr)
def test_a_bad_value_is_a_config_error_naming_trace(value: Any) -> None:
    with pytest.raises(ConfigError, match=r"^trace=.*is invalid: True, False or a set of "
                       r"\['data_wait'"):  # fmt: skip
        make(trace=value)


def test_a_list_or_tuple_of_names_is_a_set() -> None:
    got = traced(make(trace=["forward"], max_steps=1))
    assert [e.span for e in got] == ["forward"]

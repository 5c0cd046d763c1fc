"""The bus' two faces: users hold the EventBus, the loop holds its port; and ``on_error`` is the
error policy wherever trainbus spells it (RxPY's error callback is ``on_rx_error``)."""

from __future__ import annotations

from typing import Any

import pytest
import reactivex
import torch
import torch.nn.functional as F
from reactivex import operators as ops

from trainbus import ConfigError, EventBus, Trainer
from trainbus import commands as cmd
from trainbus import events as ev
from trainbus._bus import LoopPort
from trainbus.bus import AnyioScheduler
from trainbus.testing import tiny_loader, tiny_model

# What only the loop, the session and the distributed link call: on the port, not on the bus.
LOOP_NAMES = {
    "barrier_requested", "demand", "doorbell", "failure", "has_commands", "held",
    "next_decision", "poll_commands", "publish", "request_cancel_pending", "decision_steps",
    "statistics", "wait_barrier", "resume_polls", "end_polls",
    "wait_for_room", "wants", "withdraw",
}  # fmt: skip
GONE_FROM_THE_BUS = {
    "chain_scheduler", "clock", "declare", "doorbell", "due", "has_commands", "held",
    "next_decision", "poll_commands", "request_cancel_pending", "routes_version",
    "subscribe_observer", "wait_barrier", "wait_for_room", "wants_each", "withdraw",
    # the loop's failure is the port's; running is state == "running"; runs_here: RankFilter
    "failure", "running", "runs_here",
}  # fmt: skip


def _public(obj: object) -> set[str]:
    return {n for n in dir(obj) if not n.startswith("_")}


def _step(step: int) -> ev.StepEnded:
    return ev.StepEnded(step=step, epoch=0, loss=1.0, lr=0.1, grad_norm=None, samples=1,
                        data_wait_s=0.0, duration_s=0.0)  # fmt: skip


def test_the_users_bus_keeps_only_what_users_call() -> None:
    bus = EventBus()
    assert not (_public(bus) & GONE_FROM_THE_BUS)
    # What users call stays (docs/bus.md, the examples): publishing their own events included.
    users = {"events", "stream", "subscribe", "subscribe_async", "commands", "send", "request",
             "statistics", "declare_decision_steps", "publish", "wants", "flush",
             "port"}  # fmt: skip
    assert users <= _public(bus)
    # At most 18 public names on the class (publish, wants, commands and the options are set
    # per instance).
    assert len([n for n in dir(EventBus) if not n.startswith("_")]) <= 18


def test_the_port_is_one_object_holding_the_loop_names() -> None:
    bus = EventBus()
    port = bus.port()
    assert isinstance(port, LoopPort) and bus.port() is port
    assert LOOP_NAMES <= _public(port)
    # The port's publish is the bus' own: an event published on either reaches subscribers.
    got: list[int] = []
    bus.stream(ev.StepEnded).subscribe(lambda e: got.append(e.step))
    port.publish(_step(1))
    bus.publish(_step(2))
    bus.flush()
    assert got == [1, 2] and port.wants(ev.StepEnded)


def test_a_command_sent_by_a_user_is_polled_on_the_port() -> None:
    bus = EventBus()
    port = bus.port()
    rings = port.doorbell.rings
    bus.send(cmd.StopTraining(reason="user"))
    assert port.doorbell.rings == rings + 1 and port.has_commands()
    assert port.poll_commands() == [cmd.StopTraining(reason="user")] and not port.has_commands()


def test_every_change_the_loop_must_see_rings_the_one_doorbell() -> None:
    bus = EventBus()
    port = bus.port()
    seen = [port.doorbell.rings]

    def rang() -> bool:
        now = port.doorbell.rings
        grew = now > seen[-1]
        seen.append(now)
        return grew

    sub = bus.stream(ev.SpanTraced).subscribe(lambda e: None)
    assert rang() and port.wants(ev.SpanTraced)  # the demand changed
    declared = bus.declare_decision_steps(every=4)
    assert rang() and port.next_decision(0) == 4  # a decision steps
    bus.send(cmd.StopEpoch())
    assert rang() and port.has_commands()  # a command
    declared.dispose()
    sub.dispose()
    assert rang() and not port.wants(ev.SpanTraced) and port.next_decision(0) is None


def test_a_subscription_made_mid_run_is_heard_at_the_next_step() -> None:
    # The loop re-reads its demand only when the doorbell rang: a subscription to an event
    # nobody wanted, made by a subscriber at a barrier, gets the later steps' events.
    model = tiny_model()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05), tiny_loader(8, 8),
                      loss_fn=F.cross_entropy, max_epochs=2, on_signal=None,
                      progress=False, trace={"forward"})  # fmt: skip
    bus = trainer.bus
    forwards: list[int] = []

    def at_epoch_end(e: ev.EpochEnded) -> None:
        if e.epoch == 0:
            bus.stream(ev.SpanTraced).subscribe(lambda f: forwards.append(f.step))

    bus.stream(ev.EpochEnded).subscribe(at_epoch_end)  # a barrier: delivered before epoch 1
    result = trainer.fit_sync()
    assert result.steps == 16
    assert sorted(set(forwards)) == list(range(8, 16))  # every step of epoch 1, none before


# ---------------------------------------------------------------------------- on_error
def test_on_error_is_the_policy_on_a_bus_chain_too() -> None:
    bus = EventBus()

    def boom(e: ev.BaseEvent) -> None:
        raise RuntimeError("boom")

    sub = bus.stream(ev.StepEnded).subscribe(boom, on_error="raise", name="fatal")
    bus.publish(_step(1))
    bus.flush()
    assert isinstance(bus.port().failure, RuntimeError) and sub.statistics().failed == 1


def test_rxpy_error_callback_is_on_rx_error_or_the_positional_slot() -> None:
    bus = EventBus()

    def fails(e: ev.StepEnded) -> int:
        raise ZeroDivisionError("in map")

    by_keyword: list[Exception] = []
    by_position: list[Exception] = []
    chain = bus.stream(ev.StepEnded).pipe(ops.map(fails))
    chain.subscribe(lambda x: None, on_rx_error=by_keyword.append)
    chain.subscribe(lambda x: None, by_position.append)  # RxPY's own signature
    bus.publish(_step(1))
    bus.flush()
    assert [str(e) for e in by_keyword] == [str(e) for e in by_position] == ["in map"]


def test_reactivex_operators_subscribe_to_bus_chains_with_their_positional_callbacks() -> None:
    bus = EventBus()
    got: list[str] = []
    merged = reactivex.merge(bus.stream(ev.StepEnded), bus.stream(ev.EpochEnded))
    bus.subscribe(merged, lambda e: got.append(type(e).__name__))
    bus.publish(_step(1))
    bus.publish(ev.EpochEnded(step=1, epoch=0, batches=1))
    bus.flush()
    assert got == ["StepEnded", "EpochEnded"]


def test_the_error_policy_of_a_chain_is_spelt_on_error_only() -> None:
    bus = EventBus()
    with pytest.raises(TypeError, match="'policy'"):
        bus.stream(ev.StepEnded).subscribe(print, policy="raise")  # type: ignore[call-arg]
    assert bus.subscriptions == ()


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda b: b.events.subscribe(print, "raise"), "on_rx_error"),  # a policy in Rx' slot
        (lambda b: b.events.subscribe(print, on_rx_error=3), "on_rx_error"),
        (lambda b: b.events.subscribe(print, on_error="ignore"), "on_error"),
        (lambda b: b.subscribe(b.events, print, on_error=print), "on_error"),
    ],
)
def test_bad_error_arguments_name_their_field(call: Any, field: str) -> None:
    bus = EventBus()
    with pytest.raises(ConfigError, match=rf"^{field}="):
        call(bus)
    assert bus.subscriptions == ()


def test_the_scheduler_s_failure_callback_is_spelt_on_failure_only() -> None:
    # on_error is an error policy everywhere in trainbus; the scheduler takes a callback.
    with pytest.raises(TypeError, match="'on_error'"):
        AnyioScheduler(on_error=print)  # type: ignore[call-arg]

"""The step clock: commands decided at declared decision steps take effect at exactly that step.

Covers ``StepClock`` itself, the ``decided_at`` stamp, schedules declared by
``tbops.every`` / ``tbops.once(at=k)`` / ``bus.decides``, the loop's barrier at a decision step,
the de-duplicated ``SaveCheckpoint``, and derived events delivered right after their cause.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread
import pytest
import torch
import torch.nn.functional as F
from reactivex import operators as ops
from structlog.testing import capture_logs

from trainbus import ConfigError, EventBus, Trainer
from trainbus import commands as cmd
from trainbus import events as ev
from trainbus import operators as tbops
from trainbus._bus.commands import At, Doorbell, Every, StepClock
from trainbus.callbacks import Checkpointing
from trainbus.testing import EventRecorder, tiny_loader, tiny_model


def build_step(i: int) -> ev.StepEnded:
    return ev.StepEnded(step=i, epoch=0, loss=1.0, lr=0.1, grad_norm=None, samples=1, duration_s=0)


# ---------------------------------------------------------------------------- StepClock
def test_next_decision_is_the_smallest_declared_step_after() -> None:
    clock = StepClock(Doorbell())
    assert clock.next_decision(0) is None
    clock.declare(Every(20), Every(25), At(7))
    assert [clock.next_decision(k) for k in (0, 6, 7, 19, 20, 24, 25, 49, 50)] == [
        7, 7, 20, 20, 25, 25, 40, 50, 60,
    ]  # fmt: skip


def test_declaring_or_removing_a_schedule_rings_the_doorbell() -> None:
    bell = Doorbell()
    clock = StepClock(bell)
    tens = clock.declare(Every(10))
    other = clock.declare(At(15))
    assert bell.rings == 2 and clock.next_decision(10) == 15
    other.dispose()
    assert bell.rings == 3 and clock.next_decision(10) == 20
    tens.dispose()
    tens.dispose()  # idempotent
    assert clock.next_decision(10) is None and clock.decision_steps == ()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"every": 0}, "every"),
        ({"every": 1.5}, "every"),
        ({"at": -1}, "at"),
        ({"at": [3, True]}, "at"),
    ],
)
def test_declared_decision_steps_reject_bad_steps(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{field}="):
        EventBus().declare_decision_steps(**kwargs)


@pytest.mark.asyncio
async def test_subscribing_a_scheduled_pipeline_declares_it_for_its_lifetime() -> None:
    async with EventBus() as bus:
        sub = (
            bus.stream(ev.StepEnded)
            .pipe(tbops.every(20), ops.map(lambda e: e.step))
            .subscribe(lambda _: None)
        )
        asub = bus.subscribe_async(
            bus.stream(ev.StepEnded).pipe(tbops.once(at=7)), _noop, decides=True
        )
        port = bus.port()
        assert set(port.decision_steps) == {Every(20), At(7)}
        assert port.next_decision(7) == 20
        rings = port.doorbell.rings
        handle = bus.declare_decision_steps(every=3, at=[4, 5])
        assert port.doorbell.rings != rings  # the loop re-reads its decision step
        assert port.next_decision(0) == 3
        handle.dispose()
        sub.dispose()
        asub.dispose()
        assert port.decision_steps == ()
        with pytest.raises(ConfigError):
            bus.declare_decision_steps()


@pytest.mark.asyncio
async def test_a_stream_without_per_step_events_declares_nothing() -> None:
    async with EventBus() as bus:
        bus.stream(ev.EpochEnded).pipe(tbops.every(2)).subscribe(lambda _: None)
        bus.stream(ev.EvaluationEnded, ev.StepEnded).pipe(tbops.every(3)).subscribe(lambda _: None)
        bus.events.pipe(tbops.every(5)).subscribe(lambda _: None)
        assert bus.port().decision_steps == (Every(3), Every(5))


async def _noop(_: Any) -> None:
    return None


# ---------------------------------------------------------------------------- decided_at
@pytest.mark.asyncio
async def test_decided_at_is_the_step_of_the_event_being_handled() -> None:
    async with EventBus() as bus:
        sent_async = anyio.Event()

        def sync(e: ev.StepEnded) -> None:
            bus.send(cmd.StopEpoch())

        async def on_async(e: ev.StepEnded) -> None:
            await anyio.lowlevel.checkpoint()
            bus.send(cmd.Evaluate())
            sent_async.set()

        bus.subscribe(bus.stream(ev.StepEnded), sync)
        bus.subscribe_async(bus.stream(ev.StepEnded), on_async)
        bus.publish(build_step(12))
        await bus.wait_delivered(timeout=5)
        await sent_async.wait()
        # Another thread, and the test itself: nothing being handled -> None.
        await anyio.to_thread.run_sync(lambda: bus.send(cmd.StopTraining()))
        bus.send(cmd.SaveCheckpoint(tag="x"))
        own = cmd.SetLearningRate(lr=0.5, decided_at=3)
        bus.send(own)
        got = {type(c): c for c in bus.port().poll_commands()}
    assert got[cmd.StopEpoch].decided_at == 12
    assert got[cmd.Evaluate].decided_at == 12
    assert got[cmd.StopTraining].decided_at is None
    assert got[cmd.SaveCheckpoint].decided_at is None
    assert got[cmd.SetLearningRate] is own  # stamped by the sender: kept as it is


def test_a_thread_sending_during_a_dispatch_is_not_stamped() -> None:
    # The dispatch's step belongs to the loop thread only.
    bus = EventBus()
    seen: list[cmd.Command] = []

    def during(e: ev.StepEnded) -> None:
        t = threading.Thread(target=lambda: bus.send(cmd.StopEpoch()))
        t.start()
        t.join()
        seen.extend(bus.port().poll_commands())

    bus.subscribe(bus.stream(ev.StepEnded), during)
    bus.publish(build_step(5))
    bus.flush()
    assert [c.decided_at for c in seen] == [None]


# ---------------------------------------------------------------------------- derived events
def test_derived_events_are_delivered_right_after_their_cause() -> None:
    bus = EventBus()
    order: list[str] = []

    def derive(e: ev.StepEnded) -> None:
        bus.publish(ev.EpochStarted(step=e.step, epoch=0))  # a derived event

    def derive_again(e: ev.EpochStarted) -> None:
        bus.publish(ev.EpochEnded(step=e.step, epoch=0, batches=1))

    bus.subscribe(bus.stream(ev.StepEnded), derive)
    bus.subscribe(bus.stream(ev.EpochStarted), derive_again)
    bus.subscribe(bus.events, lambda e: order.append(f"{type(e).__name__}:{e.step}"))
    bus.publish(build_step(1))
    bus.publish(build_step(2))
    bus.publish(ev.FitEnded(step=2, epoch=0, reason="completed"))
    bus.flush()
    assert order == [
        "StepEnded:1", "EpochStarted:1", "EpochEnded:1",
        "StepEnded:2", "EpochStarted:2", "EpochEnded:2",
        "FitEnded:2",
    ]  # fmt: skip
    assert bus.statistics().delivered == 7 and len(order) == 7


# ---------------------------------------------------------------------------- the loop
def _trainer(tmp_path: Path | None = None, **kwargs: Any) -> Trainer:
    model = tiny_model()
    kwargs.setdefault("on_signal", None)
    return Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.05),
        tiny_loader(200, 4),
        loss_fn=F.cross_entropy,
        checkpoint_dir=tmp_path,
        **kwargs,
    )


def _slow_subscriber(trainer: Trainer) -> None:
    def busy(_: ev.StepEnded) -> None:
        time.sleep(0.001)  # 1 ms per StepEnded: delivery lags several steps

    trainer.bus.subscribe(trainer.bus.stream(ev.StepEnded), busy)


def _saves(rec: EventRecorder) -> list[tuple[int, str | None]]:
    return [(e.step, e.tag) for e in rec.of_type(ev.CheckpointSaved)]


@pytest.mark.parametrize("run", [1, 2])
def test_checkpointing_every_steps_saves_at_exactly_the_multiples(tmp_path: Path, run: int) -> None:
    trainer = _trainer(tmp_path, max_steps=150, callbacks=[
        Checkpointing(every_steps=25, every_epochs=None)])  # fmt: skip
    _slow_subscriber(trainer)
    rec = EventRecorder(trainer.bus)
    trainer.fit_sync()
    assert _saves(rec) == [(k, None) for k in range(25, 151, 25)]  # no duplicate final save
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f"step-{k:08d}.pt" for k in range(25, 151, 25)
    ]


@pytest.mark.parametrize("run", [1, 2])
def test_every_pipeline_sending_save_applies_at_the_decided_step(tmp_path: Path, run: int) -> None:
    trainer = _trainer(tmp_path, max_steps=150)
    bus = trainer.bus
    _slow_subscriber(trainer)
    bus.stream(ev.StepEnded).pipe(tbops.every(20)).subscribe(
        lambda e: bus.send(cmd.SaveCheckpoint())
    )
    rec = EventRecorder(bus)
    trainer.fit_sync()
    assert _saves(rec) == [*((k, None) for k in range(20, 141, 20)), (150, "final")]
    applied = [
        e for e in rec.of_type(ev.CommandApplied) if isinstance(e.command, cmd.SaveCheckpoint)
    ]
    assert [a.step for a in applied] == list(range(20, 141, 20))
    assert all(a.step == a.command.decided_at for a in applied)


@pytest.mark.parametrize("run", [1, 2])
def test_async_decision_on_a_declared_step_stops_at_that_step(run: int) -> None:
    trainer = _trainer(max_steps=200)
    bus = trainer.bus

    async def decide(e: ev.StepEnded) -> None:
        await anyio.sleep(0.02)  # slower than several steps
        if e.step == 30:
            bus.send(cmd.StopTraining(reason="enough"))

    bus.subscribe_async(bus.stream(ev.StepEnded).pipe(tbops.every(10)), decide, decides=True)
    rec = EventRecorder(bus)
    result = trainer.fit_sync()
    assert (result.reason, result.steps, result.stop_reason) == ("stopped", 30, "enough")
    (applied,) = rec.of_type(ev.CommandApplied)
    assert applied.step == applied.command.decided_at == 30


def test_a_slow_async_subscriber_that_does_not_decide_is_never_waited_for() -> None:
    """A slow uploader piped through ``tbops.every(n)`` declares nothing (``decides=False``),
    and a decision step declared by someone else does not wait for it either. The upload
    blocks until the run has ended: a barrier that waited for it would time out (and log
    ``barrier_timeout``) at every decision step."""
    trainer = _trainer(max_steps=40, bus=EventBus(barrier_timeout=0.2))
    bus = trainer.bus
    run_over = anyio.Event()
    handled: list[int] = []

    async def upload(e: ev.StepEnded) -> None:
        await run_over.wait()
        handled.append(e.step)

    bus.stream(ev.FitEnded).subscribe(lambda _: run_over.set())
    bus.subscribe_async(bus.stream(ev.StepEnded).pipe(tbops.every(4)), upload, overflow="latest")
    bus.declare_decision_steps(
        every=4
    )  # decision steps at 4, 8, ...: the uploader is not a decider
    assert bus.port().decision_steps == (Every(4),)  # only the explicit declaration
    with capture_logs() as logs:
        result = trainer.fit_sync()
    assert result.steps == 40
    assert not [entry for entry in logs if entry["event"] == "barrier_timeout"]
    assert handled  # the uploads ran, after the run, off the training thread


def test_bus_decides_makes_a_merged_pipeline_deterministic(tmp_path: Path) -> None:
    trainer = _trainer(max_steps=60)
    bus = trainer.bus
    _slow_subscriber(trainer)
    bus.declare_decision_steps(at=[17, 40])

    def on_step(e: ev.StepEnded) -> None:
        if e.step in (17, 40):
            bus.send(cmd.SetLearningRate(lr=0.01 * e.step))

    # A plain filter declares nothing: bus.declare_decision_steps() did.
    bus.stream(ev.StepEnded).pipe(ops.filter(lambda e: e.step in (17, 40))).subscribe(on_step)
    rec = EventRecorder(bus)
    trainer.fit_sync()
    assert [(a.step, a.command.decided_at) for a in rec.of_type(ev.CommandApplied)] == [
        (17, 17), (40, 40)]  # fmt: skip


@pytest.mark.asyncio
async def test_two_saves_at_one_step_write_one_checkpoint(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, max_steps=8)
    bus = trainer.bus
    answers: list[Any] = []

    async def ask(_: ev.StepEnded) -> None:
        async with anyio.create_task_group() as tg:
            for _i in range(2):
                tg.start_soon(lambda: _append(answers, bus.request(cmd.SaveCheckpoint())))

    bus.subscribe_async(bus.stream(ev.StepEnded).pipe(tbops.once(at=4)), ask, decides=True)
    rec = EventRecorder(bus)
    await trainer.fit()
    (first, second) = answers
    assert isinstance(first, ev.CheckpointSaved) and first is second and first.step == 4
    assert _saves(rec) == [(4, None), (8, "final")]
    acks = [e for e in rec.of_type(ev.CommandApplied) if isinstance(e.command, cmd.SaveCheckpoint)]
    assert len(acks) == 2 and all(a.result is first for a in acks)
    files = await anyio.to_thread.run_sync(lambda: sorted(p.name for p in tmp_path.iterdir()))
    assert files == ["step-00000004.pt", "step-00000008-final.pt"]


async def _append(out: list[Any], awaitable: Any) -> None:
    out.append(await awaitable)


@pytest.mark.parametrize("declared", [True, False])
def test_an_async_judge_of_every_step_sees_each_step_and_stops_where_it_judged(
    declared: bool,
) -> None:
    """An ``async def`` judge slower than the steps, made a decider: its buffer blocks instead
    of dropping (the default for a decider), so the event it stops on is never lost; with
    decision steps declared at every step the stop lands on the step it judged."""
    trainer = _trainer(max_steps=200)
    bus = trainer.bus
    judged: list[int] = []

    async def judge(e: ev.StepEnded) -> None:
        await anyio.sleep(0.002)  # a service's round trip
        judged.append(e.step)
        if e.step == 37:
            bus.send(cmd.StopTraining(reason="enough"))

    sub = bus.subscribe_async(bus.stream(ev.StepEnded), judge, decides=True)
    if declared:
        bus.declare_decision_steps(every=1)
    result = trainer.fit_sync()
    assert sub.statistics().dropped == 0
    assert judged[:37] == list(range(1, 38))
    assert result.stop_reason == "enough"
    if declared:
        assert result.steps == 37
    else:
        # At the first poll point that finds it queued: later, never lost. How much later is
        # the machine's: a busy event loop hands the judge its events late (the hand-off queue
        # holds up to max_queue), so training may even finish first; the stop is still applied
        # and reported.
        assert 37 <= result.steps <= 200
        assert result.reason == "stopped"


def test_a_deciders_stop_that_arrives_after_the_last_step_is_still_applied_and_reported() -> None:
    """The shape a busy machine makes: the event loop is held (here by a sync subscriber)
    until training has run its last step, so the decider judges every step after the fact.
    Its stop is not lost: the run reports it."""
    trainer = _trainer(max_steps=60)
    bus = trainer.bus
    last_step_done = threading.Event()

    def after_step(ctx: Any) -> None:
        if ctx.step == 60:  # the last update has landed
            last_step_done.set()

    trainer.add_hook("after_optimizer_step", after_step)
    bus.subscribe(bus.stream(ev.FitStarted), lambda _: last_step_done.wait(30))
    judged: list[int] = []

    async def judge(e: ev.StepEnded) -> None:
        judged.append(e.step)
        if e.step == 37:
            bus.send(cmd.StopTraining(reason="enough"))

    bus.subscribe_async(bus.stream(ev.StepEnded), judge, decides=True)
    result = trainer.fit_sync()
    assert last_step_done.is_set()
    assert judged == list(range(1, 61))
    assert result.steps == 60
    assert (result.reason, result.stop_reason) == ("stopped", "enough")


def test_a_deciders_overflow_defaults_to_block_and_stays_what_it_was_given() -> None:
    bus = EventBus()

    async def fn(_: object) -> None:
        return None

    assert bus.subscribe_async(bus.events, fn, decides=True).overflow == "block"
    assert bus.subscribe_async(bus.events, fn).overflow == "drop_oldest"
    assert bus.subscribe_async(bus.events, fn, decides=True, overflow="latest").overflow == "latest"

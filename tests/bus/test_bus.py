"""The event bus: tests that would catch a wrong bus.

Stream timing runs in virtual time (``EventBus(rx_scheduler=VirtualTimeScheduler())`` +
``bus.flush()`` + ``advance_by``); asynchronous behaviour waits on anyio events or on a state
the bus reaches (``wait_until``), never on a measured duration.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import reactivex
import torch
import torch.nn.functional as F
from reactivex import operators as ops
from structlog.testing import capture_logs

from trainbus import ConfigError, EventBus, Trainer
from trainbus import commands as cmd
from trainbus import events as ev
from trainbus import operators as tbops
from trainbus.bus import AnyioScheduler, BusClosedError, CommandError
from trainbus.testing import EventRecorder, VirtualTimeScheduler, tiny_loader, tiny_model


def steps_of(items: list[Any]) -> list[int]:
    return [e.step for e in items]


def publish_range(
    bus: EventBus, make: Callable[[int], ev.BaseEvent], start: int, stop: int
) -> None:
    for i in range(start, stop):
        bus.publish(make(i))


class Stalled:
    """An async subscriber that holds every item until ``release`` is set."""

    def __init__(self) -> None:
        self.release = anyio.Event()
        self.first = anyio.Event()
        self.started: list[int] = []
        self.done: list[int] = []

    async def __call__(self, e: ev.StepEnded) -> None:
        self.started.append(e.step)
        self.first.set()
        await self.release.wait()
        self.done.append(e.step)


# ============================================================================ virtual time
def test_throttle_first_uses_the_bus_scheduler(vbus: EventBus, vts, step_event) -> None:
    got: list[int] = []
    vbus.stream(ev.StepEnded).pipe(ops.throttle_first(1.0)).subscribe(lambda e: got.append(e.step))
    publish_range(vbus, step_event, 0, 3)  # t=0
    vbus.flush()
    vts.advance_by(0.5)
    vbus.publish(step_event(3))  # t=0.5: inside the window
    vbus.flush()
    vts.advance_by(0.6)
    publish_range(vbus, step_event, 4, 6)  # t=1.1: a new window
    vbus.flush()
    vts.advance_by(1.0)
    vbus.publish(step_event(6))  # t=2.1
    vbus.flush()
    # On the wall clock all of this happens within one window: only [0] would pass.
    assert got == [0, 4, 6]


def test_buffer_with_time_uses_the_bus_scheduler(vbus: EventBus, vts, step_event) -> None:
    buffers: list[list[int]] = []
    vbus.stream(ev.StepEnded).pipe(ops.buffer_with_time(1.0)).subscribe(
        lambda b: buffers.append(steps_of(b))
    )
    publish_range(vbus, step_event, 0, 2)
    vbus.flush()
    vts.advance_by(0.5)
    vbus.publish(step_event(2))
    vbus.flush()
    assert buffers == []
    vts.advance_by(0.5)
    assert buffers == [[0, 1, 2]]
    vbus.publish(step_event(3))
    vbus.flush()
    vts.advance_by(1.0)
    assert buffers == [[0, 1, 2], [3]]
    vts.advance_by(1.0)
    assert buffers == [[0, 1, 2], [3], []]


def test_bus_subscribe_hands_its_scheduler_to_any_observable(
    vbus: EventBus, vts, make_event
) -> None:
    got: list[list[str]] = []
    merged = reactivex.merge(vbus.stream(ev.EpochStarted), vbus.stream(ev.EpochEnded))
    vbus.subscribe(
        merged.pipe(ops.buffer_with_time(2.0)), lambda b: got.append([type(e).__name__ for e in b])
    )
    vbus.publish(make_event(ev.EpochStarted))
    vbus.publish(make_event(ev.StepEnded))
    vbus.publish(make_event(ev.EpochEnded))
    vbus.flush()
    vts.advance_by(2.0)
    assert got == [["EpochStarted", "EpochEnded"]]


def test_explicit_scheduler_overrides_the_bus_scheduler(vbus: EventBus, vts, step_event) -> None:
    other = VirtualTimeScheduler()
    got: list[list[int]] = []
    vbus.stream(ev.StepEnded).pipe(ops.buffer_with_time(1.0)).subscribe(
        lambda b: got.append(steps_of(b)), scheduler=other
    )
    vbus.publish(step_event(1))
    vbus.flush()
    vts.advance_by(5.0)
    assert got == []
    other.advance_by(1.0)
    assert got == [[1]]


@pytest.mark.asyncio
async def test_async_subscription_gets_the_bus_scheduler(step_event, wait_until) -> None:
    vts = VirtualTimeScheduler()
    bus = EventBus(rx_scheduler=vts, flush_interval=0.001)
    got: list[list[int]] = []

    async def on_buffer(b: list[ev.StepEnded]) -> None:
        got.append(steps_of(b))

    bus.subscribe_async(bus.stream(ev.StepEnded).pipe(ops.buffer_with_time(1.0)), on_buffer)
    async with bus:
        publish_range(bus, step_event, 0, 3)
        bus.flush()
        vts.advance_by(1.0)
        await wait_until(lambda: len(got) == 1)
        assert got == [[0, 1, 2]]


@pytest.mark.asyncio
async def test_time_operators_run_on_the_loop_thread(step_event, wait_until) -> None:
    # No scheduler given: the bus' AnyioScheduler runs the timers, not RxPY's TimeoutScheduler
    # (a threading.Timer per action, which would call the subscriber on a timer thread).
    bus = EventBus(flush_interval=0.001)
    assert isinstance(bus.rx_scheduler, AnyioScheduler)
    threads: set[int] = set()
    buffered: list[int] = []
    debounced: list[int] = []

    def on_buffer(b: list[ev.StepEnded]) -> None:
        threads.add(threading.get_ident())
        buffered.extend(steps_of(b))

    def on_debounced(e: ev.StepEnded) -> None:
        threads.add(threading.get_ident())
        debounced.append(e.step)

    bus.stream(ev.StepEnded).pipe(ops.buffer_with_time(0.01)).subscribe(on_buffer)
    bus.stream(ev.StepEnded).pipe(ops.debounce(0.005)).subscribe(on_debounced)
    async with bus:
        await anyio.to_thread.run_sync(publish_range, bus, step_event, 0, 5)
        await wait_until(lambda: len(buffered) == 5 and debounced[-1:] == [4])
    assert threads == {threading.get_ident()}
    assert buffered == [0, 1, 2, 3, 4]


# ============================================================================ trio
def test_end_to_end_under_trio(step_event) -> None:
    n = 2_000
    sync_seen: list[int] = []
    async_seen: list[int] = []
    buffered: list[int] = []
    threads: set[int] = set()

    async def main() -> EventBus:
        bus = EventBus(flush_interval=0.002)

        def on_step(e: ev.StepEnded) -> None:
            threads.add(threading.get_ident())
            sync_seen.append(e.step)

        async def on_step_async(e: ev.StepEnded) -> None:
            threads.add(threading.get_ident())
            await anyio.lowlevel.checkpoint()
            async_seen.append(e.step)

        bus.stream(ev.StepEnded).subscribe(on_step)
        bus.subscribe_async(bus.stream(ev.StepEnded), on_step_async, buffer=8, overflow="block")
        bus.stream(ev.StepEnded).pipe(ops.buffer_with_time(0.01)).subscribe(
            lambda b: buffered.extend(steps_of(b))
        )
        async with bus:
            loop_thread = threading.get_ident()
            await anyio.to_thread.run_sync(publish_range, bus, step_event, 0, n)
            # No waiting here: closing the bus delivers everything and awaits the async worker.
        assert threads == {loop_thread}
        return bus

    bus = anyio.run(main, backend="trio")
    expected = list(range(n))
    assert sync_seen == expected and async_seen == expected and buffered == expected
    stats = bus.statistics()
    assert stats.published == stats.delivered == n
    assert stats.failed == stats.dropped == stats.cancelled == 0


def test_request_under_trio(make_event) -> None:
    async def main() -> ev.BaseEvent:
        async with EventBus(flush_interval=0.002) as bus, anyio.create_task_group() as tg:

            async def fake_loop() -> None:  # the training loop polls; it has no event to await
                while not (commands := bus.port().poll_commands()):  # noqa: ASYNC110
                    await anyio.sleep(0.001)
                (c,) = commands
                saved = make_event(ev.CheckpointSaved)
                bus.publish(ev.CommandApplied(step=1, epoch=0, command=c, result=saved))

            tg.start_soon(fake_loop)
            return await bus.request(cmd.SaveCheckpoint())

    result = anyio.run(main, backend="trio")
    assert isinstance(result, ev.CheckpointSaved)


# ============================================================================ volume
@pytest.mark.asyncio
async def test_100k_events_from_a_worker_thread_all_delivered_in_order() -> None:
    n = 100_000
    seen: list[int] = []
    bus = EventBus()
    bus.stream(ev.EpochStarted).subscribe(lambda e: seen.append(e.step))

    def training_thread() -> None:
        publish = bus.publish
        for i in range(n):
            publish(ev.EpochStarted(step=i, epoch=0))

    async with bus:
        await anyio.to_thread.run_sync(training_thread)
    # Everything published before the block closed was delivered when it closed.
    assert len(seen) == n and seen == list(range(n))
    stats = bus.statistics()
    assert stats.published == stats.delivered == n and stats.queue_depth == 0


@pytest.mark.asyncio
async def test_publish_from_the_loop_thread_never_waits(step_event) -> None:
    seen: list[int] = []
    bus = EventBus(max_queue=2, flush_interval=0.001)
    bus.stream(ev.StepEnded).subscribe(lambda e: seen.append(e.step))
    async with bus:
        publish_range(bus, step_event, 0, 10)  # 8 over max_queue: must not block the loop
        assert bus.statistics().queue_depth == 10
    assert seen == list(range(10))
    assert bus.statistics().publisher_waits == 0


# ============================================================================ failures
@pytest.mark.asyncio
async def test_failing_subscribers_are_isolated_and_counted(step_event) -> None:
    n = 200
    before: list[int] = []
    after: list[int] = []

    def bad(e: ev.StepEnded) -> None:
        raise RuntimeError(f"bad {e.step}")

    async def bad_async(e: ev.StepEnded) -> None:
        raise ValueError(f"bad async {e.step}")

    bus = EventBus(flush_interval=0.001)
    bus.stream(ev.StepEnded).subscribe(lambda e: before.append(e.step))
    bad_sub = bus.stream(ev.StepEnded).subscribe(bad, name="bad")
    bad_async_sub = bus.subscribe_async(bus.stream(ev.StepEnded), bad_async, overflow="block")
    bus.events.subscribe(lambda e: after.append(e.step))
    async with bus:
        await anyio.to_thread.run_sync(publish_range, bus, step_event, 0, n)
        await bus.wait_delivered(timeout=30)
        assert bad_sub.statistics().active  # failing on every event does not detach it
    assert before == after == list(range(n))
    s = bad_sub.statistics()
    assert (s.name, s.received, s.completed, s.failed) == ("bad", n, n, n)
    assert s.last_error == repr(RuntimeError(f"bad {n - 1}"))
    a = bad_async_sub.statistics()
    assert (a.kind, a.received, a.completed, a.failed) == ("async", n, n, n)
    assert bus.statistics().failed == 2 * n
    assert bus.port().poll_commands() == []  # policy "log" sends nothing
    assert bus.port().failure is None


def test_stop_policy_sends_one_stop_training(vbus: EventBus, step_event) -> None:
    def bad(e: ev.StepEnded) -> None:
        raise RuntimeError("nope")

    sub = vbus.stream(ev.StepEnded).subscribe(bad, on_error="stop", name="guard")
    publish_range(vbus, step_event, 0, 5)
    vbus.flush()
    (command,) = vbus.port().poll_commands()
    assert isinstance(command, cmd.StopTraining) and "guard" in command.reason
    assert sub.statistics().failed == 5


@pytest.mark.asyncio
async def test_stop_policy_by_bus_default_and_for_async(step_event, wait_until) -> None:
    bus = EventBus(on_error="stop", flush_interval=0.001)

    async def bad(e: ev.StepEnded) -> None:
        raise RuntimeError("nope")

    sub = bus.subscribe_async(bus.stream(ev.StepEnded), bad, name="async-guard")
    async with bus:
        publish_range(bus, step_event, 0, 3)
        await wait_until(lambda: sub.statistics().failed == 3)
        (command,) = bus.port().poll_commands()
    assert isinstance(command, cmd.StopTraining) and "async-guard" in command.reason


@pytest.mark.asyncio
async def test_raise_policy_fails_the_bus_on_close(step_event) -> None:
    seen: list[int] = []

    def bad(e: ev.StepEnded) -> None:
        raise RuntimeError("fatal")

    bus = EventBus(flush_interval=0.001)
    bus.stream(ev.StepEnded).subscribe(bad, on_error="raise", name="fatal-sub")
    bus.stream(ev.StepEnded).subscribe(lambda e: seen.append(e.step))
    with pytest.raises(RuntimeError, match="fatal") as exc_info:
        async with bus:
            publish_range(bus, step_event, 0, 3)
    assert "subscriber 'fatal-sub'" in exc_info.value.__notes__[-1]
    assert bus.port().failure is exc_info.value
    assert seen == [0, 1, 2]  # the others still received everything


@pytest.mark.asyncio
async def test_raise_policy_does_not_mask_the_body_exception(step_event) -> None:
    bus = EventBus(on_error="raise", flush_interval=0.001)
    bus.stream(ev.StepEnded).subscribe(lambda e: 1 / 0)
    with pytest.raises(KeyError):
        async with bus:
            bus.publish(step_event(1))
            bus.flush()
            raise KeyError("body")
    assert isinstance(bus.port().failure, ZeroDivisionError)


def test_operator_error_ends_only_that_subscription(vbus: EventBus, step_event) -> None:
    def mapper(e: ev.StepEnded) -> int:
        if e.step == 2:
            raise ZeroDivisionError("in map")
        return e.step

    mapped: list[int] = []
    errors: list[Exception] = []
    other: list[int] = []
    sub = vbus.stream(ev.StepEnded).pipe(ops.map(mapper)).subscribe(mapped.append)
    with_cb = (
        vbus.stream(ev.StepEnded)
        .pipe(ops.map(mapper))
        .subscribe(lambda x: None, on_rx_error=errors.append)
    )
    other_sub = vbus.stream(ev.StepEnded).subscribe(lambda e: other.append(e.step))
    publish_range(vbus, step_event, 0, 5)
    vbus.flush()
    assert mapped == [0, 1]
    assert other == [0, 1, 2, 3, 4]
    s = sub.statistics()
    assert not s.active and s.failed == 1 and "in map" in (s.last_error or "")
    assert [str(e) for e in errors] == ["in map"]
    assert with_cb.statistics().failed == 1 and not with_cb.statistics().active
    assert vbus.statistics().failed == 2
    # The ended chains left the routing table: only `other` still wants StepEnded.
    other_sub.dispose()
    assert not vbus.wants(ev.StepEnded)


def test_chain_subscribed_outside_the_guard_is_still_isolated(vbus: EventBus, step_event) -> None:
    # A merge subscribes to bus streams through their guarded subscribe; RxPY's own subscribe,
    # called past the bus' override, has no guard: its observer's exception reaches the dispatch.
    merged = reactivex.merge(vbus.stream(ev.StepEnded), vbus.stream(ev.EpochStarted))
    merged.subscribe(lambda e: 1 / 0)
    reactivex.Observable.subscribe(vbus.stream(ev.StepEnded), lambda e: 1 / 0)
    seen: list[int] = []
    vbus.stream(ev.StepEnded).subscribe(lambda e: seen.append(e.step))
    publish_range(vbus, step_event, 0, 3)
    vbus.flush()
    assert seen == [0, 1, 2]
    assert vbus.statistics().failed == 6
    assert vbus.statistics().delivered == 3


# ============================================================================ overflow
async def stall_then_publish(
    bus: EventBus, fn: Stalled, make: Callable[[int], ev.BaseEvent], n: int
) -> None:
    """Get the single worker stuck on event 0, then publish 1..n from a worker thread."""
    bus.publish(make(0))
    with anyio.fail_after(10):
        await fn.first.wait()
    await anyio.to_thread.run_sync(publish_range, bus, make, 1, n + 1)


def sample_depth(bus: EventBus, sub: Any) -> list[int]:
    """A sync subscriber after ``sub``: the depth of ``sub``'s buffer after each push."""
    depth: list[int] = []
    bus.stream(ev.StepEnded).subscribe(lambda e: depth.append(sub.statistics().queued))
    return depth


@pytest.mark.asyncio
async def test_overflow_drop_oldest(step_event, wait_until) -> None:
    bus = EventBus(flush_interval=0.001)
    fn = Stalled()
    sub = bus.subscribe_async(bus.stream(ev.StepEnded), fn, buffer=4, overflow="drop_oldest")
    depth = sample_depth(bus, sub)
    async with bus:
        await stall_then_publish(bus, fn, step_event, 20)
        await wait_until(lambda: sub.statistics().received == 21)
        s = sub.statistics()
        assert (s.dropped, s.queued, s.in_flight) == (16, 4, 1)
        assert max(depth) <= 4
        fn.release.set()
    assert fn.done == [0, 17, 18, 19, 20]  # the oldest were dropped, the rest kept in order
    assert sub.statistics().dropped == bus.statistics().dropped == 16
    assert sub.statistics().completed == 5


@pytest.mark.asyncio
async def test_overflow_latest(step_event, wait_until) -> None:
    bus = EventBus(flush_interval=0.001)
    fn = Stalled()
    sub = bus.subscribe_async(bus.stream(ev.StepEnded), fn, overflow="latest")
    assert sub.capacity == 1
    depth = sample_depth(bus, sub)
    async with bus:
        await stall_then_publish(bus, fn, step_event, 20)
        await wait_until(lambda: sub.statistics().received == 21)
        assert sub.statistics().dropped == 19
        assert max(depth) <= 1
        fn.release.set()
    assert fn.done == [0, 20]
    assert bus.statistics().dropped == 19


@pytest.mark.asyncio
async def test_overflow_block_drops_nothing_and_never_holds_dispatch(
    step_event, wait_until
) -> None:
    bus = EventBus(flush_interval=0.001)
    fn = Stalled()
    sub = bus.subscribe_async(bus.stream(ev.StepEnded), fn, buffer=4, overflow="block")
    depth = sample_depth(bus, sub)
    async with bus:
        assert not bus.port().held
        await stall_then_publish(bus, fn, step_event, 50)
        # The dispatcher never waits for the full buffer: every event was dispatched (the sync
        # subscriber after it saw all 51), the buffer took them all, and the bus is "held".
        await wait_until(lambda: len(depth) == 51)
        assert bus.statistics().queue_depth == 0
        assert sub.statistics().queued == 50 and bus.port().held
        fn.release.set()
        await wait_until(lambda: not bus.port().held)
    assert fn.done == list(range(51))
    assert depth == [1, *range(1, 51)]  # 0 was still queued when sampled
    assert sub.statistics().dropped == bus.statistics().dropped == 0


@pytest.mark.asyncio
async def test_overflow_block_holds_a_thread_that_waits_for_room(step_event, wait_until) -> None:
    """``wait_for_room`` (what the training loop calls at its poll points) blocks its thread
    while the "block" buffer is over capacity, charges the wait to the subscription, and warns
    once, naming it with its rates and the remedies."""
    bus = EventBus(flush_interval=0.001)
    fn = Stalled()
    sub = bus.subscribe_async(bus.stream(ev.StepEnded), fn, buffer=2, overflow="block",
                              name="uploader")  # fmt: skip
    waited: list[float] = []
    async with bus:
        with capture_logs() as logs:
            await stall_then_publish(bus, fn, step_event, 5)
            await wait_until(lambda: bus.port().held)
            async with anyio.create_task_group() as tg:
                wait = bus.port().wait_for_room
                tg.start_soon(anyio.to_thread.run_sync, lambda: waited.append(wait()))
                await wait_until(lambda: sub.statistics().waited_s > 0)
                assert not waited  # still waiting: the buffer is over capacity
                fn.release.set()
            assert bus.port().wait_for_room() == 0.0  # nothing holds: returns at once
    assert waited and waited[0] > 0 and fn.done == list(range(6))
    assert sub.statistics().waited_s >= waited[0] * 0.99
    (warning,) = [x for x in logs if x["event"] == "training_waits_for_subscriber"]
    assert warning["subscription"] == "uploader" and warning["log_level"] == "warning"
    assert warning["received"] > warning["completed"] == 0
    assert "every_steps" in warning["remedies"] and "buffer" in warning["remedies"]


@pytest.mark.asyncio
async def test_wait_for_room_ends_when_the_doorbell_rings(step_event, wait_until) -> None:
    bus = EventBus(flush_interval=0.001)
    fn = Stalled()
    bus.subscribe_async(bus.stream(ev.StepEnded), fn, buffer=1, overflow="block")
    async with bus:
        await stall_then_publish(bus, fn, step_event, 3)
        await wait_until(lambda: bus.port().held)
        waited: list[float] = []
        async with anyio.create_task_group() as tg:
            wait = bus.port().wait_for_room
            tg.start_soon(anyio.to_thread.run_sync, lambda: waited.append(wait()))
            await anyio.sleep(0.1)
            assert not waited
            bus.send(cmd.StopTraining(reason="user"))  # rings: the loop must act on it
        assert bus.port().held and waited  # released although the buffer is still full
        fn.release.set()


# ============================================================================ wants
def test_wants_follows_subscriptions(vbus: EventBus) -> None:
    def noop(e: Any) -> None:
        pass

    assert not any(vbus.wants(t) for t in ev.EVENT_TYPES if t is not ev.CommandApplied)
    s1 = vbus.stream(ev.StepEnded).subscribe(noop)
    assert vbus.wants(ev.StepEnded) and not vbus.wants(ev.EpochEnded)
    pipeline = vbus.stream(ev.StepEnded, ev.EpochEnded).pipe(
        ops.filter(lambda e: True), ops.map(lambda e: e.step), ops.throttle_first(1.0)
    )
    s2 = pipeline.subscribe(noop)
    assert vbus.wants(ev.EpochEnded)
    s1.dispose()
    assert vbus.wants(ev.StepEnded)  # s2 still wants it
    s1.dispose()  # idempotent
    s2.dispose()
    assert not vbus.wants(ev.StepEnded) and not vbus.wants(ev.EpochEnded)

    everything = vbus.events.subscribe(noop)
    assert all(vbus.wants(t) for t in ev.EVENT_TYPES)
    everything.dispose()
    assert not any(vbus.wants(t) for t in ev.EVENT_TYPES if t is not ev.CommandApplied)

    merged = vbus.subscribe(
        reactivex.merge(vbus.stream(ev.EpochStarted), vbus.stream(ev.EpochEnded)), noop
    )
    assert vbus.wants(ev.EpochStarted) and vbus.wants(ev.EpochEnded)
    merged.dispose()
    assert not vbus.wants(ev.EpochStarted) and not vbus.wants(ev.EpochEnded)

    async def anoop(e: Any) -> None:
        pass

    a = vbus.subscribe_async(vbus.stream(ev.CheckpointSaved), anoop)
    assert vbus.wants(ev.CheckpointSaved)
    a.dispose()
    assert not vbus.wants(ev.CheckpointSaved)
    assert not a.statistics().active


def test_wants_command_applied_always(vbus: EventBus) -> None:
    # request() listens for acknowledgements, so the loop must always publish them.
    assert vbus.wants(ev.CommandApplied)


def test_completed_pipeline_stops_wanting(vbus: EventBus, step_event) -> None:
    got: list[int] = []
    vbus.stream(ev.StepEnded).pipe(tbops.once(at=2)).subscribe(lambda e: got.append(e.step))
    publish_range(vbus, step_event, 0, 2)
    vbus.flush()
    assert vbus.wants(ev.StepEnded)
    publish_range(vbus, step_event, 2, 5)
    vbus.flush()
    assert got == [2]
    assert not vbus.wants(ev.StepEnded)


# ============================================================================ request
def ack(command: cmd.Command, **fields: Any) -> ev.CommandApplied:
    return ev.CommandApplied(step=1, epoch=0, command=command, **fields)


@pytest.mark.asyncio
async def test_request_resolves_with_the_acknowledging_event(make_event) -> None:
    saved = make_event(ev.CheckpointSaved, path="runs/step-1-now.pt", tag="now")
    failure = OSError("disk full")

    def respond(c: cmd.Command) -> ev.CommandApplied:
        match c:
            case cmd.SaveCheckpoint(tag="now"):
                return ack(c, result=saved)
            case cmd.SaveCheckpoint(tag="fail"):
                return ack(c, error=failure)
            case _:
                return ack(c)

    async with EventBus(flush_interval=0.001) as bus, anyio.create_task_group() as tg:

        async def fake_loop() -> None:  # the training loop's poll points, simulated
            while True:
                for c in bus.port().poll_commands():
                    bus.publish(respond(c))
                await anyio.sleep(0.001)

        tg.start_soon(fake_loop)
        with anyio.fail_after(10):
            assert await bus.request(cmd.SaveCheckpoint(tag="now")) is saved
            stop_epoch = cmd.StopEpoch()
            applied = await bus.request(stop_epoch)
            assert isinstance(applied, ev.CommandApplied) and applied.command is stop_epoch
            with pytest.raises(CommandError) as exc_info:
                await bus.request(cmd.SaveCheckpoint(tag="fail"))
            assert exc_info.value.__cause__ is failure
        tg.cancel_scope.cancel()


@pytest.mark.asyncio
async def test_request_matches_the_command_object_not_an_equal_one(wait_until) -> None:
    results: dict[str, ev.BaseEvent] = {}
    first, second = cmd.Evaluate(), cmd.Evaluate()  # equal values, distinct requests
    async with EventBus(flush_interval=0.001) as bus, anyio.create_task_group() as tg:

        async def requester(name: str, c: cmd.Command) -> None:
            results[name] = await bus.request(c)

        tg.start_soon(requester, "first", first)
        tg.start_soon(requester, "second", second)
        sent: list[cmd.Command] = []
        await wait_until(lambda: bool(sent.extend(bus.port().poll_commands())) or len(sent) == 2)
        assert sent[0] is not sent[1]
        bus.publish(ack(cmd.Evaluate()))  # equal to both, but neither: resolves nothing
        by_id = {id(c): c for c in sent}
        bus.publish(ack(by_id[id(second)]))
        await wait_until(lambda: "second" in results)
        assert "first" not in results
        bus.publish(ack(by_id[id(first)]))
        await wait_until(lambda: "first" in results)
    assert results["first"].command is first  # type: ignore[attr-defined]
    assert results["second"].command is second  # type: ignore[attr-defined]


@pytest.mark.asyncio
async def test_request_raises_bus_closed_when_the_bus_closes_first(wait_until) -> None:
    errors: list[BaseException] = []
    bus = EventBus(flush_interval=0.001)

    async def requester() -> None:
        try:
            await bus.request(cmd.SaveCheckpoint())
        except BusClosedError as exc:
            errors.append(exc)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            async with bus:
                tg.start_soon(requester)
                # Sent, never acknowledged.
                await wait_until(lambda: bool(bus.port().poll_commands()))
    assert len(errors) == 1
    with pytest.raises(BusClosedError):
        await bus.request(cmd.StopTraining())


@pytest.mark.asyncio
async def test_request_rejects_a_non_command() -> None:
    async with EventBus(flush_interval=0.001) as bus:
        with pytest.raises(ConfigError, match=r"^command="):
            await bus.request("save")  # type: ignore[arg-type]


# ============================================================================ wait_delivered
@pytest.mark.asyncio
async def test_wait_delivered(step_event, make_event) -> None:
    # A long flush interval: the poller does not deliver during the test, wait_delivered does.
    bus = EventBus(flush_interval=10, close_timeout=5)
    sync_seen: list[int] = []
    async_done: list[int] = []
    never = anyio.Event()

    async def slow(e: ev.StepEnded) -> None:
        for _ in range(5):
            await anyio.lowlevel.checkpoint()
        async_done.append(e.step)

    async def stuck(e: ev.EpochEnded) -> None:
        await never.wait()

    bus.stream(ev.StepEnded).subscribe(lambda e: sync_seen.append(e.step))
    bus.subscribe_async(bus.stream(ev.StepEnded), slow, concurrency=2)
    bus.subscribe_async(bus.stream(ev.EpochEnded), stuck)
    async with bus:
        with anyio.fail_after(10):
            publish_range(bus, step_event, 1, 4)
            assert await bus.wait_delivered(timeout=10)
            assert sync_seen == [1, 2, 3] and sorted(async_done) == [1, 2, 3]

            bus.publish(make_event(ev.EpochEnded))
            assert await bus.wait_delivered(timeout=0.02) is False  # `stuck` holds it

            # Only subscriptions that received something in this delivery are waited for.
            bus.publish(step_event(4))
            assert await bus.wait_delivered(timeout=10)
            assert sync_seen == [1, 2, 3, 4] and sorted(async_done) == [1, 2, 3, 4]
            never.set()


@pytest.mark.asyncio
async def test_a_barrier_waits_only_for_who_received_its_event_even_after_the_poller(
    step_event, make_event, wait_until
) -> None:
    """The poller may dispatch the barrier event before the loop's barrier call: the barrier
    still waits for the deciders that received it, and not for a busy one that did not."""
    bus = EventBus(flush_interval=0.001)
    uploader, decider = Stalled(), Stalled()
    up = bus.subscribe_async(bus.stream(ev.StepEnded), uploader, name="uploader")
    dec = bus.subscribe_async(bus.stream(ev.EpochEnded), decider, name="decider", decides=True)
    async with bus:
        publish_range(bus, step_event, 0, 3)
        await wait_until(lambda: up.statistics().in_flight == 1)  # busy, not done
        ended = make_event(ev.EpochEnded)
        bus.publish(ended)
        await wait_until(lambda: dec.statistics().received == 1)  # the poller dispatched it
        assert await bus.port().wait_barrier(0.2, ended, False) == "timeout"  # the decider holds it
        assert (up.statistics().waited_s, dec.statistics().waited_s > 0) == (0.0, True)
        decider.release.set()
        another = make_event(ev.EpochEnded)
        bus.publish(another)
        await wait_until(lambda: dec.statistics().received == 2)
        assert await bus.port().wait_barrier(5, another, False) == "done"  # not the busy uploader
        assert up.statistics().waited_s == 0.0
        uploader.release.set()


@pytest.mark.asyncio
async def test_wait_delivered_times_out_behind_a_full_block_buffer(step_event) -> None:
    bus = EventBus(flush_interval=10)
    fn = Stalled()
    bus.subscribe_async(bus.stream(ev.StepEnded), fn, buffer=1, overflow="block")
    async with bus:
        with anyio.fail_after(10):
            publish_range(bus, step_event, 0, 4)
            # Delivery does not wait for room; waiting for the stalled items honours the timeout.
            assert await bus.wait_delivered(timeout=0.02) is False
            fn.release.set()
            assert await bus.wait_delivered(timeout=10)
    assert fn.done == [0, 1, 2, 3]


# ============================================================================ commands
def test_pipeline_subscribed_to_bus_commands(vbus: EventBus, step_event) -> None:
    vbus.stream(ev.StepEnded).pipe(
        ops.filter(lambda e: e.step == 3), ops.map(lambda e: cmd.StopTraining(reason="step 3"))
    ).subscribe(vbus.commands)
    publish_range(vbus, step_event, 0, 6)
    assert vbus.port().poll_commands() == []  # nothing before delivery
    vbus.flush()
    assert vbus.port().poll_commands() == [cmd.StopTraining(reason="step 3")]
    assert vbus.port().poll_commands() == []


def test_non_command_through_a_pipeline_is_a_counted_failure(vbus: EventBus, step_event) -> None:
    sub = vbus.stream(ev.StepEnded).pipe(ops.map(lambda e: "stop")).subscribe(vbus.commands)
    publish_range(vbus, step_event, 0, 2)
    vbus.flush()
    s = sub.statistics()
    assert s.failed == 2 and s.active and "ConfigError" in (s.last_error or "")
    assert vbus.statistics().failed == 2
    assert vbus.port().poll_commands() == []


def test_send_validates_and_keeps_order(vbus: EventBus) -> None:
    with pytest.raises(ConfigError, match=r"^command="):
        vbus.send("stop")  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        vbus.send(ev.EpochStarted(step=0, epoch=0))  # type: ignore[arg-type]
    commands = [cmd.Evaluate(), cmd.SaveCheckpoint(tag="a"), cmd.StopTraining()]
    reactivex.from_iterable(commands[:2]).subscribe(vbus.commands)  # a plain Rx observable
    vbus.send(commands[2])
    assert vbus.port().poll_commands() == commands


@pytest.mark.asyncio
async def test_send_from_another_thread() -> None:
    bus = EventBus()
    await anyio.to_thread.run_sync(bus.send, cmd.StopEpoch())
    assert bus.port().poll_commands() == [cmd.StopEpoch()]


# ============================================================================ tiers
def test_tiers_deliver_core_then_user_then_global(vbus: EventBus, step_event) -> None:
    order: list[str] = []
    vbus.stream(ev.StepEnded).subscribe(lambda e: order.append("user-1"))
    with vbus.tier("global"):
        vbus.events.subscribe(lambda e: order.append("global"))
        with vbus.tier("core"):  # nested: restored to "global" after
            vbus.stream(ev.StepEnded).pipe(ops.map(lambda e: e)).subscribe(
                lambda e: order.append("core")
            )
        vbus.stream(ev.StepEnded).subscribe(lambda e: order.append("global-2"))
    vbus.stream(ev.StepEnded).subscribe(lambda e: order.append("user-2"))
    vbus.publish(step_event(1))
    vbus.flush()
    assert order == ["core", "user-1", "user-2", "global", "global-2"]


def test_core_async_subscriptions_receive_before_user_ones(vbus: EventBus, step_event) -> None:
    async def anoop(e: Any) -> None:
        pass

    seen_by_user: list[int] = []
    with vbus.tier("core"):
        core = vbus.subscribe_async(vbus.stream(ev.StepEnded), anoop)
    with vbus.tier("user"):
        vbus.stream(ev.StepEnded).subscribe(
            lambda e: seen_by_user.append(core.statistics().received)
        )
    publish_range(vbus, step_event, 0, 3)
    vbus.flush()
    assert seen_by_user == [1, 2, 3]


def test_merged_pipeline_registers_during_subscribe_in_its_tier(vbus: EventBus, step_event) -> None:
    # reactivex.merge subscribes its sources through the scheduler's "now": that must happen
    # inside subscribe (in the tier in force), not on a later round of the loop or virtual time.
    order: list[str] = []
    vbus.stream(ev.StepEnded).subscribe(lambda e: order.append("user"))
    with vbus.tier("core"):
        merged = reactivex.merge(vbus.stream(ev.StepEnded), vbus.stream(ev.EpochStarted))
        vbus.subscribe(merged.pipe(ops.map(type)), lambda t: order.append(f"core:{t.__name__}"))
    assert vbus.wants(ev.EpochStarted)
    vbus.publish(step_event(1))
    vbus.flush()
    assert order == ["core:StepEnded", "user"]


def test_unknown_tier(vbus: EventBus) -> None:
    with pytest.raises(ConfigError, match=r"^tier="):
        vbus.tier("first")  # type: ignore[arg-type]


# ============================================================================ close
@pytest.mark.asyncio
async def test_close_emits_the_partial_buffer(step_event) -> None:
    bus = EventBus(flush_interval=0.001)
    buffers: list[list[int]] = []
    completed: list[bool] = []
    bus.stream(ev.StepEnded).pipe(ops.buffer_with_time(60.0)).subscribe(
        lambda b: buffers.append(steps_of(b)), on_completed=lambda: completed.append(True)
    )
    recorder = EventRecorder(bus)
    async with bus:
        publish_range(bus, step_event, 0, 3)
    assert buffers == [[0, 1, 2]]
    assert completed == [True] and recorder.completed


@pytest.mark.asyncio
async def test_close_waits_for_async_subscribers(step_event) -> None:
    done: list[int] = []

    async def slow(e: ev.StepEnded) -> None:
        for _ in range(3):
            await anyio.lowlevel.checkpoint()
        done.append(e.step)

    bus = EventBus(flush_interval=0.001)
    sub = bus.subscribe_async(bus.stream(ev.StepEnded), slow, buffer=1000)
    async with bus:
        publish_range(bus, step_event, 0, 100)
    assert done == list(range(100))
    s = sub.statistics()
    assert (s.completed, s.cancelled, s.queued, s.in_flight) == (100, 0, 0, 0)


@pytest.mark.asyncio
async def test_close_cancels_a_never_finishing_subscriber(step_event) -> None:
    async def forever(e: ev.StepEnded) -> None:
        await anyio.sleep_forever()

    bus = EventBus(flush_interval=0.001, close_timeout=0.05)
    sub = bus.subscribe_async(bus.stream(ev.StepEnded), forever)
    with anyio.fail_after(10):
        async with bus:
            publish_range(bus, step_event, 0, 3)
    s = sub.statistics()
    # One item was running, two waited: all three were cancelled, none completed.
    assert (s.received, s.completed, s.cancelled, s.queued, s.in_flight) == (3, 0, 3, 0, 0)
    assert not s.active
    assert bus.statistics().cancelled == 3


@pytest.mark.asyncio
async def test_close_waits_by_default_and_says_what_is_pending(step_event) -> None:
    done: list[int] = []

    async def slow(e: ev.StepEnded) -> None:
        await anyio.sleep(0.1)  # 20 of them: 2 s at least, past the notice's 1 s
        done.append(e.step)

    bus = EventBus(flush_interval=0.001)  # close_timeout: 300 s by default
    assert bus.close_timeout == 300.0
    sub = bus.subscribe_async(bus.stream(ev.StepEnded), slow, buffer=100, name="slow")
    with capture_logs() as logs:
        async with bus:
            publish_range(bus, step_event, 0, 20)
            await bus.wait_delivered(timeout=0)  # delivered, not finished: 20 items pending
    assert done == list(range(20))  # far longer than any old 10 s default would matter
    assert (sub.statistics().cancelled, bus.statistics().cancelled) == (0, 0)
    (notice,) = [x for x in logs if x["event"] == "bus_close_waiting"]  # the next: 30 s later
    assert notice["log_level"] == "info" and notice["close_timeout"] == 300.0  # a lasting one warns
    assert 0 < notice["pending"]["slow"] <= 20
    assert not [x for x in logs if x["event"] == "bus_closed_with_lost_work"]


@pytest.mark.asyncio
async def test_a_close_that_lasts_warns_within_seconds_at_the_default_level(step_event) -> None:
    """The first notice is info (the wait is the documented one); one that lasts 5 s is a
    warning, what a user sees at the default level, long before the next 30 s notice."""

    async def slow(e: ev.StepEnded) -> None:
        await anyio.sleep(5.6)

    bus = EventBus(flush_interval=0.001)
    bus.subscribe_async(bus.stream(ev.StepEnded), slow, name="slow")
    with capture_logs() as logs:
        async with bus:
            publish_range(bus, step_event, 0, 1)
            await bus.wait_delivered(timeout=0)
    notices = [x for x in logs if x["event"] == "bus_close_waiting"]
    assert [x["log_level"] for x in notices] == ["info", "warning"]
    assert 4.5 <= notices[1]["waited_s"] < 5.6 and notices[1]["pending"] == {"slow": 1}


@pytest.mark.asyncio
async def test_a_close_that_finds_quick_async_work_says_nothing(step_event) -> None:
    # Only a wait that lasts (1 s) is announced: a run whose async subscriber keeps up
    # ends without a bus_close_waiting warning.
    done: list[int] = []

    async def quick(e: ev.StepEnded) -> None:
        await anyio.lowlevel.checkpoint()
        done.append(e.step)

    bus = EventBus(flush_interval=0.001)
    bus.subscribe_async(bus.stream(ev.StepEnded), quick, buffer=100, name="quick")
    with capture_logs() as logs:
        async with bus:
            publish_range(bus, step_event, 0, 20)
    assert done == list(range(20))
    assert [x for x in logs if x["event"] == "bus_close_waiting"] == []


@pytest.mark.asyncio
async def test_cancel_pending_ends_a_waiting_close_and_counts_cancelled(step_event) -> None:
    bus = EventBus(flush_interval=0.001)
    fn = Stalled()
    sub = bus.subscribe_async(bus.stream(ev.StepEnded), fn, buffer=10, name="stuck")
    with capture_logs() as logs:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:

                async def cancel_when_closing() -> None:
                    while not [x for x in logs if x["event"] == "bus_close_waiting"]:  # noqa: ASYNC110
                        await anyio.sleep(0.005)
                    assert bus.cancel_pending() == {"stuck": 5}

                async with bus:
                    publish_range(bus, step_event, 0, 5)
                    await fn.first.wait()
                    tg.start_soon(cancel_when_closing)
    s = sub.statistics()
    assert (s.received, s.completed, s.cancelled) == (5, 0, 5)
    assert s.lost_work.total == 5 and s.lost_work.cancelled == 5
    (lost,) = [x for x in logs if x["event"] == "bus_closed_with_lost_work"]
    assert lost["lost_work"] == {"stuck": {"dropped": 0, "cancelled": 5, "failed": 0}}
    assert lost["total"] == 5 and lost["log_level"] == "warning"


@pytest.mark.asyncio
async def test_close_cancels_a_stalled_block_subscriber(step_event) -> None:
    # A "block" subscriber stuck with a full buffer: closing delivers everything to everyone
    # else and returns after close_timeout, its items counted as cancelled.
    seen: list[int] = []
    bus = EventBus(flush_interval=0.001, close_timeout=0.05)
    fn = Stalled()
    sub = bus.subscribe_async(bus.stream(ev.StepEnded), fn, buffer=1, overflow="block")
    bus.stream(ev.StepEnded).subscribe(lambda e: seen.append(e.step))
    with anyio.fail_after(10):
        async with bus:
            publish_range(bus, step_event, 0, 10)
    assert seen == list(range(10))
    s = sub.statistics()
    assert s.received == 10 and s.cancelled == 10 and s.completed == 0
    assert bus.statistics().cancelled == 10 and bus.statistics().queue_depth == 0


@pytest.mark.asyncio
async def test_bus_runs_once_and_refuses_late_subscribers() -> None:
    bus = EventBus(flush_interval=0.001)
    async with bus:
        assert bus.state == "running"
    assert bus.state != "running"
    with pytest.raises(BusClosedError):
        async with bus:
            pass
    with pytest.raises(BusClosedError):
        bus.stream(ev.StepEnded).subscribe(print)

    async def anoop(e: Any) -> None:
        pass

    with pytest.raises(BusClosedError):
        bus.subscribe_async(bus.events, anoop)


@pytest.mark.asyncio
async def test_flush_from_another_thread_is_refused() -> None:
    async with EventBus(flush_interval=0.001) as bus:
        with pytest.raises(BusClosedError, match="wait_delivered"):
            await anyio.to_thread.run_sync(bus.flush)


@pytest.mark.asyncio
async def test_subscribe_async_while_running(step_event) -> None:
    got: list[int] = []

    async def on_step(e: ev.StepEnded) -> None:
        await anyio.lowlevel.checkpoint()  # a real await: the handler runs as a task, not inline
        got.append(e.step)

    async with EventBus(flush_interval=0.001) as bus:
        assert bus.state == "running"
        bus.subscribe_async(bus.stream(ev.StepEnded), on_step, name="late")
        for step in (7, 8, 9):
            bus.publish(step_event(step))
        # Delivers what is queued and waits for the late subscription to finish it.
        assert await bus.wait_delivered(timeout=10)
        assert got == [7, 8, 9]
        (late,) = bus.statistics().subscriptions
        assert (late.name, late.kind, late.received, late.delivered) == ("late", "async", 3, 3)


def test_statistics_before_dispatch(vbus: EventBus, step_event) -> None:
    vbus.stream(ev.StepEnded).subscribe(lambda e: None, name="mine")
    publish_range(vbus, step_event, 0, 3)
    s = vbus.statistics()
    assert (s.published, s.delivered, s.queue_depth) == (3, 0, 3)
    vbus.flush()
    s = vbus.statistics()
    assert (s.published, s.delivered, s.queue_depth) == (3, 3, 0)
    (mine,) = s.subscriptions
    assert (mine.name, mine.kind, mine.received, mine.delivered) == ("mine", "sync", 3, 3)
    assert vbus.subscriptions[0].name == "mine"


# ============================================================================ bad input
def noop(e: Any) -> None:
    pass


async def anoop(e: Any) -> None:
    pass


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda b: b.subscribe(b.events, 42), "on_next"),
        (lambda b: b.subscribe(b.events, None), "on_next"),
        (lambda b: b.stream(ev.StepEnded).subscribe("print"), "on_next"),
        (lambda b: b.stream(ev.StepEnded).subscribe(noop, on_completed=3), "on_completed"),
        (lambda b: b.stream(int), "event_types"),
        (lambda b: b.stream(), "event_types"),
        (lambda b: b.stream(ev.StepEnded, "StepEnded"), "event_types"),
        (lambda b: b.subscribe_async(b.events, anoop, overflow="drop_newest"), "overflow"),
        (lambda b: b.subscribe_async(b.events, anoop, buffer=0), "buffer"),
        (lambda b: b.subscribe_async(b.events, anoop, buffer=-1), "buffer"),
        (lambda b: b.subscribe_async(b.events, anoop, buffer=2, overflow="latest"), "buffer"),
        (lambda b: b.subscribe_async(b.events, anoop, concurrency=0), "concurrency"),
        (lambda b: b.subscribe_async(b.events, "fn"), "fn"),
        (lambda b: b.subscribe_async(b.events, anoop, on_error="ignore"), "on_error"),
        (lambda b: b.subscribe(b.events, noop, on_error="ignore"), "on_error"),
        (lambda b: b.events.subscribe(noop, on_error="ignore"), "on_error"),
        (lambda b: b.events.subscribe(noop, "raise"), "on_rx_error"),
        (lambda b: b.events.subscribe(noop, 3), "on_rx_error"),
        (lambda b: b.publish("event"), "event"),
        (lambda b: b.publish(cmd.StopTraining()), "event"),
    ],
)
def test_bad_arguments_raise_config_error_naming_them(
    vbus: EventBus, call: Callable[[EventBus], Any], field: str
) -> None:
    with pytest.raises(ConfigError, match=rf"^{field}=") as exc_info:
        call(vbus)
    assert isinstance(exc_info.value, ValueError)
    assert vbus.subscriptions == ()  # nothing half-registered
    assert vbus.statistics().queue_depth == 0


@pytest.mark.asyncio
async def test_an_async_function_given_to_subscribe_is_refused_naming_subscribe_async(
    step_event, wait_until
) -> None:
    # RxPY's subscribe would call it and drop the coroutine: it would never run, silently.
    posted: list[int] = []

    async def post(e: ev.StepEnded) -> None:
        posted.append(e.step)

    bus = EventBus()
    refused = r"=.*\.post' is invalid: .*async def.* bus\.subscribe_async\(stream, post\)"
    piped = bus.events.pipe(ops.filter(lambda e: isinstance(e, ev.StepEnded)))
    for subscribe in (
        lambda: bus.stream(ev.StepEnded).subscribe(post),
        lambda: bus.events.subscribe(post),
        lambda: piped.subscribe(post),
        lambda: bus.stream(ev.StepEnded).pipe(ops.throttle_first(0.5)).subscribe(post),
        lambda: bus.subscribe(bus.stream(ev.StepEnded), post),
        lambda: bus.events.subscribe(print, on_completed=post),
    ):
        with pytest.raises(ConfigError, match=refused):
            subscribe()
    assert bus.subscriptions == ()  # nothing half-registered
    # The way the message names runs it.
    bus.subscribe_async(bus.stream(ev.StepEnded), post)
    async with bus:
        bus.publish(step_event(7))
        await wait_until(lambda: posted == [7])


def test_a_stream_and_function_given_the_wrong_way_round_say_which_comes_first() -> None:
    bus = EventBus()

    async def post(_: ev.StepEnded) -> None:
        return None

    first = r"^observable=.*is invalid: a stream .*given first: bus\.subscribe\(stream, fn\)"
    with pytest.raises(ConfigError, match=first):
        bus.subscribe_async(post, bus.stream(ev.StepEnded))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=first):
        bus.subscribe(print, bus.stream(ev.StepEnded))  # type: ignore[arg-type]
    assert bus.subscriptions == ()


def test_a_pipeline_sending_a_command_class_is_told_to_make_an_instance() -> None:
    """``ops.map(lambda e: cmd.StopTraining)``: the failure the subscriber logs names the fix,
    and the run it was meant to stop goes on to its end."""
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = Trainer(model, optimizer, tiny_loader(6), loss_fn=F.cross_entropy, max_steps=6)
    bus = trainer.bus
    bus.stream(ev.StepEnded).pipe(
        ops.filter(lambda e: e.step == 2), ops.map(lambda _: cmd.StopTraining)
    ).subscribe(bus.commands)
    with capture_logs() as logs:
        result = trainer.fit_sync()
    assert result.steps == 6
    failed = [x for x in logs if x["event"] == "subscriber_failed"]
    assert failed, logs
    assert "such as StopTraining(...), not the class" in str(failed[0])


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"flush_interval": 0}, "flush_interval"),
        ({"flush_interval": -1}, "flush_interval"),
        ({"flush_interval": 11}, "flush_interval"),
        ({"flush_interval": math.nan}, "flush_interval"),
        ({"flush_interval": "fast"}, "flush_interval"),
        ({"max_queue": 0}, "max_queue"),
        ({"max_queue": 1.5}, "max_queue"),
        ({"close_timeout": -1}, "close_timeout"),
        ({"close_timeout": "10"}, "close_timeout"),
        ({"close_timeout": math.nan}, "close_timeout"),
        ({"on_error": "ignore"}, "on_error"),
        ({"rx_scheduler": object()}, "rx_scheduler"),
    ],
)
def test_bad_bus_arguments(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{field}="):
        EventBus(**kwargs)


# A ``request()`` the loop can no longer apply raises ``BusClosedError`` at the call's end: it
# never holds ``fit()`` (whose end waits for async subscribers up to ``close_timeout``, 300 s).


def _trainer(steps: int = 4) -> Trainer:
    model = tiny_model()
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_loader(steps),
                   loss_fn=F.cross_entropy, max_epochs=1, progress=False)  # fmt: skip


@pytest.mark.timeout(60)
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


@pytest.mark.timeout(60)
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


def test_a_name_of_the_earlier_spelling_says_what_replaced_it() -> None:
    with pytest.raises(TypeError, match=r"scheduler is rx_scheduler now: EventBus\(rx_scheduler="):
        EventBus(scheduler=None)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"did you mean 'flush_interval'"):
        EventBus(flush_intervall=0.1)  # type: ignore[call-arg]
    bus = EventBus()
    with pytest.raises(AttributeError, match=r"bus\.decides is bus\.declare_decision_steps"):
        bus.decides  # noqa: B018
    with pytest.raises(AttributeError, match=r'bus\.running is bus\.state == "running" now'):
        bus.running  # noqa: B018
    assert not hasattr(bus, "no_such_attribute")


@pytest.mark.timeout(60)
def test_a_stop_sent_after_the_last_poll_point_does_not_stop_the_next_call() -> None:
    """A sync subscriber of ``FitEnded`` sends a stop after the loop's last poll point: it asks
    for what already happened, and the next call (an evaluation) runs whole."""
    trainer = _trainer()
    trainer.bus.stream(ev.FitEnded).subscribe(
        lambda e: trainer.bus.send(cmd.StopTraining(reason="after the end"))
    )
    assert trainer.fit_sync().reason == "completed"
    metrics = trainer.evaluate_sync(tiny_loader(2))
    assert "val_loss" in metrics

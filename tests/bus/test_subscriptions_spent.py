"""What the loop thread is done with is freed on the publishing thread (_bus/subscriptions.py).

Freeing a tensor releases the GIL, so a ``StepEnded`` whose loss died on the loop thread cost a
GIL round trip with the training thread per event. These tests follow each payload to the
thread that frees it: a finalizer records the thread.
"""

from __future__ import annotations

import threading
from typing import Any

import anyio
import pytest
import reactivex.operators as ops

from trainbus import EventBus
from trainbus import events as ev
from trainbus._bus.subscriptions import AsyncSubscription, Backpressure
from trainbus._bus.watchdog import FailureLedger


class Tracked:
    """A payload that records on which thread it was freed."""

    def __init__(self, freed: dict[int, int], key: int) -> None:
        self._freed = freed
        self._key = key

    def __del__(self) -> None:
        self._freed[self._key] = threading.get_ident()


def _event(step: int, freed: dict[int, int]) -> ev.StepEnded:
    return ev.StepEnded(step=step, epoch=0, loss=Tracked(freed, step), lr=0.1, grad_norm=None,
                        samples=1, duration_s=0.0)  # fmt: skip


async def _publish_from_worker(bus: EventBus, steps: range, freed: dict[int, int]) -> int:
    """Publish ``steps`` from a worker thread, waiting for each to be delivered, as a training
    thread does; return the worker's thread id."""

    def publish(step: int) -> int:
        bus.publish(_event(step, freed))
        return threading.get_ident()

    worker = 0
    for step in steps:
        worker = await anyio.to_thread.run_sync(publish, step)
        await bus.wait_delivered()
    return worker


@pytest.mark.asyncio
async def test_events_a_pipe_drops_are_freed_by_the_next_publish_not_the_loop(wait_until) -> None:
    freed: dict[int, int] = {}
    taken: list[int] = []
    loop_thread = threading.get_ident()
    with anyio.fail_after(20):
        async with EventBus(flush_interval=0.002) as bus:
            bus.stream(ev.StepEnded).pipe(ops.filter(lambda e: e.step % 5 == 0)).subscribe(
                lambda e: taken.append(e.step)
            )
            # Every step is delivered before the next is published: the loop thread is done
            # with each event while the publisher still has one more to publish.
            worker = await _publish_from_worker(bus, range(1, 12), freed)
            assert taken == [5, 10]
            # Each event but the last was freed by a later publish, on the publishing thread.
            await wait_until(lambda: set(range(1, 11)) <= freed.keys())
            assert {freed[s] for s in range(1, 11)} == {worker}
            assert loop_thread not in freed.values()
    # Closing the bus frees what was left; nothing is kept past it.
    assert set(freed) == set(range(1, 12))


@pytest.mark.asyncio
async def test_items_an_async_subscriber_finished_or_dropped_are_freed_by_the_next_publish(
    wait_until,
) -> None:
    freed: dict[int, int] = {}
    seen: list[int] = []
    release = anyio.Event()

    async def slow(e: ev.StepEnded) -> None:
        seen.append(e.step)
        await release.wait()

    with anyio.fail_after(20):
        async with EventBus(flush_interval=0.002) as bus:
            sub = bus.subscribe_async(bus.stream(ev.StepEnded), slow, buffer=1, overflow="latest")

            def publish(step: int) -> int:
                bus.publish(_event(step, freed))
                return threading.get_ident()

            # Step 1 runs and waits; 2 is buffered, then replaced by 3 ("latest" drops 2).
            worker = await anyio.to_thread.run_sync(publish, 1)
            await wait_until(lambda: seen == [1])
            for step in (2, 3):
                await anyio.to_thread.run_sync(publish, step)
                await wait_until(lambda: bus.statistics().queue_depth == 0)
            await wait_until(lambda: sub.statistics().dropped == 1)
            assert 2 not in freed  # the dropped item waits for the next publish
            release.set()
            await bus.wait_delivered()
            assert seen == [1, 3]
            assert 1 not in freed and 3 not in freed  # finished: waiting for the next publish
            await anyio.to_thread.run_sync(publish, 4)
            await wait_until(lambda: {1, 2, 3} <= freed.keys())
            assert {freed[s] for s in (1, 2, 3)} == {worker}


@pytest.mark.asyncio
async def test_a_subscriber_that_keeps_an_event_keeps_it() -> None:
    freed: dict[int, int] = {}
    kept: list[Any] = []
    with anyio.fail_after(20):
        async with EventBus(flush_interval=0.002) as bus:
            bus.stream(ev.StepEnded).subscribe(kept.append)
            await _publish_from_worker(bus, range(1, 6), freed)
    assert freed == {} and [e.step for e in kept] == [1, 2, 3, 4, 5]
    kept.clear()
    assert set(freed) == {1, 2, 3, 4, 5}


@pytest.mark.asyncio
async def test_events_a_subscriber_derives_are_freed_by_the_next_publish(wait_until) -> None:
    freed: dict[int, int] = {}
    derived: list[int] = []
    with anyio.fail_after(20):
        async with EventBus(flush_interval=0.002) as bus:
            # Each StepEnded derives another event on the loop thread, delivered right after
            # it; its payload must not die on the loop thread either.
            def derive(e: ev.StepEnded) -> None:
                bus.publish(ev.PredictionBatchEnded(step=e.step, epoch=0, batch_index=e.step,
                                                    outputs=Tracked(freed, 100 + e.step),
                                                    samples=1))  # fmt: skip

            bus.stream(ev.StepEnded).subscribe(derive)
            bus.stream(ev.PredictionBatchEnded).subscribe(lambda e: derived.append(e.step))
            worker = await _publish_from_worker(bus, range(1, 5), freed)
            assert derived == [1, 2, 3, 4]
            await wait_until(lambda: {101, 102, 103} <= freed.keys())
            assert {freed[k] for k in (101, 102, 103)} == {worker}


def test_a_subscription_built_without_a_bus_keeps_nothing() -> None:
    # Nobody would clear its deque: what it drops is freed at once, where it is.
    async def fn(item: Any) -> None:
        return None

    freed: dict[int, int] = {}
    sub = AsyncSubscription(FailureLedger("log", lambda command: None), "bare", fn,
                            concurrency=1, buffer=1, overflow="latest", on_error=None,
                            backpressure=Backpressure())  # fmt: skip
    sub.push(Tracked(freed, 1))
    sub.push(Tracked(freed, 2))  # "latest": 1 is dropped
    assert sub.dropped == 1 and freed == {1: threading.get_ident()}

"""The poller parks after a quiet spell and the next publish wakes it (docs/performance.md)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import anyio
import pytest

from trainbus import EventBus
from trainbus import events as ev
from trainbus.bus.failures import FailureLedger
from trainbus.bus.queue import PublishQueue
from trainbus.bus.routes import RouteTable


def _queue() -> tuple[PublishQueue, RouteTable]:
    ledger = FailureLedger("log", lambda command: None)
    routes = RouteTable()
    queue = PublishQueue(
        max_queue=1000,
        flush_interval=0.01,
        routes=routes,
        ledger=ledger,
    )
    return queue, routes


async def _park_then_publish_from_thread(step_event: Callable[..., Any]) -> list[int]:
    queue, _ = _queue()
    queue.open(threading.get_ident())
    woke: list[int] = []

    async def park() -> None:
        # A backstop far beyond the test's deadlock guard: only the publish can end this wait.
        await queue.wait_published(3600.0)
        woke.append(len(queue))

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(park)
            while not queue.parked:  # noqa: ASYNC110
                await anyio.sleep(0.001)
            await anyio.to_thread.run_sync(queue.publish, step_event(7))
    assert not queue.parked
    return woke


@pytest.mark.asyncio
async def test_a_publish_from_another_thread_wakes_the_parked_poller(step_event) -> None:
    assert await _park_then_publish_from_thread(step_event) == [1]


def test_a_publish_wakes_the_parked_poller_on_trio(step_event) -> None:
    assert anyio.run(_park_then_publish_from_thread, step_event, backend="trio") == [1]


@pytest.mark.asyncio
async def test_the_poller_does_not_park_while_something_is_queued(step_event) -> None:
    queue, _ = _queue()
    queue.open(threading.get_ident())
    queue.publish(step_event(1))
    with anyio.fail_after(10):
        await queue.wait_published(3600.0)  # returns at once: the queue is not empty
    assert not queue.parked and len(queue) == 1


@pytest.mark.asyncio
async def test_events_after_quiet_spells_are_all_delivered_in_order(step_event, wait_until) -> None:
    got: list[int] = []
    async with EventBus(flush_interval=0.002) as bus:
        bus.stream(ev.StepEnded).subscribe(lambda e: got.append(e.step))
        for spell in range(5):
            # Many intervals with nothing published: the poller parks in between.
            await anyio.sleep(0.03)
            steps = range(10 * spell, 10 * spell + 10)
            await anyio.to_thread.run_sync(lambda s=steps: [bus.publish(step_event(i)) for i in s])
            await wait_until(lambda n=10 * spell + 10: len(got) == n)
    assert got == list(range(50))

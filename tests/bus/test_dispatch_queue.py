"""The poller parks after a quiet spell and the next publish wakes it (benchmarks/HISTORY.md,
"Making the bus cheaper")."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import anyio
import pytest
import trio
import trio.testing
from reactivex import Observer

from trainbus import EventBus
from trainbus import events as ev
from trainbus._bus import dispatch
from trainbus._bus.commands import DecisionStamp, Doorbell
from trainbus._bus.dispatch import PublishQueue, RouteTable
from trainbus._bus.watchdog import FailureLedger


def _queue() -> tuple[PublishQueue, RouteTable]:
    ledger = FailureLedger("log", lambda command: None, Doorbell())
    routes = RouteTable(Doorbell())
    queue = PublishQueue(
        max_queue=1000,
        flush_interval=0.01,
        routes=routes,
        ledger=ledger,
        stamp=DecisionStamp(),
    )
    return queue, routes


async def _park_then_publish_from_thread(step_event: Callable[..., Any]) -> list[int]:
    queue, routes = _queue()
    queue.open(threading.get_ident())
    got: list[int] = []
    delivered = anyio.Event()

    def on_step(e: ev.StepEnded) -> None:
        got.append(e.step)
        delivered.set()

    routes.register((ev.StepEnded,), Observer(on_step))
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(queue.run)
            while not queue.parked:  # noqa: ASYNC110
                await anyio.sleep(0.001)
            await anyio.to_thread.run_sync(queue.publish, step_event(7))
            await delivered.wait()
            tg.cancel_scope.cancel()
    assert not queue.parked
    return got


@pytest.mark.asyncio
async def test_a_publish_from_another_thread_wakes_the_parked_poller(
    step_event, monkeypatch
) -> None:
    # A backstop far beyond the deadlock guard: only the publish can end the park.
    monkeypatch.setattr(dispatch, "_PARK_BACKSTOP", 3600.0)
    assert await _park_then_publish_from_thread(step_event) == [7]


def test_a_publish_wakes_the_parked_poller_on_trio(step_event, monkeypatch) -> None:
    monkeypatch.setattr(dispatch, "_PARK_BACKSTOP", 3600.0)
    assert anyio.run(_park_then_publish_from_thread, step_event, backend="trio") == [7]


class PollerSteps(trio.abc.Instrument):
    """Counts the steps of the bus' poller task (trio's public instrument hook): each time the
    task resumes is one step, so a poller that wakes every flush interval takes one per
    interval, and a parked one only when woken."""

    def __init__(self) -> None:
        self.steps = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if task.name == "trainbus-bus-poller":
            self.steps += 1


INTERVAL = 0.01
QUIET_S = 100.0  # 10,000 flush intervals with nothing published


def test_the_poller_parks_in_quiet_spells_and_each_publish_wakes_it_at_once(step_event) -> None:
    # Virtual time (trio's MockClock, autojump): a quiet spell of 100 s passes at once, and the
    # loop time between a publish and its delivery is exactly what the poller waited.
    poller = PollerSteps()
    quiet_steps: list[int] = []
    waited: list[float] = []
    got: list[int] = []

    async def main() -> None:
        async with EventBus(flush_interval=INTERVAL) as bus:
            arrived = anyio.Event()

            def on_step(e: ev.StepEnded) -> None:
                got.append(e.step)
                if len(got) % 10 == 0:
                    arrived.set()

            bus.stream(ev.StepEnded).subscribe(on_step)
            for spell in range(5):
                before = poller.steps
                await anyio.sleep(QUIET_S)
                quiet_steps.append(poller.steps - before)
                published_at = anyio.current_time()
                for i in range(10 * spell, 10 * spell + 10):
                    bus.publish(step_event(i))
                await arrived.wait()  # every task blocked: the clock jumps to the next wake
                waited.append(anyio.current_time() - published_at)
                arrived = anyio.Event()

    clock = trio.testing.MockClock(autojump_threshold=0)
    anyio.run(main, backend="trio", backend_options={"clock": clock, "instruments": [poller]})
    assert got == list(range(50))
    # Parked: one wake per 1 s backstop (benchmarks/HISTORY.md) plus the 3 empty intervals
    # before parking. A poller that never parked would have taken 10,000 steps per spell.
    assert all(steps <= QUIET_S + 10 for steps in quiet_steps), quiet_steps
    # The publish woke the parked poller: delivered with no loop time passing (not at the
    # next backstop, not even at the next flush interval).
    assert waited == [0.0] * 5

"""The link's transport contract, one suite run against every transport: the loopback socket
(``trainbus launch``) and the Ray mailbox actor (``trainbus.ray``). The protocol core
(``WorkerLink`` / ``DriverLink``) is the same; only what carries the bytes differs."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.to_thread
import pytest
import structlog

from trainbus import EventBus, LaunchError
from trainbus import _wire as wire
from trainbus import commands as cmd
from trainbus import events as ev
from trainbus._distributed.driver_link import DriverLink
from trainbus._distributed.link import WorkerLink
from trainbus._distributed.socket_link import SocketDriver

TOKEN = "the-run-token"
Until = Callable[..., Awaitable[None]]


@pytest.fixture(params=["socket", "ray"])
def transport(request: pytest.FixtureRequest) -> str:
    if request.param == "ray":
        request.getfixturevalue("ray_cluster")
        request.applymarker(pytest.mark.slow)
    return str(request.param)


@asynccontextmanager
async def driver_side(
    kind: str, bus: EventBus, *, relink: bool = False
) -> AsyncIterator[tuple[str, DriverLink]]:
    """The driver's end on ``kind``, served until the block ends: (address, link)."""
    link = DriverLink(bus, TOKEN, relink=relink)
    driver: Any
    if kind == "socket":
        driver = await SocketDriver.listen(connect_timeout=5)
    else:
        from trainbus.ray._transport import RayDriver

        driver = await RayDriver.start()
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(driver.serve, link)
            tg.start_soon(link.forward, driver.send)
            yield driver.address, link
            tg.cancel_scope.cancel()
    finally:
        await driver.aclose()


async def in_thread(fn: Callable[[], Any]) -> Any:
    return await anyio.to_thread.run_sync(fn)


@pytest.mark.asyncio
async def test_events_arrive_in_order_and_commands_come_back(
    transport: str, step_event: Callable[..., ev.StepEnded], wait_until: Until
) -> None:
    driver_bus = EventBus(flush_interval=0.005)
    received: list[ev.StepEnded] = []
    driver_bus.stream(ev.StepEnded).subscribe(received.append)
    worker_bus = EventBus(flush_interval=0.005)
    async with driver_bus, driver_side(transport, driver_bus) as (address, dlink):
        wlink = WorkerLink(address, TOKEN, timeout=10)
        await in_thread(wlink.connect)
        assert ev.StepEnded in wlink.wanted and ev.FitEnded in wlink.wanted  # asked + always
        assert ev.SpanTraced not in wlink.wanted  # nobody in the driver reads it
        wlink.start(worker_bus)
        n = 3000
        async with worker_bus:

            def publish() -> None:
                for i in range(1, n + 1):
                    worker_bus.publish(step_event(i))

            await in_thread(publish)
            await wait_until(lambda: len(received) == n, limit_s=30)
            request = cmd.SaveCheckpoint(tag="from-driver")
            driver_bus.send(cmd.StopTraining(reason="driver"))
            driver_bus.send(request)
            await wait_until(lambda: wlink.received == 2, limit_s=10)
            assert worker_bus.port().poll_commands() == [cmd.StopTraining(reason="driver"), request]
            # The worker's acknowledgement hands the driver its own command object back.
            worker_bus.publish(ev.CommandApplied(step=n, epoch=0, command=request))
            await wait_until(lambda: dlink.received == n + 1, limit_s=10)
        assert isinstance(dlink.last_event, ev.CommandApplied)
        assert dlink.last_event.command is request
        await in_thread(wlink.close)
        assert await dlink.wait_unlinked(10)
        await driver_bus.wait_delivered(5)
    assert [e.step for e in received] == list(range(1, n + 1))  # every one, in order
    assert wlink.sent == n + 1 == dlink.received


@pytest.mark.asyncio
async def test_a_wrong_token_is_refused_and_the_right_one_still_links(transport: str) -> None:
    bus = EventBus()
    async with bus, driver_side(transport, bus) as (address, dlink):
        impostor = WorkerLink(address, "not-the-token", timeout=5)
        with structlog.testing.capture_logs() as logs:
            with pytest.raises(LaunchError, match="refused this worker's link"):
                await in_thread(impostor.connect)
        assert dlink.refused == 1 and not dlink.linked
        refused = [e for e in logs if e["event"] == "driver_connection_refused"]
        assert [e["reason"] for e in refused] == ["wrong token"]
        worker = WorkerLink(address, TOKEN, timeout=5)
        await in_thread(worker.connect)
        assert dlink.linked
        await in_thread(worker.close)
        assert await dlink.wait_unlinked(10)


@pytest.mark.asyncio
async def test_one_link_per_run_a_second_worker_is_refused(transport: str) -> None:
    bus = EventBus()
    async with bus, driver_side(transport, bus) as (address, dlink):
        first = WorkerLink(address, TOKEN, timeout=5)
        await in_thread(first.connect)
        second = WorkerLink(address, TOKEN, timeout=5)
        with pytest.raises(LaunchError, match="another rank already linked"):
            await in_thread(second.connect)
        assert dlink.refused == 1
        await in_thread(first.close)


@pytest.mark.asyncio
async def test_with_relink_a_restarted_rank_0_replaces_the_link(
    transport: str, step_event: Callable[..., ev.StepEnded], wait_until: Until
) -> None:
    # What Ray does after a failure (FailureConfig): a new rank 0 of the same run says hello
    # again while the old one never said bye; its events go on on the same driver bus.
    bus = EventBus(flush_interval=0.005)
    received: list[int] = []
    restarts: list[ev.WorkersRestarted] = []
    bus.stream(ev.StepEnded).subscribe(lambda e: received.append(e.step))
    bus.stream(ev.WorkersRestarted).subscribe(restarts.append)
    async with bus, driver_side(transport, bus, relink=True) as (address, dlink):
        links: list[WorkerLink] = []
        for attempt in (1, 2):
            worker_bus = EventBus(flush_interval=0.005)
            wlink = WorkerLink(address, TOKEN, timeout=10)
            links.append(wlink)
            await in_thread(wlink.connect)
            wlink.start(worker_bus)
            async with worker_bus:
                worker_bus.publish(step_event(attempt))
                await wait_until(lambda n=attempt: len(received) == n, limit_s=10)  # type: ignore[misc]
                if attempt == 1:  # the first attempt fails: its FitEnded says why
                    worker_bus.publish(ev.FitEnded(step=1, epoch=0, reason="failed",
                                                   error=RuntimeError("boom")))  # fmt: skip
                    await wait_until(lambda: dlink.ended is not None, limit_s=10)
            if attempt == 2:
                await in_thread(wlink.close)  # the first one just vanished (no bye)
        assert dlink.links == 2 and dlink.refused == 0
        assert await dlink.wait_unlinked(10)
        await in_thread(links[0].close)  # not leaked past the test
    assert received == [1, 2]
    # One WorkersRestarted, between the attempts, saying which attempt starts and why the
    # last one ended (its FitEnded's error).
    (restart,) = restarts
    assert restart.attempt == 2 and restart.step == 1
    assert restart.reason == "rank 0's fit failed: RuntimeError('boom')"


@pytest.mark.asyncio
async def test_a_restart_after_a_vanished_rank_0_says_so() -> None:
    bus = EventBus(flush_interval=0.005)
    restarts: list[ev.WorkersRestarted] = []
    bus.stream(ev.WorkersRestarted).subscribe(restarts.append)
    link = DriverLink(bus, TOKEN, relink=True)
    hello = b'{"v":1,"type":"hello","token":"%s","rank":0,"pid":1}\n' % TOKEN.encode()
    async with bus:
        for attempt in (1, 2, 3):
            assert link.greet(hello, f"attempt {attempt}") is not None
            link.receive(
                wire.dumps(
                    ev.StepEnded(
                        step=attempt,
                        epoch=0,
                        loss=1.0,
                        lr=0.1,
                        grad_norm=None,
                        samples=4,
                        duration_s=0.1,
                    )
                )
            )
        await bus.wait_delivered(5)
    assert [(r.attempt, r.step) for r in restarts] == [(2, 1), (3, 2)]
    assert {r.reason for r in restarts} == {
        "rank 0 streamed no FitEnded: a worker died or was killed"
    }


def test_an_unreachable_driver_is_a_launch_error(transport: str) -> None:
    if transport == "socket":
        from ._torchrun import free_port

        address = f"127.0.0.1:{free_port()}"
    else:
        address = "ray:nowhere/trainbus-link-gone"
    link = WorkerLink(address, TOKEN, timeout=2)
    with pytest.raises(LaunchError, match="cannot reach the trainbus driver"):
        link.connect()
    link.close()  # never connected: nothing to close

"""trainbus.attach(run_dir): a real job in a subprocess, watched and steered from here."""

from __future__ import annotations

import os
from collections.abc import Callable

import anyio
import pytest

import trainbus
from trainbus import commands as cmd
from trainbus import events as ev

from ._job import Job

# Real processes on a loaded machine: each job starts Python and torch (tens of seconds).
pytestmark = pytest.mark.timeout(600)


@pytest.mark.asyncio
async def test_attach_sees_the_events_in_order_and_the_files_go_at_the_end(
    job: Callable[..., Job],
) -> None:
    j = job("--max-steps", "30", "--pause-at", "2")
    j.wait_for("paused-2")
    seen: list[ev.BaseEvent] = []
    att = trainbus.attach(j.run_dir, timeout=30)
    att.subscribe(att.stream(ev.StepEnded, ev.MetricsLogged, ev.FitEnded), seen.append)
    async with att:
        assert att.job["pid"] == j.process.pid
        j.release(2)
        ended = await att.wait(60)
    assert ended is not None and ended.step == 30
    steps = [e.step for e in seen if isinstance(e, ev.StepEnded)]
    assert steps == list(range(steps[0], 31)) and steps[0] <= 3
    logged = [e.step for e in seen if isinstance(e, ev.MetricsLogged)]
    assert logged == [s for s in range(5, 31, 5) if s >= steps[0]]
    assert isinstance(seen[-1], ev.FitEnded)
    result = j.finish()
    assert result["steps"] == 30
    assert "attach.sock" not in result["files"] and "attach.token" not in result["files"]


@pytest.mark.asyncio
async def test_save_lr_evaluate_and_stop_are_acknowledged_at_their_step(
    job: Callable[..., Job],
) -> None:
    j = job("--max-steps", "40", *(a for k in (5, 10, 15, 20) for a in ("--pause-at", str(k))))
    j.wait_for("paused-5")
    async with trainbus.attach(j.run_dir, timeout=30) as att:
        saved = await att.request(cmd.SaveCheckpoint(tag="now"))
        assert isinstance(saved, ev.CheckpointSaved)
        assert saved.step == 5 and saved.tag == "now"
        await anyio.to_thread.run_sync(j.wait_for, "paused-10")
        lr = await att.request(cmd.SetLearningRate(lr=0.01))
        assert isinstance(lr, ev.CommandApplied) and lr.step == 10
        await anyio.to_thread.run_sync(j.wait_for, "paused-15")
        evaluated = await att.request(cmd.Evaluate())
        assert isinstance(evaluated, ev.EvaluationEnded) and evaluated.step == 15
        await anyio.to_thread.run_sync(j.wait_for, "paused-20")
        stopped = await att.request(cmd.StopTraining(reason="from_attach"))
        assert isinstance(stopped, ev.CommandApplied) and stopped.step == 20
        ended = await att.wait(60)
    assert ended is not None and ended.step == 20 and ended.stop_reason == "from_attach"
    result = j.finish()
    assert result["steps"] == 20 and result["lr"] == 0.01
    assert (j.run_dir / "step-5-now.pt").exists() or any("now" in f for f in result["files"])
    received = [line for line in j.stdout.splitlines() if "link_command_received" in line]
    assert len(received) == 4 and all(f"attach:pid={os.getpid()}" in r for r in received)


@pytest.mark.asyncio
async def test_nothing_is_built_for_a_listener_nobody_attached_to(
    job: Callable[..., Job],
) -> None:
    j = job("--max-steps", "12", "--pause-at", "3", "--pause-at", "6", "--pause-at", "9")
    j.wait_for("paused-3")
    att = trainbus.attach(j.run_dir, timeout=30)
    att.subscribe(att.stream(ev.SpanTraced), lambda e: None)
    async with att:
        j.release(3)
        await anyio.to_thread.run_sync(j.wait_for, "paused-6")
    await anyio.to_thread.run_sync(j.wait_log, "attach_detached")
    j.release(6)
    j.wait_for("paused-9")
    j.release(9)
    result = j.finish()
    assert result["wanted_while_paused"] == [False, True, False]
    assert result["steps"] == 12


@pytest.mark.asyncio
async def test_a_subscription_made_while_attached_is_streamed_from_then_on(
    job: Callable[..., Job],
) -> None:
    j = job("--max-steps", "16", *(a for k in (4, 8, 12) for a in ("--pause-at", str(k))))
    j.wait_for("paused-4")
    late: list[ev.SpanTraced] = []
    step_8 = anyio.Event()

    def receive(e: ev.SpanTraced) -> None:
        late.append(e)
        if e.step >= 7:  # step 8's (events carry the steps completed before them)
            step_8.set()

    async with trainbus.attach(j.run_dir, timeout=30) as att:
        assert "SpanTraced" not in att.job["events"]
        sub = att.subscribe(att.stream(ev.SpanTraced), receive)
        assert await att.wait_streaming(60)  # the job was told, and confirmed
        assert "SpanTraced" in att.job["events"]
        told = [await anyio.to_thread.run_sync(j.wait_log, "link_wants_received")]
        j.release(4)
        with anyio.fail_after(120):
            await step_8.wait()  # published before the job paused in step 8
        sub.dispose()  # the job is told again, and stops building them
        told.append(await anyio.to_thread.run_sync(j.wait_log, "link_wants_received"))
        j.release(8)
        await anyio.to_thread.run_sync(j.wait_for, "paused-12")
        j.release(12)
        ended = await att.wait(60)
    assert ended is not None and ended.step == 16
    assert [e.step for e in late] == [4, 5, 6, 7]  # steps 5 to 8, none after the dispose
    assert "SpanTraced" in told[0] and "SpanTraced" not in told[1]
    assert all(f"attach:pid={os.getpid()}" in t for t in told)
    result = j.finish()
    assert result["wanted_while_paused"] == [False, True, False]

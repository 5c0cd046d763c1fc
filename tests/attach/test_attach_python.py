"""trainbus.attach(run_dir): a real job in a subprocess, watched and steered from here."""

from __future__ import annotations

from collections.abc import Callable

import pytest

import trainbus
from trainbus import commands as cmd
from trainbus import events as ev

from ._job import Job


@pytest.mark.asyncio
async def test_attach_sees_the_events_in_order_and_the_files_go_at_the_end(
    job: Callable[..., Job],
) -> None:
    j = job("--max-steps", "30", "--pause-at", "2")
    j.wait_for("paused-2")
    seen: list[ev.BaseEvent] = []
    att = trainbus.attach(j.run_dir)
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

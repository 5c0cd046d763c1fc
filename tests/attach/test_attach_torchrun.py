"""Under torchrun, an attachment's command is agreed across ranks like any other."""

from __future__ import annotations

from collections.abc import Callable

import pytest

import trainbus
from trainbus import commands as cmd
from trainbus import events as ev

from ._job import Job

# Real processes on a loaded machine: each job starts Python and torch (tens of seconds). The
# ranks are gloo processes on the CPU on any host (``cpu_ranks``, tests/conftest.py).
pytestmark = [pytest.mark.timeout(600), pytest.mark.usefixtures("cpu_ranks")]


@pytest.mark.asyncio
async def test_an_attachments_stop_lands_on_the_same_step_on_both_ranks(
    job: Callable[..., Job],
) -> None:
    j = job("--max-steps", "30", "--pause-at", "5", nproc=2)
    j.wait_for("paused-5")
    async with trainbus.attach(j.run_dir, timeout=30) as att:
        assert att.job["rank"] == 0
        stopped = await att.request(cmd.StopTraining(reason="attach"))
        assert isinstance(stopped, ev.CommandApplied) and stopped.step == 5
        ended = await att.wait(60)
    assert ended is not None and ended.step == 5
    rank0 = j.finish()
    rank1 = j.result(1)
    assert rank0["steps"] == rank1["steps"] == 5
    assert rank0["last_step"] == rank1["last_step"] == 5
    assert rank0["stop_reason"] == rank1["stop_reason"] == "attach"

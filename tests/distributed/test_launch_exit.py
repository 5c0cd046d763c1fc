"""A finished 2-rank run exits cleanly, every time: no gloo thread outlives ``fit()``.

The abort it guards against (``terminate called without an active exception``, SIGABRT, rank 0
after ``FitEnded`` had streamed, about 1 launch in 23) came from the DDP wrapper the Trainer
keeps: it held the process group, so ``destroy_process_group()`` left gloo's threads running
until the interpreter tore them down at exit. ``fit()`` now releases them after the ranks' last
barrier; the workers here keep their Trainer alive until exit, as a script's top-level ``t``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from trainbus import Launcher
from trainbus import events as ev

from ._torchrun import SCRIPTS, env

pytestmark = pytest.mark.slow

LAUNCHES = 4


@pytest.fixture(autouse=True)
def _src_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", env()["PYTHONPATH"])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")
@pytest.mark.asyncio
@pytest.mark.timeout(600)
async def test_finished_launches_exit_cleanly_with_no_gloo_thread_left(tmp_path: Path) -> None:
    for i in range(LAUNCHES):
        out = tmp_path / f"launch{i}"
        out.mkdir()
        launcher = Launcher(SCRIPTS / "trainer_worker.py", str(out), "exit", nproc_per_node=2,
                            handle_signals=False)  # fmt: skip
        result = await launcher.launch()  # a LaunchError here: a rank did not exit 0
        assert result.returncode == 0
        assert isinstance(result.last_event, ev.FitEnded)
        assert result.last_event.reason == "completed" and result.stop_reason is None
        for rank in (0, 1):
            record = json.loads((out / f"exit-rank{rank}.json").read_text())
            assert record["reason"] == "completed"
            # Before the fix: ['gloo_tcp_loop', 'pt_gloo_runloop', 'pt_gloo_runloop'].
            assert not [t for t in record["threads"] if "gloo" in t], record["threads"]

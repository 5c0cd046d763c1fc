"""A finished 2-rank run exits cleanly, every time: no gloo thread outlives the process group.

The abort it guards against (``terminate called without an active exception``, SIGABRT, a rank
that had finished, about 1 launch in 23) comes from a destroyed group that something still
holds: ``destroy_process_group()`` then leaves gloo's threads running until the interpreter
tears them down at exit. Three holders were found:

- the DDP wrapper the Trainer keeps: ``fit()`` releases it after the ranks' last barrier (the
  workers here keep their Trainer alive until exit, as a script's top-level ``t``);
- torch itself: ``torch.distributed.nn.functional`` binds the live default group as a default
  argument when first imported after ``init_process_group``, which the first optimizer does
  (scripts/torch_gloo_threads.py, pure torch). ``trainbus._distributed.group`` imports it before
  any group exists, so a script that imports trainbus, owns its group and builds its
  optimizers afterwards (test_trainer_ddp.py's fixture) leaves nothing running either;
- torch's DTensor caches (sharding propagation, redistribute planners and transforms, mesh
  topology), which keep a sharded model's device mesh for the life of the process: trainbus
  empties them when a fit ends and, for DTensor work after it, in an exit handler.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from trainbus import Launcher
from trainbus import events as ev

from ._torchrun import SCRIPTS, env, free_port, torchrun

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("src_on_path")]

LAUNCHES = 4


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")
@pytest.mark.asyncio
@pytest.mark.timeout(600)
async def test_finished_launches_exit_cleanly_with_no_gloo_thread_left(tmp_path: Path) -> None:
    for i in range(LAUNCHES):
        out = tmp_path / f"launch{i}"
        out.mkdir()
        launcher = Launcher(SCRIPTS / "trainer_worker.py", str(out), "exit", nproc_per_node=2,
                            on_signal=None)  # fmt: skip
        result = await launcher.launch()  # a LaunchError here: a rank did not exit 0
        assert result.returncode == 0
        assert isinstance(result.last_event, ev.FitEnded)
        assert result.last_event.reason == "completed" and result.stop_reason is None
        for rank in (0, 1):
            record = json.loads((out / f"exit-rank{rank}.json").read_text())
            assert record["reason"] == "completed"
            # Before the fix: ['gloo_tcp_loop', 'pt_gloo_runloop', 'pt_gloo_runloop'].
            assert not [t for t in record["threads"] if "gloo" in t], record["threads"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")
@pytest.mark.timeout(600)
def test_script_owned_group_leaves_no_gloo_thread_after_destroy(tmp_path: Path) -> None:
    # The script initialises the group itself, then builds Trainers (and their optimizers):
    # the order in which torch's first optimizer would bind the live group for good. Plain
    # torchrun: under `trainbus launch` only one fit per process may link to the driver.
    for i in range(3):
        out = tmp_path / f"launch{i}"
        out.mkdir()
        torchrun("trainer_worker.py", str(out), "exit,exit", timeout=240)  # asserts exit 0
        for rank in (0, 1):
            threads = json.loads((out / f"owned-rank{rank}.json").read_text())["threads"]
            assert not [t for t in threads if "gloo" in t], threads


def one_rank(script: str, *args: str) -> dict[str, object]:
    """Run a one-rank gloo script (no torchrun); its last stdout line is JSON."""
    environ = env() | {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(free_port())}  # fmt: skip
    done = subprocess.run([sys.executable, str(SCRIPTS / script), *args], env=environ,
                          capture_output=True, text=True, timeout=240)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    record: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return record


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")
@pytest.mark.timeout(300)
def test_torch_binds_the_live_group_into_collective_defaults() -> None:
    # The torch cause, pure torch: the first optimizer after init_process_group imports
    # torch.distributed.nn.functional, whose defaults then hold the group past its destroy.
    after = one_rank("torch_gloo_threads.py")
    assert after["bound_in_defaults"] and after["group_alive"], (
        f"torch {after['torch']} no longer binds the live group into "
        "torch.distributed.nn.functional's defaults: the early import in "
        f"trainbus/_distributed/group.py may go ({after})"
    )
    # gloo's threads by name: torch 2.13 runs gloo_tcp_loop and two pt_gloo_runloop, 2.11 only
    # the two pt_gloo_runloop.
    assert "pt_gloo_runloop" in after["threads"], after
    first = one_rank("torch_gloo_threads.py", "--import-first")
    assert first["threads"] == [] and not first["group_alive"], first


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")
@pytest.mark.timeout(300)
def test_trainbus_imported_first_the_closed_group_is_gone() -> None:
    record = one_rank("owned_group_threads.py")
    assert record["threads"] == [] and not record["group_alive"], record
    assert record["logs"] == ["process_group_destroyed"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")
@pytest.mark.timeout(300)
def test_a_group_held_past_close_is_logged() -> None:
    record = one_rank("owned_group_threads.py", "--hold")
    threads = record["threads"]
    assert record["group_alive"] and isinstance(threads, list) and "pt_gloo_runloop" in threads
    assert record["logs"] == ["process_group_destroyed", "process_group_outlives_destroy"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")
@pytest.mark.timeout(300)
def test_a_sharded_model_leaves_no_gloo_thread_at_exit(tmp_path: Path) -> None:
    # torch's DTensor caches (sharding propagation, redistribute planners and transforms, mesh
    # topology) keep the device mesh, and so the destroyed group, for the life of the process;
    # trainbus's exit handler empties them while Python is whole.
    torchrun("fsdp_exit_threads.py", str(tmp_path), timeout=240)  # asserts exit 0
    for rank in (0, 1):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert "pt_gloo_runloop" in record["destroyed"], record  # torch's caches hold it
        assert record["exit"] == [], record

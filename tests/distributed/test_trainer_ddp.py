"""The Trainer under torchrun: 2 gloo ranks running tests/distributed/scripts/trainer_worker.py.

Each rank trains on its own shard and the ranks end identical; a rank-0 subscriber's stop
stops every rank at the same step; a command sent on rank 1 only is applied by both; a
checkpoint written under 2 ranks resumes under 2 ranks bit-identically; ``trainbus launch``
runs the same script with the subscribers in the driver.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import pytest

from trainbus import Launcher
from trainbus import commands as cmd
from trainbus import events as ev

from ._torchrun import SCRIPTS, env, torchrun

pytestmark = pytest.mark.slow

SEEDS = [str(s) for s in range(8)]


def read(out: Path, name: str) -> list[dict[str, Any]]:
    ranks = [json.loads((out / f"{name}-rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["rank"] for r in ranks] == [0, 1]
    return ranks


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One launch for the in-process modes (the script owns the group; Trainers adopt it),
    then save and resume as two launches (a new process resumes the checkpoint)."""
    out: Path = tmp_path_factory.mktemp("ddp")
    torchrun("trainer_worker.py", str(out), "shards,rank1,full,decided,stop,custom", *SEEDS,
             timeout=150)  # fmt: skip
    torchrun("trainer_worker.py", str(out), "save", timeout=60)
    torchrun("trainer_worker.py", str(out), "resume", timeout=60)
    return out


def test_each_rank_trains_on_its_shard_and_the_ranks_end_identical(out: Path) -> None:
    r0, r1 = read(out, "shards")
    assert (r0["rank_field"], r0["world_size"]) == (0, 2)  # FitStarted carries them
    assert (r1["rank_field"], r1["world_size"]) == (1, 2)
    # 64 samples, 2 epochs: each rank reads 32 a epoch, the shards are disjoint per epoch
    first0, first1 = set(r0["seen"][:32]), set(r1["seen"][:32])
    assert len(first0) == len(first1) == 32 and not first0 & first1
    assert r0["seen"][:32] != r0["seen"][32:64]  # set_epoch: another permutation each epoch
    assert r0["steps"] == r1["steps"] == 16  # 32 samples / batch 4 per epoch, 2 epochs
    assert r0["digest"] == r1["digest"]
    # metrics averaged across ranks: the same numbers on both
    assert r0["metrics"] == r1["metrics"] and r0["train_metrics"] == r1["train_metrics"]
    # a value a hook logged (ctx.log): each rank its rank, the mean of both on both
    assert r0["train_metrics"]["rank_logged"] == 0.5


def test_a_custom_step_under_ddp_with_accumulation_keeps_the_ranks_identical(out: Path) -> None:
    r0, r1 = read(out, "custom")
    assert r0["steps"] == r1["steps"] == 8  # 8 batches a rank an epoch, 2 a step, 2 epochs
    assert r0["digest"] == r1["digest"]
    assert r0["train_metrics"]["rank_logged"] == r1["train_metrics"]["rank_logged"] == 0.5


def test_a_rank0_stop_at_random_steps_stops_every_rank_at_the_same_step(out: Path) -> None:
    for seed in SEEDS:
        r0, r1 = read(out, f"stop{seed}")
        assert r0["steps"] == r1["steps"] and r0["digest"] == r1["digest"], seed
        assert r0["reason"] == r1["reason"] == "stopped", seed
        assert r0["stop_reason"] == r1["stop_reason"] == f"at {r0['at']}"
        assert r0["at"] <= r0["steps"] <= 16
        assert r0["last"] == r1["last"] == r0["steps"]


def test_a_declared_decision_step_is_a_common_sync_point(out: Path) -> None:
    r0, r1 = read(out, "decided")
    assert r0["reason"] == r1["reason"] == "stopped"
    assert r0["stop_reason"] == r1["stop_reason"] == "decided at 10"
    assert r0["steps"] == r1["steps"] == 10  # at the declared step, not the next log window
    assert r0["digest"] == r1["digest"]


def test_a_command_sent_on_rank1_only_is_applied_by_both(out: Path) -> None:
    r0, r1 = read(out, "rank1")
    assert r0["applied"] == r1["applied"] and len(r0["applied"]) == 1
    at = r0["applied"][0]
    assert at >= 5
    assert r0["lrs"] == r1["lrs"]
    assert r0["lrs"][at - 1] == 0.1 and r0["lrs"][at] == 0.01  # from the step after it
    assert r0["digest"] == r1["digest"]


def test_a_checkpoint_saved_under_2_ranks_resumes_under_2_ranks_bit_identically(
    out: Path,
) -> None:
    s0, s1 = read(out, "save")
    assert s0["steps"] == s1["steps"] == 11
    assert s0["saved"] == ["step-00000011-final.pt"]  # one file, written by rank 0
    full0, full1 = read(out, "full")
    res0, res1 = read(out, "resume")
    assert res0["steps"] == res1["steps"] == 16
    assert res0["digest"] == res1["digest"] == full0["digest"] == full1["digest"]
    assert res0["metrics"] == full0["metrics"]


@pytest.mark.asyncio
async def test_trainbus_launch_runs_a_trainer_script_with_the_subscribers_in_the_driver(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", env()["PYTHONPATH"])
    launcher = Launcher(SCRIPTS / "trainer_worker.py", str(tmp_path), "launched",
                        nproc_per_node=2, on_signal=None)  # fmt: skip
    bus = launcher.bus
    received: list[ev.BaseEvent] = []
    bus.events.subscribe(received.append)
    bus.stream(ev.StepEnded).subscribe(
        lambda e: bus.send(cmd.StopTraining(reason="driver")) if e.step == 3 else None
    )
    with anyio.fail_after(90):
        result = await launcher.launch()
    assert result.returncode == 0
    r0, r1 = read(tmp_path, "launched")
    assert r0["reason"] == r1["reason"] == "stopped" and r0["stop_reason"] == "driver"
    assert r0["steps"] == r1["steps"] < 160 and r0["digest"] == r1["digest"]
    assert isinstance(received[0], ev.TrainerBuilt)  # built on rank 0, delivered at its first run
    assert isinstance(received[1], ev.FitStarted) and received[1].world_size == 2
    assert isinstance(received[-1], ev.FitEnded) and received[-1].step == r0["steps"]
    steps = [e.step for e in received if isinstance(e, ev.StepEnded)]
    assert steps == list(range(1, r0["steps"] + 1))  # every StepEnded of rank 0, in order
    applied = [e for e in received if isinstance(e, ev.CommandApplied)]
    assert [type(e.command).__name__ for e in applied] == ["StopTraining"]


def test_a_2_rank_checkpoint_resumes_on_one_process_at_the_next_epoch_boundary(
    out: Path,
) -> None:
    import structlog
    import torch
    from torch.nn import functional as F
    from torch.utils.data import DataLoader, TensorDataset

    import trainbus

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 3, (64,), generator=g))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    t = trainbus.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                         DataLoader(data, batch_size=4, shuffle=True), loss_fn=F.cross_entropy,
                         max_epochs=3, progress=False, on_signal=None)  # fmt: skip
    started: list[ev.FitStarted] = []
    t.bus.stream(ev.FitStarted).subscribe(started.append)
    with structlog.testing.capture_logs() as logs:
        result = t.fit_sync(resume=out / "ckpt" / "step-00000011-final.pt")
    warned = [e for e in logs if e["event"] == "resume_world_size_changed"]
    assert warned and warned[0]["saved_world_size"] == 2 and warned[0]["world_size"] == 1
    # saved at step 11 = epoch 1, batch 3 of 8: the rest of epoch 1 is not replayed
    assert (started[0].step, started[0].epoch, started[0].world_size) == (11, 2, 1)
    assert result.steps == 11 + 16 and result.epochs == 3  # one whole epoch on one process


def test_sigterm_on_every_rank_stops_them_at_the_same_step(tmp_path: Path) -> None:
    import os
    import signal
    import subprocess
    import sys
    import time

    from ._torchrun import free_port

    cmd_line = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                "--master_addr=127.0.0.1", f"--master_port={free_port()}",
                str(SCRIPTS / "trainer_worker.py"), str(tmp_path), "signal"]  # fmt: skip
    proc = subprocess.Popen(cmd_line, env=env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        ready = [tmp_path / "ready-0", tmp_path / "ready-1"]
        while not all(p.exists() and p.read_text() for p in ready):
            assert proc.poll() is None and time.monotonic() < deadline, "workers never got going"
            time.sleep(0.05)
        for p in ready:  # what torchrun forwards on SIGTERM/SIGINT: a signal on every rank
            os.kill(int(p.read_text()), signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 0, stderr[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    r0, r1 = read(tmp_path, "signal")
    assert r0["reason"] == r1["reason"] == "stopped"
    assert r0["stop_reason"] == r1["stop_reason"] == "signal"
    # Each rank's run() raised SystemExit(128 + SIGTERM) after the graceful, agreed stop.
    assert r0["raised"] == r1["raised"] == 128 + signal.SIGTERM
    assert r0["ending"] == r1["ending"] == "signal"
    assert r0["steps"] == r1["steps"] < 200 * 8 and r0["digest"] == r1["digest"]


def test_set_metrics_add_every_ranks_sums(tmp_path: Path) -> None:
    torchrun("trainer_worker.py", str(tmp_path), "setmetric", timeout=90)
    r0, r1 = read(tmp_path, "setmetric")
    assert r0["evals"] == r1["evals"] and len(r0["evals"]) == 1  # the epoch's end
    (metrics,) = r0["evals"]
    # Each rank summed its own evaluation batches; every rank sees both ranks' sums.
    n0, n1 = sum(r0["local"]), sum(r1["local"])
    assert n0 == n1 == 32  # the 64 samples of the set, sharded: no rank evaluates the whole set
    assert metrics["val_n"] == n0 + n1 + n1 / 1000  # rank 1's samples weigh 1 in "rank"
    assert 0.0 <= metrics["val_acc"] <= 1.0
    # Raised on rank 1 only: left out on both ranks, counted on both.
    assert "val_flaky" not in metrics
    assert r0["failures"] == r1["failures"] == {"flaky": 1}
    assert r0["metrics"] == r1["metrics"] == metrics

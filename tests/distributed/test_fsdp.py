"""FSDP2 (fully_shard) under trainbus: 2 gloo ranks running scripts/fsdp_worker.py.

An MLP 16-64-64-H, every Linear then the root sharded, AdamW: H=5 splits the head 3 + 2
(uneven), H=6 3 + 3 (even). One launch trains (parity with a hand-written FSDP2 loop, the grad norm
monitor, a NaN in one rank's shard, straight runs and runs stopped mid-epoch with sharded
checkpoints); a second launch (new processes) resumes them, fails to load a damaged folder,
refuses a one-file checkpoint and exports a folder to one plain file; a third (1 rank)
resumes a 2-rank folder through DCP's resharding.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import trainbus

from ._torchrun import env, torchrun

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TRAIN = "ddp,earlyopt,mesh,saveapi,parity,gradmon,nan,badstate,mixed,full5,save5,full6,save6"
RESUME = "resume5,resume6,loadfail,onefile,export"


def read(out: Path, name: str) -> list[dict[str, Any]]:
    ranks = [json.loads((out / f"{name}-rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["rank"] for r in ranks] == [0, 1]
    return ranks


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out: Path = tmp_path_factory.mktemp("fsdp")
    torchrun("fsdp_worker.py", str(out), TRAIN, timeout=240)
    torchrun("fsdp_worker.py", str(out), RESUME, timeout=240)
    torchrun("fsdp_worker.py", str(out), "reshard", nproc=1, timeout=240)
    return out


def test_trainbus_with_the_default_ddp_equals_a_hand_written_fsdp2_loop(out: Path) -> None:
    for r in read(out, "parity"):
        assert r["wrapped"] == "FSDPSequential"  # never wrapped in DDP
        assert r["steps"] == 10
        assert r["losses"] == r["hand_losses"]  # every loss, exactly
        assert r["norms"] == r["hand_norms"]  # clip_grad_norm's pre-clip norm, exactly
        assert r["same_params"]  # torch.equal on every parameter and optimizer moment
        assert r["norm_types"] == ["Tensor"]  # StepEnded.grad_norm: a plain tensor


def test_clipping_reads_dtensor_norms_in_a_partial_last_window(out: Path) -> None:
    # 10 steps, log_every=4: the last window holds steps 9 and 10 only.
    for r in read(out, "parity"):
        last = r["hand_norms"][8:]
        assert r["train_grad_norm"] == pytest.approx(sum(last) / 2, rel=1e-6)


def test_grad_norm_monitor_with_the_default_subscriber_runs_on_every_rank(out: Path) -> None:
    r0, r1 = read(out, "gradmon")
    assert r0["steps"] == r1["steps"] == 10  # no deadlock: rank 1 measured too
    assert r0["measured"] == [1, 3, 5, 7, 9]  # every 2nd update, on rank 0's subscriber
    assert r1["measured"] == []  # nobody subscribes there; it still took part
    assert r0["types"] == ["Tensor"] and all(v > 0 for v in r0["values"])


def test_a_nan_in_one_ranks_shard_refuses_the_save_on_every_rank(out: Path) -> None:
    for r in read(out, "nan"):
        assert r["reason"] == "completed"
        assert r["checkpoint"] is None and r["written"] == []


def test_a_save_failing_on_one_rank_fails_every_rank_alike_and_leaves_nothing(out: Path) -> None:
    # Only rank 0 writes the callback states: its refusal reaches rank 1 as the same error.
    r0, r1 = read(out, "badstate")
    assert r0["error"] == r1["error"] == "ConfigError"
    assert "callback_states" in r0["message"] and "(on rank 0)" in r1["message"]
    assert r0["left"] == r1["left"] == []  # no folder, no temporary folder


def test_mixed_precision_and_activation_checkpointing_train_and_save(out: Path) -> None:
    for r in read(out, "mixed"):
        assert (r["reason"], r["steps"]) == ("completed", 10)
        assert r["checkpoint"] == str(out / "mixed" / "step-00000010-final")
        assert r["forwards"] == 20  # each step's forward, and its recomputation in the backward
        assert r["dtype"] == "torch.float32"  # the sharded parameters: bf16 only for compute
        assert r["loss"] == r["loss"]  # finite: not NaN


@pytest.mark.parametrize("head", [5, 6])
def test_sharded_checkpoints_are_folders_with_retention(out: Path, head: int) -> None:
    for r in read(out, f"save{head}"):
        assert r["steps"] == 7
        folder = out / f"ckpt{head}"
        assert [Path(p).name for p in r["saved"]] == [
            "step-00000002", "step-00000004", "step-00000006", "step-00000007-final",
        ]  # fmt: skip
        assert r["checkpoint"] == str(folder / "step-00000007-final")
    final = out / f"ckpt{head}" / "step-00000007-final"
    assert sorted(p.name for p in final.iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "rank-0.pt", "rank-1.pt", "trainbus.pt",
    ]  # fmt: skip
    # keep_last=2 removed step 2; no temporary folder is left
    assert not (out / f"ckpt{head}" / "step-00000002").exists()
    assert not [p for p in (out / f"ckpt{head}").iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("head", [5, 6])
def test_resume_latest_equals_the_uninterrupted_run(out: Path, head: int) -> None:
    for rank, r in enumerate(read(out, f"resume{head}")):
        assert r["steps"] == 10
        straight = torch.load(out / f"full{head}-rank{rank}.pt", weights_only=True)
        resumed = torch.load(out / f"resume{head}-rank{rank}.pt", weights_only=True)
        assert sorted(straight) == sorted(resumed)
        assert len(straight) == 6 * 4  # 6 parameters, each with step, exp_avg, exp_avg_sq
        for key, value in straight.items():
            assert torch.equal(value, resumed[key]), key


def test_a_load_failure_on_one_rank_stops_every_rank_with_a_checkpoint_error(out: Path) -> None:
    r0, r1 = read(out, "loadfail")
    assert r0["error"] == r1["error"] == "CheckpointError"
    assert "rank-1.pt cannot be read" in r1["message"]
    assert "rank 1" in r0["message"] and "rank-1.pt" in r0["message"]


def test_another_world_size_resumes_through_dcp_resharding(out: Path) -> None:
    # The 2-rank checkpoint of step 7 on 1 rank: every parameter as saved (the exported full
    # tensors), then the next epoch boundary (epoch 2, all 40 samples: 10 steps).
    (r,) = [json.loads((out / "reshard-rank0.json").read_text())]
    assert r["world"] == 1 and r["same"]
    assert r["steps"] == 7 + 10


def test_bad_input_is_refused_before_any_step(out: Path) -> None:
    for r in read(out, "ddp"):
        assert r["error"] == "ConfigError" and "ddp=True" in r["message"]
        assert "None (the default) or False" in r["message"]
    for r in read(out, "earlyopt"):
        assert r["error"] == "ConfigError" and "after fully_shard" in r["message"]
    for r in read(out, "onefile"):
        assert r["error"] == "CheckpointError" and "one-file checkpoint" in r["message"]
    for r in read(out, "mesh"):
        assert r["error"] == "ConfigError" and "a device mesh of 1 rank(s)" in r["message"]
        assert "all 2 ranks" in r["message"]
    for r in read(out, "saveapi"):
        assert r["error"] == "ConfigError" and "save_sharded" in r["message"]
    assert not (out / "never").exists()


def test_export_writes_one_file_equal_to_full_tensor(out: Path) -> None:
    (r,) = [json.loads((out / "export-rank0.json").read_text())]
    assert r["same"]
    assert r["keys"] == ["0.bias", "0.weight", "2.bias", "2.weight", "4.bias", "4.weight"]


def test_the_export_cli_writes_the_same_file(out: Path) -> None:
    folder = out / "ckpt5" / "step-00000007-final"
    target = out / "cli.pt"
    done = subprocess.run([sys.executable, "-m", "trainbus", "export", str(folder), str(target)],
                          env=env(), capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(target)
    exported = torch.load(target, weights_only=True)
    expected = torch.load(out / "exported.pt", weights_only=True)
    assert sorted(exported) == sorted(expected)
    assert all(torch.equal(exported[k], expected[k]) for k in expected)
    # a folder missing a rank's shard file: refused, naming the file
    broken = out / "missing-shard"
    shutil.copytree(folder, broken)
    (broken / "__1_0.distcp").unlink()
    done = subprocess.run([sys.executable, "-m", "trainbus", "export", str(broken), str(target)],
                          env=env(), capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 1
    assert "missing the shard file __1_0.distcp" in done.stderr


def test_an_unsharded_run_refuses_a_checkpoint_folder(out: Path) -> None:
    folder = out / "ckpt5" / "step-00000007-final"
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                          nn.Linear(64, 5))  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = [(torch.randn(4, 16), torch.randint(0, 5, (4,)))]
    t = trainbus.Trainer(model, opt, data, loss_fn=F.cross_entropy, max_epochs=1,
                         progress=False, handle_signals=False)  # fmt: skip
    with pytest.raises(trainbus.CheckpointError, match=r"sharded checkpoint folder.*export_full"):
        t.fit_sync(resume=folder)
    assert t.result is None  # before any step


def test_latest_skips_a_damaged_folder_and_stale_temporary_folders_go(
    out: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "ckpt"
    shutil.copytree(out / "ckpt5", folder)
    good = folder / "step-00000010-final"  # resume5's final save
    # newer, but missing rank 1's own file: skipped as invalid
    shutil.copytree(good, folder / "step-00000011")
    (folder / "step-00000011" / "rank-1.pt").unlink()
    # newer still, one shard file truncated
    shutil.copytree(good, folder / "step-00000012")
    shard = folder / "step-00000012" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    # a temporary folder a killed writer left (its pid is not running)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    stale = folder / f".step-00000013.{int(dead.stdout)}.0a1b2c3d.trainbus-tmp"
    shutil.copytree(good, stale)
    with pytest.raises(trainbus.CheckpointError, match=r"missing rank-1\.pt"):
        trainbus.checkpoint.read_checkpoint(folder / "step-00000011")
    with pytest.raises(trainbus.CheckpointError, match=r"__0_0\.distcp is truncated"):
        trainbus.checkpoint.read_checkpoint(folder / "step-00000012")
    assert trainbus.checkpoint.latest_checkpoint(folder) == good
    assert not stale.exists()
    loaded = trainbus.checkpoint.read_checkpoint(good)
    assert loaded.meta["sharded"] and loaded.meta["world_size"] == 2
    assert loaded.meta["param_shapes"]["4.weight"] == [5, 64]  # the full shape
    assert loaded.state.step == 10


def test_a_folder_marked_best_is_copied_whole(out: Path, tmp_path: Path) -> None:
    from trainbus.callbacks._checkpoint import copy_as_best

    source = tmp_path / "step-00000007"
    shutil.copytree(out / "ckpt5" / "step-00000007-final", source)
    best = copy_as_best(source, 7)
    assert best == tmp_path / "step-00000007-best"
    assert sorted(p.name for p in best.iterdir()) == sorted(p.name for p in source.iterdir())
    assert trainbus.checkpoint.read_checkpoint(best).state.step == 7
    assert copy_as_best(source, 7) == best  # again: the older copy replaced
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000007", "step-00000007-best"]


@pytest.mark.parametrize("where", ["missing/m.pt", "afile/m.pt"])
def test_export_to_an_unwritable_place_is_a_checkpoint_write_error(out: Path, where: str) -> None:
    from trainbus.checkpoint import CheckpointWriteError, export_full

    (out / "afile").write_text("")
    target = out / where
    with pytest.raises(CheckpointWriteError, match=target.parent.name):
        export_full(out / "ckpt5" / "step-00000007-final", target)
    assert not target.parent.is_dir() or not any(target.parent.iterdir())

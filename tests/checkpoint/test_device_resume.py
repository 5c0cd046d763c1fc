"""Resume on CUDA: checkpoints load to the host, tensors go where the live model and
optimizer keep them, the RNG states are restored for the GPUs that exist, and no second copy of
the weights outlives the restore. CPU-checkable with ``tests/_fake_cuda.py``; the equality of a
resumed run with a straight one runs on a real GPU (``cuda`` marker) and on the CPU."""

from __future__ import annotations

import gc
import subprocess
import sys
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from structlog.testing import capture_logs
from tests._fake_cuda import FakeCuda, HostModel, placed_batches

import trainbus._trainer.resume
from trainbus import Trainer
from trainbus.checkpoint import Checkpoint, capture_rng, read_checkpoint, restore_rng
from trainbus.testing import tiny_loader, tiny_model

CHILD = Path(__file__).with_name("_device_resume_child.py")


def host_trainer(folder: Path, max_epochs: int) -> tuple[Trainer, torch.optim.Optimizer]:
    model = HostModel()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    return Trainer(model, opt, placed_batches(3), max_epochs=max_epochs, device="cuda:0",
                   checkpoint_dir=folder, progress=False, on_signal=None), opt  # fmt: skip


def test_a_cuda_run_resumes_from_a_host_loaded_checkpoint(
    fake_cuda: FakeCuda, tmp_path: Path
) -> None:
    first, _ = host_trainer(tmp_path, 2)
    assert first.fit_sync().steps == 6
    saved = [s.clone() for s in fake_cuda.rng]
    fake_cuda.rng = [s + 1 for s in saved]  # the generators moved on since the save
    resumed, opt = host_trainer(tmp_path, 3)
    result = resumed.fit_sync(resume="latest")  # loaded to the GPU, the RNG states were refused
    assert result.reason == "completed" and result.steps == 9
    assert set(fake_cuda.restored) == {0, 1}
    assert all(torch.equal(fake_cuda.restored[i], saved[i]) for i in (0, 1))
    # Adam's step where a straight run keeps it (non-fused, non-capturable: on the host).
    assert {str(s["step"].device) for s in opt.state.values()} == {"cpu"}


def test_a_checkpoint_from_more_gpus_restores_on_fewer_saying_so(
    fake_cuda: FakeCuda, tmp_path: Path
) -> None:
    first, _ = host_trainer(tmp_path, 1)
    first.fit_sync()
    saved = [s.clone() for s in fake_cuda.rng]
    fake_cuda.count = 1  # the same run, resumed where one GPU is visible
    resumed, _ = host_trainer(tmp_path, 2)
    with capture_logs() as logs:
        assert resumed.fit_sync(resume="latest").reason == "completed"
    assert set(fake_cuda.restored) == {0} and torch.equal(fake_cuda.restored[0], saved[0])
    said = [e for e in logs if e["event"] == "rng_cuda_devices_differ"]
    assert [(e["saved_devices"], e["devices"], e["restored"]) for e in said] == [(2, 1, 1)]


def test_no_copy_of_the_loaded_weights_outlives_the_restore(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def trainer(max_steps: int) -> Trainer:
        model = tiny_model()
        return Trainer(model, torch.optim.Adam(model.parameters()), tiny_loader(3, 8),
                       loss_fn=F.cross_entropy, max_steps=max_steps, device="cpu",
                       checkpoint_dir=tmp_path, progress=False, on_signal=None)  # fmt: skip

    path = trainer(2).fit_sync().last_checkpoint
    assert path is not None
    loaded: list[weakref.ref[torch.Tensor]] = []
    read = trainbus._trainer.resume.read_checkpoint

    def read_and_watch(*args: Any, **kwargs: Any) -> Checkpoint:
        checkpoint = read(*args, **kwargs)
        loaded.extend(weakref.ref(t) for t in checkpoint.model.values())
        loaded.extend(weakref.ref(s["exp_avg"]) for s in checkpoint.optimizer["state"].values())
        return checkpoint

    monkeypatch.setattr(trainbus._trainer.resume, "read_checkpoint", read_and_watch)
    alive: list[int] = []

    def count_copies(ctx: Any) -> None:
        # A loaded tensor still alive must BE the live optimizer's state (on the host,
        # load_state_dict adopts a tensor already on the parameter's device and dtype): only
        # a copy kept beside the live objects counts.
        gc.collect()
        live = {id(t) for s in ctx.optimizer.state.values() for t in s.values()}
        alive.append(sum(t is not None and id(t) not in live for t in (r() for r in loaded)))

    resumed = trainer(4)
    resumed.add_hook("batch", count_copies)
    assert resumed.fit_sync(resume=path).steps == 4
    assert loaded and alive == [0, 0]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_a_resumed_run_equals_a_straight_one(device: str, tmp_path: Path) -> None:
    """With deterministic algorithms on: parameters, optimizer state and its placement."""
    done = subprocess.run([sys.executable, str(CHILD), device, str(tmp_path)],
                          capture_output=True, text=True, timeout=100)  # fmt: skip
    assert done.returncode == 0 and done.stdout.splitlines()[-1] == "equal", (
        done.stdout + done.stderr
    )


def test_a_checkpoint_from_fewer_gpus_restores_those_saying_so(
    fake_cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_cuda.count = 1
    state = capture_rng()
    assert len(state["cuda"]) == 1
    fake_cuda.count = 2
    with capture_logs() as logs:
        restore_rng(state)
    assert set(fake_cuda.restored) == {0}
    assert torch.equal(fake_cuda.restored[0], fake_cuda.rng[0])
    said = [e for e in logs if e["event"] == "rng_cuda_devices_differ"]
    assert [(e["saved_devices"], e["devices"], e["restored"]) for e in said] == [(1, 2, 1)]


def test_the_same_gpu_count_restores_silently(fake_cuda: FakeCuda) -> None:
    state = capture_rng()
    with capture_logs() as logs:
        restore_rng(state)
    assert set(fake_cuda.restored) == {0, 1} and not logs


def test_restored_keeps_what_the_loop_needs_and_drops_the_weights(valid: Path) -> None:
    checkpoint = read_checkpoint(valid)
    light = checkpoint.restored()
    assert light.model == {} and light.optimizer == {}
    assert light.scheduler is None and light.scaler is None
    assert light.state is checkpoint.state and light.rng is checkpoint.rng
    assert light.data_order is checkpoint.data_order and light.meta is checkpoint.meta
    assert light.callbacks is checkpoint.callbacks and light.path == checkpoint.path

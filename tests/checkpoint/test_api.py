"""Checkpoints: an exact round trip, resuming a run exactly, the final checkpoint, and a
checkpoint folder that exists only once something was saved."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from trainbus import CheckpointError, ConfigError, PerEpoch, StepContext, Trainer
from trainbus import commands as cmd
from trainbus import events as ev
from trainbus.checkpoint import (
    TrainState,
    latest_checkpoint,
    load_checkpoint,
    read_checkpoint,
    save_checkpoint,
)
from trainbus.testing import EventRecorder, tiny_loader, tiny_model

DATA = tiny_loader(4, 8)  # deterministic, not shuffled: batch i is the same in every run


def _params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _close(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.allclose(x, y, atol=1e-6) for x, y in zip(a, b, strict=True))


def _setup(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    model = tiny_model(seed=seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # momentum: optimizer state
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)  # scheduler state
    return model, opt, sched


def _trainer(seed: int = 0, **kwargs: Any) -> Trainer:
    model, opt, sched = _setup(seed)
    kwargs.setdefault("on_signal", None)
    return Trainer(model, opt, DATA, loss_fn=F.cross_entropy, scheduler=sched, **kwargs)


def _send_at(trainer: Trainer, step: int, command: cmd.Command) -> None:
    """Send ``command`` from the training thread after optimizer step ``step``: it is applied
    at that step's poll point."""

    def hook(ctx: StepContext) -> None:
        if ctx.step == step:
            trainer.bus.send(command)

    trainer.add_hook("after_optimizer_step", hook)


def _stop_at(trainer: Trainer, step: int) -> None:
    _send_at(trainer, step, cmd.StopTraining(reason="pause"))


# ---------------------------------------------------------------------------- round trip


def test_save_load_round_trip_restores_everything(tmp_path: Path) -> None:
    model, opt, sched = _setup()
    for x, y in DATA[:3]:  # build real optimizer and scheduler state
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        sched.step()
    state = TrainState(step=3, epoch=1, batch_in_epoch=2)
    random.seed(5)
    torch.manual_seed(5)
    path = save_checkpoint(tmp_path / "ck", tag="t", state=state, model=model, optimizer=opt,
                           scheduler=sched, scaler=None, metrics={"val_loss": 0.5})  # fmt: skip
    assert path == tmp_path / "ck" / "step-00000003-t.pt"
    assert [p.name for p in (tmp_path / "ck").iterdir()] == [path.name]  # no temp file left
    expected_rng = (random.random(), torch.rand(3))

    other, other_opt, other_sched = _setup(seed=1)
    assert not _close(_params(other), _params(model))
    random.seed(99)
    torch.manual_seed(99)
    loaded, metrics = load_checkpoint(path, model=other, optimizer=other_opt,
                                      scheduler=other_sched, scaler=None)  # fmt: skip
    assert loaded == state
    assert metrics == {"val_loss": 0.5}
    assert all(torch.equal(a, b) for a, b in zip(_params(other), _params(model), strict=True))
    assert other_sched.state_dict() == sched.state_dict()
    assert other_opt.param_groups[0]["lr"] == pytest.approx(opt.param_groups[0]["lr"])
    for p, q in zip(model.parameters(), other.parameters(), strict=True):
        assert torch.equal(opt.state[p]["momentum_buffer"], other_opt.state[q]["momentum_buffer"])
    assert random.random() == expected_rng[0]
    assert torch.equal(torch.rand(3), expected_rng[1])


def test_load_rejects_a_file_that_is_not_a_checkpoint(tmp_path: Path) -> None:
    bogus = tmp_path / "x.pt"
    torch.save({"hello": 1}, bogus)
    model, opt, sched = _setup()
    with pytest.raises(CheckpointError, match=r"x\.pt: not a trainbus checkpoint"):
        load_checkpoint(bogus, model=model, optimizer=opt, scheduler=sched, scaler=None)
    with pytest.raises(CheckpointError, match=r"missing\.pt: no such file"):
        load_checkpoint(tmp_path / "missing.pt", model=model, optimizer=opt, scheduler=sched,
                        scaler=None)  # fmt: skip


def test_latest_checkpoint_is_the_highest_step(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path / "none") is None
    model, opt, sched = _setup()
    for step, tag in [(2, None), (10, "best"), (9, None)]:
        save_checkpoint(tmp_path, tag=tag, state=TrainState(step=step), model=model,
                        optimizer=opt, scheduler=sched, scaler=None, metrics={})  # fmt: skip
    found = latest_checkpoint(tmp_path)
    assert found is not None and found.name == "step-00000010-best.pt"


# ---------------------------------------------------------------------------- resuming


def _full_run(steps: int = 4) -> list[torch.Tensor]:
    trainer = _trainer(max_steps=steps)
    trainer.fit_sync()
    return _params(trainer.settings.model)


def test_run_of_2_plus_resumed_run_of_2_equals_run_of_4(tmp_path: Path) -> None:
    full = _full_run(4)
    first = _trainer(max_steps=2, checkpoint_dir=tmp_path)
    r1 = first.fit_sync()
    assert r1.reason == "completed" and r1.last_checkpoint is not None
    second = _trainer(seed=1, max_steps=4, checkpoint_dir=tmp_path)
    fetched: list[int] = []
    second.add_hook("batch", lambda ctx: fetched.append(ctx.batch_index))
    r2 = second.fit_sync(resume=r1.last_checkpoint)
    assert r2.steps == 4
    assert fetched == [2, 3]
    assert _close(_params(second.settings.model), full)


@pytest.mark.parametrize("how", ["path", "latest"])
def test_resume_continues_from_the_saved_step(tmp_path: Path, how: str) -> None:
    full = _full_run(4)
    first = _trainer(max_steps=4, checkpoint_dir=tmp_path)
    _stop_at(first, 2)
    r1 = first.fit_sync()
    assert (r1.reason, r1.steps) == ("stopped", 2)
    assert r1.last_checkpoint == str(tmp_path / "step-00000002-final.pt")

    resume = r1.last_checkpoint if how == "path" else "latest"
    second = _trainer(seed=1, max_steps=4, checkpoint_dir=tmp_path)
    rec = EventRecorder(second.bus)
    fetched: list[int] = []
    second.add_hook("batch", lambda ctx: fetched.append(ctx.batch_index))
    r2 = second.fit_sync(resume=resume)
    assert (r2.reason, r2.steps) == ("completed", 4)
    (loaded,) = rec.of_type(ev.CheckpointLoaded)
    assert loaded.path == r1.last_checkpoint and loaded.step == 2
    assert rec.names()[:4] == [
        "TrainerBuilt",
        "CheckpointLoading",
        "CheckpointLoaded",
        "FitStarted",
    ]
    assert rec.of_type(ev.FitStarted)[0].step == 2
    assert [e.step for e in rec.of_type(ev.StepEnded)] == [3, 4]
    assert fetched == [2, 3]  # mid-epoch resume
    assert [e.lr for e in rec.of_type(ev.SchedulerStepped)] == pytest.approx(
        [0.1 * 0.7**3, 0.1 * 0.7**4]
    )
    assert _close(_params(second.settings.model), full)


def test_resume_from_a_checkpoint_saved_at_epoch_end(tmp_path: Path) -> None:
    def epoch_trainer(**kwargs: Any) -> Trainer:
        model, opt, _ = _setup()
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return Trainer(model, opt, DATA[:2], loss_fn=F.cross_entropy, max_epochs=3,
                       scheduler=PerEpoch(sched), on_signal=None,
                       **kwargs)  # fmt: skip

    full = epoch_trainer(checkpoint_dir=tmp_path)

    # EpochEnded is a barrier: a save sent from its subscriber is applied before the next step
    # (the built-in Checkpointing(every_epochs=...) callback does exactly this).
    def save_after_first_epoch(event: ev.EpochEnded) -> None:
        if event.epoch == 0:
            full.bus.send(cmd.SaveCheckpoint(tag="epoch"))

    full.bus.subscribe(full.bus.stream(ev.EpochEnded), save_after_first_epoch)
    full.fit_sync()
    saved = tmp_path / "step-00000002-epoch.pt"
    assert saved.is_file()

    resumed = epoch_trainer()
    rec = EventRecorder(resumed.bus)
    resumed.fit_sync(resume=saved)
    assert [e.epoch for e in rec.of_type(ev.EpochStarted)] == [1, 2]
    assert [e.lr for e in rec.of_type(ev.SchedulerStepped)] == pytest.approx([0.025, 0.0125])
    assert _close(_params(resumed.settings.model), _params(full.settings.model))


def test_resume_latest_without_checkpoint_starts_fresh(tmp_path: Path) -> None:
    trainer = _trainer(max_steps=2, checkpoint_dir=tmp_path / "new")
    rec = EventRecorder(trainer.bus)
    result = trainer.fit_sync(resume="latest")
    assert result.steps == 2 and not rec.of_type(ev.CheckpointLoaded)
    assert _close(_params(trainer.settings.model), _full_run(2))


# ---------------------------------------------------------------------------- final checkpoint


def test_final_checkpoint_of_a_completed_run(tmp_path: Path) -> None:
    trainer = _trainer(max_epochs=1, checkpoint_dir=tmp_path / "ck")
    rec = EventRecorder(trainer.bus)
    result = trainer.fit_sync()
    expected = tmp_path / "ck" / "step-00000004-final.pt"
    assert result.reason == "completed" and result.last_checkpoint == str(expected)
    assert expected.is_file()
    (saved,) = rec.of_type(ev.CheckpointSaved)
    assert (saved.path, saved.tag, saved.step) == (str(expected), "final", 4)
    assert rec.names()[-2:] == ["CheckpointSaved", "FitEnded"]
    saved_ck = read_checkpoint(expected)
    # epoch 0's end work ran (closed_epoch): the run is past it
    assert saved_ck.state == TrainState(step=4, epoch=1, batch_in_epoch=0, samples_seen=32,
                                        closed_epoch=0)  # fmt: skip
    assert all(
        torch.equal(saved_ck.model[k], v.cpu())  # read back on the CPU; the run's device may not be
        for k, v in trainer.settings.model.state_dict().items()
    )


def test_final_checkpoint_of_a_stopped_run(tmp_path: Path) -> None:
    trainer = _trainer(max_steps=10, checkpoint_dir=tmp_path)
    _stop_at(trainer, 3)
    result = trainer.fit_sync()
    assert result.reason == "stopped"
    assert result.last_checkpoint == str(tmp_path / "step-00000003-final.pt")
    assert read_checkpoint(result.last_checkpoint).state == TrainState(
        step=3, batch_in_epoch=3, samples_seen=24
    )


def test_no_duplicate_final_checkpoint_after_a_save_at_the_last_step(tmp_path: Path) -> None:
    trainer = _trainer(max_steps=2, checkpoint_dir=tmp_path)
    _send_at(trainer, 2, cmd.SaveCheckpoint(tag="last"))
    result = trainer.fit_sync()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000002-last.pt"]
    assert result.last_checkpoint == str(tmp_path / "step-00000002-last.pt")


# ---------------------------------------------------------------------------- the folder


def test_checkpoint_dir_not_created_by_a_bad_config(tmp_path: Path) -> None:
    target = tmp_path / "nested" / "run"
    with pytest.raises(ConfigError):
        _trainer(max_steps=0, checkpoint_dir=target)
    assert not target.exists() and not (tmp_path / "nested").exists()


def test_checkpoint_dir_not_created_before_the_first_save(tmp_path: Path) -> None:
    target = tmp_path / "run"
    _trainer(max_steps=2, checkpoint_dir=target)
    assert not target.exists()


def test_checkpoint_dir_not_created_by_a_failed_run(tmp_path: Path) -> None:
    target = tmp_path / "run"
    trainer = _trainer(max_steps=2, checkpoint_dir=target)

    def boom(ctx: StepContext) -> None:
        raise RuntimeError("boom")

    trainer.add_hook("loss", boom)
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit_sync()
    assert trainer.result is not None and trainer.result.reason == "failed"
    assert trainer.result.last_checkpoint is None
    assert not target.exists()

"""Checkpointing(keep_last=..., keep_best=...): which files a run keeps (across resumes too),
that the file just saved (the newest complete checkpoint) is never the one deleted, and the
best weights loaded at the end (load_best_at_end)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import anyio
import pytest
import structlog
import torch
from reactivex import operators as ops

from trainbus import CheckpointError, ConfigError, EvalSchedule, EventBus
from trainbus import commands as cmd
from trainbus import events as ev
from trainbus.callbacks import Checkpointing, EarlyStopping, RunPlan
from trainbus.testing import EventRecorder


def test_a_run_keeps_the_last_and_the_best(tmp_path: Path, trainer_factory: Any) -> None:
    trainer = trainer_factory(
        [Checkpointing(every_epochs=1, monitor="val_score", keep_last=2, keep_best=1)],
        epochs=5, batches=2, score=[3.0, 2.0, 4.0, 1.0, 5.0], checkpoint_dir=tmp_path,
    )  # fmt: skip
    result = trainer.fit_sync()
    assert result.reason == "completed" and result.steps == 10
    # Cadence saves at 2, 4, 6, 8, 10 (keep 8, 10); best at 2, 4, 8 (keep 8).
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step-00000008-best.pt",
        "step-00000008.pt",
        "step-00000010.pt",
    ]


def _saved(bus: EventBus, folder: Path, step: int, tag: str | None, **metrics: float) -> Path:
    path = folder / (f"step-{step:08d}" + (f"-{tag}" if tag else "") + ".pt")
    path.write_bytes(b"checkpoint")
    bus.publish(ev.CheckpointSaved(step=step, epoch=0, path=str(path), tag=tag, metrics=metrics))
    bus.flush()
    return path


def _names(folder: Path, bus: EventBus | None = None) -> list[str]:
    """The folder's files, once ``bus`` (when given) has run the removals its books asked for:
    they run off the event loop, in an async subscription."""
    if bus is not None:

        async def settle() -> None:
            async with bus:
                await bus.wait_delivered()

        anyio.run(settle)
    return sorted(p.name for p in folder.iterdir())


@pytest.mark.parametrize(("keep_last", "keep_best"), [(2, 2), (1, 1), (3, 1)])
def test_a_slow_disk_deleting_old_checkpoints_never_holds_training(
    tmp_path: Path,
    trainer_factory: Any,
    monkeypatch: pytest.MonkeyPatch,
    keep_last: int | None,
    keep_best: int | None,
) -> None:
    """A network disk that takes 30 ms per delete: the removals run off the event loop, so no
    barrier waits for them (``waited_s`` stays empty on a healthy run), and the call's end
    waits for them: the folder holds what retention keeps when ``fit`` returns."""
    unlink = Path.unlink
    deleted: list[str] = []

    def slow_unlink(self: Path, missing_ok: bool = False) -> None:
        if self.name.startswith("step-"):  # a checkpoint (not the run's other files)
            time.sleep(0.03)
            deleted.append(self.name)
        unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", slow_unlink)
    trainer = trainer_factory(
        [Checkpointing(every_epochs=1, monitor="val_score", keep_last=keep_last,
                       keep_best=keep_best)],
        epochs=8, batches=2, score=[8.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.0, 1.0],
        checkpoint_dir=tmp_path,
    )  # fmt: skip
    with structlog.testing.capture_logs() as logs:
        result = trainer.fit_sync()
    assert result.reason == "completed" and result.steps == 16
    assert result.waited_s == {} and result.lost_work == {}
    removed = [x["path"] for x in logs if x["event"] == "checkpoint_removed"]
    assert len(removed) == len(deleted) == 16 - keep_last - keep_best  # 8 saves of each kind
    kept = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step-"))
    assert not any(Path(r).name in kept for r in removed)
    assert len(kept) == keep_last + keep_best


def test_keep_best_in_max_mode_keeps_the_highest(vbus: EventBus, tmp_path: Path) -> None:
    Checkpointing(every_epochs=None, monitor="acc", mode="max", keep_best=2).setup(vbus)
    for step, acc in [(1, 0.5), (2, 0.7), (3, 0.6), (4, 0.9)]:
        _saved(vbus, tmp_path, step, "best", acc=acc)
    assert _names(tmp_path, vbus) == ["step-00000002-best.pt", "step-00000004-best.pt"]


def test_the_file_just_saved_is_never_deleted(vbus: EventBus, tmp_path: Path) -> None:
    Checkpointing(every_epochs=None, monitor="loss", keep_best=1).setup(vbus)
    _saved(vbus, tmp_path, 1, "best", loss=0.1)
    _saved(vbus, tmp_path, 2, "best", loss=0.9)  # worse, sent by hand: it is still the newest
    assert _names(tmp_path, vbus) == ["step-00000002-best.pt"]


def test_final_and_other_tags_are_kept(vbus: EventBus, tmp_path: Path) -> None:
    Checkpointing(every_steps=1, keep_last=1).setup(vbus)
    _saved(vbus, tmp_path, 1, "final")
    _saved(vbus, tmp_path, 2, "mine")
    _saved(vbus, tmp_path, 3, None)
    _saved(vbus, tmp_path, 4, None)
    _saved(vbus, tmp_path, 4, None)  # the same file written twice is one file
    assert _names(tmp_path, vbus) == ["step-00000001-final.pt", "step-00000002-mine.pt",
                                "step-00000004.pt"]  # fmt: skip


def test_without_keep_nothing_is_deleted(vbus: EventBus, tmp_path: Path) -> None:
    Checkpointing(every_steps=1).setup(vbus)
    for step in range(1, 4):
        _saved(vbus, tmp_path, step, None)
    assert len(_names(tmp_path)) == 3


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"keep_last": 0}, "keep_last"),
        ({"keep_best": 2}, "keep_best"),  # no monitor
        ({"keep_best": -1, "monitor": "val_loss"}, "keep_best"),
    ],
)
def test_invalid_keep_arguments(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        Checkpointing(**kwargs)


# ---------------------------------------------------------------- retention across a resume
# 4 batches an epoch, 12 steps, saves every 2 steps, evaluations at 3, 6, 9, 12: val_loss is
# best at 6 (after 3), so a run resumed at 4 or 5 must delete the "best" file of step 3 that it
# wrote before it was stopped.
def run() -> dict[str, Any]:
    """The runs' options (a new bus each: a bus belongs to one trainer)."""
    return {"epochs": 10, "batches": 4, "max_steps": 12,
            "eval_schedule": EvalSchedule(every_steps=3, epoch_end=False),
            "bus": EventBus(barriers=(ev.StepEnded, ev.EvaluationEnded,
                                      ev.EpochEnded))}  # fmt: skip


def _keeping(**kwargs: Any) -> Checkpointing:
    kwargs = {"keep_last": 2, "keep_best": 1, **kwargs}
    return Checkpointing(every_steps=2, every_epochs=None, monitor="val_loss", **kwargs)


def _stop_at(trainer: Any, step: int) -> None:
    # StepEnded is a barrier (run()): the stop lands at exactly that step.
    bus = trainer.bus
    bus.stream(ev.StepEnded).pipe(
        ops.filter(lambda e: e.step == step),
        ops.map(lambda _: cmd.StopTraining(reason=f"preempted at {step}")),
    ).subscribe(bus.commands, name="preempt")


def _uninterrupted(trainer_factory: Any, folder: Path) -> list[str]:
    trainer = trainer_factory([_keeping()], checkpoint_dir=folder, **run())
    rec = EventRecorder(trainer.bus)
    assert trainer.fit_sync().steps == 12
    # The control: a "best" is written before step 4 and after step 5, so a resumed run that
    # forgot its earlier files would end with two.
    assert [e.step for e in rec.of_type(ev.CheckpointSaved) if e.tag == "best"] == [3, 6]
    return _names(folder)


@pytest.mark.parametrize("stops", [(4,), (5,), (4, 7)], ids=["cadence", "final", "twice"])
def test_a_resumed_run_keeps_what_an_uninterrupted_run_keeps(
    tmp_path: Path, trainer_factory: Any, stops: tuple[int, ...]
) -> None:
    want = _uninterrupted(trainer_factory, tmp_path / "straight")
    assert want == ["step-00000006-best.pt", "step-00000010.pt", "step-00000012.pt"]
    folder = tmp_path / "resumed"
    for k in stops:  # a stop off the cadence (5, 7) writes a "final" file the resume starts from
        trainer = trainer_factory([_keeping()], checkpoint_dir=folder, **run())
        _stop_at(trainer, k)
        assert trainer.fit_sync(resume="latest").steps == k
    trainer = trainer_factory([_keeping()], checkpoint_dir=folder, **run())
    assert trainer.fit_sync(resume="latest").steps == 12
    assert _names(folder) == want


@pytest.mark.parametrize("stopped", [False, True], ids=["completed", "early-stopped"])
def test_a_job_started_again_after_its_end_leaves_its_files_as_they_were(
    tmp_path: Path, trainer_factory: Any, stopped: bool
) -> None:
    # A scheduler requeues a job that had already ended: the same script, resume="latest".
    # The last step has its file already; the restarted run writes no "final" copy of it.
    def job() -> Any:
        callbacks: list[Any] = [_keeping()]
        if stopped:  # val_score worse at 6 than at 3: stops at step 6, a cadence step
            callbacks.append(EarlyStopping("val_score", patience=1))
        return trainer_factory(callbacks, checkpoint_dir=tmp_path, score=[1.0, 2.0], **run())

    first = job().fit_sync()
    assert (first.reason, first.steps) == (("stopped", 6) if stopped else ("completed", 12))
    files = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
    assert not [name for name in files if name.endswith("-final.pt")]
    again = job().fit_sync(resume="latest")
    assert (again.reason, again.steps) == (first.reason, first.steps)
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()} == files
    assert again.last_checkpoint == str(again.resumed_from)


def test_another_runs_files_are_never_touched(tmp_path: Path, trainer_factory: Any) -> None:
    folder = tmp_path / "run"
    # Another run (fresh, never resumed) wrote step 3 into the same folder first.
    other = trainer_factory([Checkpointing(every_steps=3, every_epochs=None)],
                            checkpoint_dir=folder, **{**run(), "max_steps": 3})  # fmt: skip
    other.fit_sync()
    theirs = {p.name: p.read_bytes() for p in folder.iterdir()}
    assert list(theirs) == ["step-00000003.pt"]
    first = trainer_factory([_keeping()], checkpoint_dir=folder, **run())
    _stop_at(first, 4)
    first.fit_sync()
    second = trainer_factory([_keeping()], checkpoint_dir=folder, **run())
    second.fit_sync(resume=folder / "step-00000004.pt")
    assert _names(folder) == ["step-00000003.pt", "step-00000006-best.pt", "step-00000010.pt",
                              "step-00000012.pt"]  # fmt: skip
    assert (folder / "step-00000003.pt").read_bytes() == theirs["step-00000003.pt"]

    # A run in another folder resumed from this one's file: this folder's files are not its.
    before = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    elsewhere = tmp_path / "elsewhere"
    third = trainer_factory([_keeping(keep_last=1)], checkpoint_dir=elsewhere,
                            **{**run(), "max_steps": 16})  # fmt: skip
    with structlog.testing.capture_logs() as logs:
        third.fit_sync(resume=folder / "step-00000010.pt")
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == before
    assert _names(elsewhere) == ["step-00000016.pt"]  # its own files only, keep_last=1
    assert [e["event"] for e in logs if e["event"] == "checkpoint_lineage_left"] == [
        "checkpoint_lineage_left"
    ]


def test_files_after_the_resumed_checkpoint_are_left_and_rewritten(
    tmp_path: Path, trainer_factory: Any
) -> None:
    # Stopped after writing step 10, resumed from step 8 (an explicit earlier path, or a
    # damaged 10 skipped by resume="latest"): 10 is named in no lineage, so it is left (and
    # logged); the resumed run writes it again and from then on counts it as its own.
    want = _uninterrupted(trainer_factory, tmp_path / "straight")
    folder = tmp_path / "resumed"
    first = trainer_factory([_keeping()], checkpoint_dir=folder, **run())
    _stop_at(first, 10)
    first.fit_sync()
    assert _names(folder) == ["step-00000006-best.pt", "step-00000008.pt", "step-00000010.pt"]
    second = trainer_factory([_keeping()], checkpoint_dir=folder, **run())
    with structlog.testing.capture_logs() as logs:
        second.fit_sync(resume=folder / "step-00000008.pt")
    assert _names(folder) == want
    left = [e for e in logs if e["event"] == "checkpoint_newer_left"]
    assert [e["names"] for e in left] == [["step-00000010.pt"]]


def test_a_file_deleted_by_hand_is_no_error(tmp_path: Path, trainer_factory: Any) -> None:
    want = _uninterrupted(trainer_factory, tmp_path / "straight")
    folder = tmp_path / "resumed"
    first = trainer_factory([_keeping()], checkpoint_dir=folder, **run())
    _stop_at(first, 4)
    first.fit_sync()
    (folder / "step-00000002.pt").unlink()
    (folder / "step-00000003-best.pt").unlink()
    second = trainer_factory([_keeping()], checkpoint_dir=folder, **run())
    assert second.fit_sync(resume="latest").subscriber_failures == {}
    assert _names(folder) == want


# ---------------------------------------------------------------- the best weights at the end
def _saved_weights(path: Path) -> dict[str, torch.Tensor]:
    return dict(torch.load(path, weights_only=True)["model"])


def _same_weights(trainer: Any, path: Path) -> bool:
    live = trainer.settings.model.state_dict()
    saved = _saved_weights(path)
    return live.keys() == saved.keys() and all(torch.equal(live[k], saved[k]) for k in live)


@pytest.mark.parametrize("stopper", [False, True], ids=["completed", "early-stopped"])
def test_load_best_at_end_leaves_the_best_weights(
    tmp_path: Path, trainer_factory: Any, stopper: bool
) -> None:
    best = _keeping(load_best_at_end=True)
    callbacks = [best, EarlyStopping("val_loss", patience=1)] if stopper else [best]
    trainer = trainer_factory(callbacks, checkpoint_dir=tmp_path, **run())
    with structlog.testing.capture_logs() as logs:
        result = trainer.fit_sync()
    # val_loss is best at step 6; patience=1 stops at the evaluation of step 9.
    assert (result.reason, result.steps) == (("stopped", 9) if stopper else ("completed", 12))
    assert best.best_path == str(tmp_path / "step-00000006-best.pt")
    assert _same_weights(trainer, tmp_path / "step-00000006-best.pt")
    last = tmp_path / ("step-00000009-final.pt" if stopper else "step-00000012.pt")
    assert not _same_weights(trainer, last)  # the control: training moved on after step 6
    loaded = [e for e in logs if e["event"] == "weights_loaded"]
    assert [(e["path"], e["step"]) for e in loaded] == [(best.best_path, 6)]


def test_without_load_best_at_end_the_last_weights_stay(
    tmp_path: Path, trainer_factory: Any
) -> None:
    trainer = trainer_factory([_keeping()], checkpoint_dir=tmp_path, **run())
    trainer.fit_sync()
    assert _same_weights(trainer, tmp_path / "step-00000012.pt")
    assert not _same_weights(trainer, tmp_path / "step-00000006-best.pt")


def test_load_best_at_end_after_a_resume(tmp_path: Path, trainer_factory: Any) -> None:
    # The best (step 6) was written before the run was stopped at 7 and resumed.
    first = trainer_factory([_keeping(load_best_at_end=True)], checkpoint_dir=tmp_path, **run())
    _stop_at(first, 7)
    first.fit_sync()
    assert _same_weights(first, tmp_path / "step-00000006-best.pt")  # a stopped run loads too
    best = _keeping(load_best_at_end=True)
    second = trainer_factory([best], checkpoint_dir=tmp_path, **run())
    assert second.fit_sync(resume="latest").steps == 12
    assert best.best_path == str(tmp_path / "step-00000006-best.pt")
    assert _same_weights(second, tmp_path / "step-00000006-best.pt")
    assert _names(tmp_path) == ["step-00000006-best.pt", "step-00000010.pt", "step-00000012.pt"]
    # The final checkpoint still holds the last weights (what a resume continues from).
    assert not torch.equal(
        _saved_weights(tmp_path / "step-00000012.pt")["0.weight"],
        _saved_weights(tmp_path / "step-00000006-best.pt")["0.weight"],
    )


def test_trainer_load_weights(tmp_path: Path, trainer_factory: Any) -> None:
    trainer = trainer_factory([_keeping()], checkpoint_dir=tmp_path, **run())
    trainer.fit_sync()
    assert trainer.load_weights(tmp_path / "step-00000006-best.pt") == 6
    assert _same_weights(trainer, tmp_path / "step-00000006-best.pt")
    with pytest.raises(CheckpointError, match=r"step-00000005\.pt"):
        trainer.load_weights(tmp_path / "step-00000005.pt")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"load_best_at_end": True}, r"load_best_at_end.*monitor"),
        ({"monitor": "val_loss", "load_best_at_end": 1}, "load_best_at_end"),
    ],
)
def test_load_best_at_end_arguments(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        Checkpointing(**kwargs)


def test_load_best_at_end_refuses_a_sharded_model() -> None:
    plan = RunPlan(eval_metrics=frozenset({"val_loss"}), train_metrics=frozenset(),
                   checkpoint_dir="runs", sharded=True)  # fmt: skip
    _keeping().check(plan)  # without load_best_at_end a sharded run is fine
    with pytest.raises(ConfigError, match=r"load_best_at_end.*sharded"):
        _keeping(load_best_at_end=True).check(plan)


def test_no_best_file_leaves_the_last_weights_and_says_so(
    tmp_path: Path, trainer_factory: Any
) -> None:
    best = Checkpointing(every_epochs=None, monitor="val_loss", load_best_at_end=True)
    trainer = trainer_factory(
        [best], checkpoint_dir=tmp_path, **{**run(), "eval_schedule": EvalSchedule(epoch_end=False)}
    )
    with structlog.testing.capture_logs() as logs:
        trainer.fit_sync()
    assert best.best_path is None
    assert [e["event"] for e in logs if e["event"] in ("best_checkpoint_none", "weights_loaded")
            ] == ["best_checkpoint_none"]  # fmt: skip


@pytest.mark.parametrize(
    "files",
    [{"last": "step-00000002.pt", "best": [], "saving": None},
     {"last": [], "best": [[1.0, "2", "step-00000002-best.pt"]], "saving": None},
     {"last": [], "best": [], "saving": [2, None]}],
    ids=["last-not-a-list", "best-step-not-an-int", "saving-short"],
)  # fmt: skip
def test_a_malformed_files_state_is_a_config_error(files: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="Checkpointing state"):
        _keeping().load_state_dict({"best": None, "files": files})

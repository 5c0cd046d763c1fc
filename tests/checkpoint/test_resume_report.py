"""Resume says what it did: ``FitStarted.resumed_from`` and ``FitResult.resumed_from`` name the
file loaded (or None), ``resume="latest"`` finding nothing warns naming the folder and what it
held, and ``require_checkpoint=True`` makes that an error before anything trains."""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from structlog.testing import capture_logs

from trainbus import CheckpointError, ConfigError, Trainer
from trainbus import events as ev
from trainbus.checkpoint import CheckpointStore
from trainbus.testing import EventRecorder, tiny_loader, tiny_model

from .conftest import write

DATA = tiny_loader(4, 8)


def _trainer(checkpoint_dir: Path, **kwargs: Any) -> Trainer:
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kwargs.setdefault("max_steps", 2)
    return Trainer(model, opt, DATA, loss_fn=F.cross_entropy, checkpoint_dir=checkpoint_dir,
                   on_signal=None, progress=False, **kwargs)  # fmt: skip


def _nothing_found(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == "resume_found_nothing"]


def test_latest_names_the_file_it_loaded(tmp_path: Path) -> None:
    first = _trainer(tmp_path, max_steps=2).fit_sync()
    assert first.resumed_from is None
    assert first.last_checkpoint == str(tmp_path / "step-00000002-final.pt")
    second = _trainer(tmp_path, max_steps=4)
    rec = EventRecorder(second.bus)
    result = second.fit_sync(resume="latest")
    (started,) = rec.of_type(ev.FitStarted)
    # The file, not the word "latest": what a person needs to know which run continued.
    assert started.resumed_from == first.last_checkpoint == result.resumed_from
    assert started.resume_source == "checkpoint_dir"
    assert rec.of_type(ev.CheckpointLoaded)[0].path == first.last_checkpoint
    assert result.steps == 4


def test_latest_skipping_a_damaged_file_names_the_one_loaded(tmp_path: Path) -> None:
    good = write(tmp_path, step=3)
    (tmp_path / "step-00000009.pt").write_bytes(b"not a zip")
    trainer = _trainer(tmp_path, max_steps=4)
    rec = EventRecorder(trainer.bus)
    result = trainer.fit_sync(resume="latest")
    assert rec.of_type(ev.FitStarted)[0].resumed_from == str(good) == result.resumed_from


def test_an_explicit_path_is_reported_as_given(tmp_path: Path) -> None:
    path = write(tmp_path / "ck", step=1)
    trainer = _trainer(tmp_path / "ck", max_steps=2)
    rec = EventRecorder(trainer.bus)
    result = trainer.fit_sync(resume=path)
    assert result.resumed_from == str(path)
    assert rec.of_type(ev.FitStarted)[0].resume_source == "path"


class HandedCheckpoint:
    """What ``ray.train.get_checkpoint()`` returns, as far as resuming reads it."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    @contextmanager
    def as_directory(self) -> Iterator[str]:
        yield self.path


@pytest.mark.parametrize("readable", [True, False])
def test_latest_in_a_ray_worker_takes_rays_checkpoint_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, readable: bool
) -> None:
    # In a Ray Train worker that Ray handed a checkpoint, resume="latest" restores it, not
    # the newer file of checkpoint_dir; one that holds no trainbus checkpoint is said and
    # skipped. (tests/distributed/test_ray.py runs this under a real Ray restart.)
    handed = tmp_path / "ray" / "checkpoint_000001"
    if readable:
        write(handed, step=2)
    else:
        handed.mkdir(parents=True)
        (handed / "model.pt").write_bytes(b"a user's own format")
    newer = write(tmp_path / "ck", step=3)
    train = types.ModuleType("ray.train")
    train.get_checkpoint = lambda: HandedCheckpoint(handed)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "ray.train", train)
    trainer = _trainer(tmp_path / "ck", max_steps=4)
    rec = EventRecorder(trainer.bus)
    with capture_logs() as logs:
        trainer.fit_sync(resume="latest")
    (started,) = rec.of_type(ev.FitStarted)
    unreadable = [e for e in logs if e["event"] == "resume_ray_checkpoint_unreadable"]
    if readable:
        assert started.resume_source == "ray" and started.step == 2 and not unreadable
        assert started.resumed_from == str(handed / "step-00000002.pt")
    else:
        assert started.resume_source == "checkpoint_dir" and started.step == 3
        assert started.resumed_from == str(newer) and len(unreadable) == 1


def test_latest_outside_a_ray_worker_reads_checkpoint_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def not_a_worker() -> None:
        raise RuntimeError("Ray Train function utilities not initialized.")

    train = types.ModuleType("ray.train")
    train.get_checkpoint = not_a_worker  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "ray.train", train)  # Ray Train imported, not a worker
    path = write(tmp_path, step=1)
    trainer = _trainer(tmp_path, max_steps=2)
    rec = EventRecorder(trainer.bus)
    trainer.fit_sync(resume="latest")
    (started,) = rec.of_type(ev.FitStarted)
    assert (started.resume_source, started.resumed_from) == ("checkpoint_dir", str(path))


@pytest.mark.parametrize(
    ("prepare", "found"),
    [
        ("missing", "no such folder"),
        ("empty", "an empty folder"),
        ("others", "no checkpoint file (step-<n>.pt); 2 other entries: model.pt, notes.txt"),
    ],
)
def test_latest_finding_nothing_warns_naming_the_folder(
    tmp_path: Path, prepare: str, found: str
) -> None:
    folder = tmp_path / "runs" / "typo"
    if prepare != "missing":
        folder.mkdir(parents=True)
    if prepare == "others":
        (folder / "model.pt").write_bytes(b"x")
        (folder / "notes.txt").write_text("x")
    trainer = _trainer(folder)
    rec = EventRecorder(trainer.bus)
    with capture_logs() as logs:
        result = trainer.fit_sync(resume="latest")
    (warning,) = _nothing_found(logs)
    assert warning["log_level"] == "warning"
    assert warning["checkpoint_dir"] == str(folder) and warning["found"] == found
    assert "require_checkpoint=True" in warning["action"]
    assert rec.of_type(ev.FitStarted)[0].resumed_from is None and result.resumed_from is None
    assert result.steps == 2 and not rec.of_type(ev.CheckpointLoaded)


def test_latest_with_only_invalid_files_lists_them_with_reasons(tmp_path: Path) -> None:
    (tmp_path / "step-00000005.pt").write_bytes(b"")
    (tmp_path / "step-00000004-best.pt").write_bytes(b"not a zip")
    with capture_logs() as logs:
        result = _trainer(tmp_path).fit_sync(resume="latest")
    (warning,) = _nothing_found(logs)
    found = warning["found"]
    assert found.startswith("2 checkpoint files, all invalid: step-00000005.pt (")
    assert "empty file" in found and "step-00000004-best.pt (" in found
    assert result.resumed_from is None


def test_require_checkpoint_makes_finding_nothing_an_error(tmp_path: Path) -> None:
    folder = tmp_path / "typo"
    trainer = _trainer(folder)
    rec = EventRecorder(trainer.bus)
    with pytest.raises(CheckpointError, match="no valid checkpoint") as info:
        trainer.fit_sync(resume="latest", require_checkpoint=True)
    assert info.value.path == str(folder) and "no such folder" in str(info.value)
    assert trainer.result is None and not rec.of_type(ev.StepEnded)  # nothing trained
    assert not folder.exists()


def test_require_checkpoint_lists_the_invalid_files(tmp_path: Path) -> None:
    (tmp_path / "step-00000005.pt").write_bytes(b"broken")
    with pytest.raises(CheckpointError, match=r"1 checkpoint file, invalid: step-00000005\.pt"):
        _trainer(tmp_path).fit_sync(resume="latest", require_checkpoint=True)


@pytest.mark.asyncio
async def test_require_checkpoint_with_a_checkpoint_resumes(tmp_path: Path) -> None:
    path = write(tmp_path, step=1)
    result = await _trainer(tmp_path, max_steps=2).fit(resume="latest", require_checkpoint=True)
    assert result.resumed_from == str(path) and result.steps == 2


@pytest.mark.parametrize(
    ("resume", "require"), [(None, True), ("latest", "yes"), ("latest", 1), (None, None)]
)
def test_require_checkpoint_bad_input_is_a_config_error(
    tmp_path: Path, resume: str | None, require: object
) -> None:
    with pytest.raises(ConfigError, match="require_checkpoint"):
        _trainer(tmp_path).fit_sync(resume=resume, require_checkpoint=require)  # type: ignore[arg-type]


def test_find_latest_describes_what_it_skipped(tmp_path: Path) -> None:
    for k in range(7):
        (tmp_path / f"step-{k:08d}.pt").write_bytes(b"")
    with capture_logs():
        scan = CheckpointStore(tmp_path).find_latest()
    assert scan.checkpoint is None and len(scan.skipped) == 7
    text = scan.describe(limit=2)
    assert text.startswith("7 checkpoint files, all invalid: step-00000006.pt (")
    assert text.endswith("; ... and 5 more")
    good = write(tmp_path, step=3)
    with capture_logs():
        scan = CheckpointStore(tmp_path).find_latest()
    assert scan.checkpoint is not None and scan.checkpoint.path == good
    assert [name for name, _ in scan.skipped] == ["step-00000006.pt", "step-00000005.pt",
                                                  "step-00000004.pt"]  # fmt: skip

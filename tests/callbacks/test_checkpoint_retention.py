"""Checkpointing(keep_last=..., keep_best=...): which files a run keeps, and that the file just
saved (the newest complete checkpoint) is never the one deleted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from trainbus import ConfigError, EventBus
from trainbus import events as ev
from trainbus.callbacks import Checkpointing


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


def _names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_keep_best_in_max_mode_keeps_the_highest(vbus: EventBus, tmp_path: Path) -> None:
    Checkpointing(every_epochs=None, monitor="acc", mode="max", keep_best=2).setup(vbus)
    for step, acc in [(1, 0.5), (2, 0.7), (3, 0.6), (4, 0.9)]:
        _saved(vbus, tmp_path, step, "best", acc=acc)
    assert _names(tmp_path) == ["step-00000002-best.pt", "step-00000004-best.pt"]


def test_the_file_just_saved_is_never_deleted(vbus: EventBus, tmp_path: Path) -> None:
    Checkpointing(every_epochs=None, monitor="loss", keep_best=1).setup(vbus)
    _saved(vbus, tmp_path, 1, "best", loss=0.1)
    _saved(vbus, tmp_path, 2, "best", loss=0.9)  # worse, sent by hand: it is still the newest
    assert _names(tmp_path) == ["step-00000002-best.pt"]


def test_final_and_other_tags_are_kept(vbus: EventBus, tmp_path: Path) -> None:
    Checkpointing(every_steps=1, keep_last=1).setup(vbus)
    _saved(vbus, tmp_path, 1, "final")
    _saved(vbus, tmp_path, 2, "mine")
    _saved(vbus, tmp_path, 3, None)
    _saved(vbus, tmp_path, 4, None)
    _saved(vbus, tmp_path, 4, None)  # the same file written twice is one file
    assert _names(tmp_path) == ["step-00000001-final.pt", "step-00000002-mine.pt",
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

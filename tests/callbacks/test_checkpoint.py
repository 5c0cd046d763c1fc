"""Checkpointing: cadence and "best" decisions as commands, and the files a run leaves."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from trainbus import ConfigError, EventBus
from trainbus import commands as cmd
from trainbus import events as ev
from trainbus.callbacks import Checkpointing

from .conftest import make_trainer, scripted

SAVE = cmd.SaveCheckpoint()
BEST = cmd.SaveCheckpoint(tag="best")


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"every_steps": 0}, "every_steps"),
        ({"every_steps": 2.5}, "every_steps"),
        ({"every_epochs": -1}, "every_epochs"),
        ({"every_epochs": "2"}, "every_epochs"),
        ({"every_epochs": True}, "every_epochs"),
        ({"monitor": ""}, "monitor"),
        ({"monitor": 3}, "monitor"),
        ({"mode": "avg"}, "mode"),
        ({"monitor": "val_loss", "min_delta": -0.1}, "min_delta"),
        ({"every_epochs": None}, "every_epochs"),  # nothing would ever be saved
    ],
)
def test_invalid_arguments_name_the_argument(kwargs: dict[str, Any], name: str) -> None:
    with pytest.raises(ConfigError, match=f"^{name}="):
        Checkpointing(**kwargs)


@pytest.mark.parametrize(
    ("name", "use"),
    [
        ("save_top_k", "keep_best=N (the N best by monitor=), or keep_last=N"),
        ("every_n_train_steps", "every_steps=N"),
        ("every_n_epochs", "every_epochs=N"),
        ("dirpath", "Trainer(checkpoint_dir=...)"),
    ],
)
def test_a_lightning_argument_names_the_trainbus_equivalent(name: str, use: str) -> None:
    with pytest.raises(TypeError) as raised:
        Checkpointing(monitor="val_loss", **{name: 2})
    assert str(raised.value).startswith(
        f"Checkpointing() got an unexpected keyword argument {name!r}: that is Lightning's "
        f"ModelCheckpoint({name}=); in trainbus: {use}"
    )


def test_a_misspelt_keyword_names_the_nearest_argument() -> None:
    with pytest.raises(TypeError, match=r"'keep_lats' \(did you mean 'keep_last'\?\)$"):
        Checkpointing(keep_lats=2)


def test_every_steps_saves_at_step_multiples(vbus: EventBus, step_event: Any) -> None:
    Checkpointing(every_steps=3, every_epochs=None).setup(vbus)
    for i in range(1, 8):
        vbus.publish(step_event(i))
    vbus.flush()
    assert vbus.port().poll_commands() == [SAVE, SAVE]  # steps 3 and 6
    for i in range(11, 14):  # a resumed run: still at multiples of 3 (12), not 3 events later
        vbus.publish(step_event(i))
    vbus.flush()
    assert vbus.port().poll_commands() == [SAVE]


def test_every_epochs_counts_epoch_numbers_and_skips_failed_epochs(vbus: EventBus) -> None:
    Checkpointing(every_epochs=2).setup(vbus)
    saves = []
    for epoch in range(5):
        error = RuntimeError("loader died") if epoch == 3 else None
        vbus.publish(ev.EpochEnded(step=epoch, epoch=epoch, batches=1, error=error))
        vbus.flush()
        saves.append(len(vbus.port().poll_commands()))
    assert saves == [0, 1, 0, 0, 0]  # epoch 1 (the 2nd); epoch 3 (the 4th) failed


@pytest.mark.parametrize(
    ("mode", "values", "expected"),
    [
        ("min", [3.0, 4.0, 2.0, 2.0, float("nan"), 1.0], [True, False, True, False, False, True]),
        ("max", [0.5, 0.4, 0.7, 0.7, 0.8], [True, False, True, False, True]),
    ],
)
def test_monitor_saves_best_on_improvement(
    vbus: EventBus, eval_event: Any, mode: str, values: list[float], expected: list[bool]
) -> None:
    Checkpointing(every_epochs=None, monitor="m", mode=mode).setup(vbus)  # type: ignore[arg-type]
    saved = []
    for step, value in enumerate(values):
        vbus.publish(eval_event({"m": value}, step=step))
        vbus.flush()
        commands = vbus.port().poll_commands()
        assert commands in ([], [BEST])
        saved.append(bool(commands))
    assert saved == expected


def test_monitor_min_delta(vbus: EventBus, eval_event: Any) -> None:
    Checkpointing(every_epochs=None, monitor="val_loss", min_delta=0.1).setup(vbus)
    for value in (1.0, 0.95, 0.91, 0.85):
        vbus.publish(eval_event({"val_loss": value}))
    vbus.flush()
    assert vbus.port().poll_commands() == [BEST, BEST]  # 1.0, then 0.85 (< 1.0 - 0.1)


def test_monitor_skips_failed_evaluations_and_reports_a_missing_metric(
    vbus: EventBus, eval_event: Any
) -> None:
    Checkpointing(every_epochs=None, monitor="val_los").setup(vbus)  # a typo
    vbus.publish(ev.EvaluationEnded(step=1, epoch=0, error=RuntimeError("eval failed")))
    vbus.flush()
    assert vbus.statistics().failed == 0  # a failed evaluation is skipped, not an error
    vbus.publish(eval_event({"val_loss": 1.0}))
    vbus.flush()
    assert vbus.port().poll_commands() == []
    subs = {s.name: s for s in vbus.statistics().subscriptions}
    assert set(subs) == {"Checkpointing.best", "Checkpointing.best_external",
                         "Checkpointing.retention", "Checkpointing.removal"}  # fmt: skip
    sub = subs["Checkpointing.best"]
    assert sub.failed == 1
    assert "monitor='val_los'" in (sub.last_error or "") and "val_loss" in (sub.last_error or "")


def test_a_run_writes_epoch_and_best_checkpoints_at_exact_steps(
    tmp_path: Path, trainer_factory: Any
) -> None:
    trainer = trainer_factory(
        [Checkpointing(every_epochs=1, monitor="val_score")],
        epochs=3, batches=4, score=[3.0, 2.0, 4.0], checkpoint_dir=tmp_path,
    )  # fmt: skip
    result = trainer.fit_sync()
    assert result.reason == "completed" and result.steps == 12
    # EvaluationEnded and EpochEnded are barriers: each save lands at the step that asked.
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step-00000004-best.pt",
        "step-00000004.pt",
        "step-00000008-best.pt",
        "step-00000008.pt",
        "step-00000012.pt",  # epoch save; the loop's final save is skipped at the same step
    ]
    assert result.last_checkpoint == str(tmp_path / "step-00000012.pt")


def test_the_best_checkpoint_by_val_acc_is_the_highest_accuracy(tmp_path: Path) -> None:
    # No mode given: val_acc is maximised, so the best file is the epoch of 0.75, not of 0.25.
    saver = Checkpointing(every_epochs=None, monitor="val_acc", load_best_at_end=True)
    trainer = make_trainer([saver], epochs=3, batches=2, checkpoint_dir=tmp_path,
                           metrics={"acc": scripted([0.25, 0.75, 0.5])})  # fmt: skip
    assert trainer.fit_sync().reason == "completed"
    assert saver.best_path == str(tmp_path / "step-00000004-best.pt")
    assert saver.tracker.best == 0.75
    assert sorted(p.name for p in tmp_path.glob("*-best.pt")) == [
        "step-00000002-best.pt",
        "step-00000004-best.pt",
    ]


def test_every_steps_alone_also_saves_every_epoch_as_documented(
    tmp_path: Path, trainer_factory: Any
) -> None:
    # every_epochs=1 is the default beside every_steps (docs/callbacks/checkpointing.md).
    both = tmp_path / "both"
    trainer_factory([Checkpointing(every_steps=3)], epochs=2, batches=4,
                    checkpoint_dir=both).fit_sync()  # fmt: skip
    assert sorted(p.name for p in both.iterdir()) == [
        "step-00000003.pt", "step-00000004.pt", "step-00000006.pt", "step-00000008.pt",
    ]  # fmt: skip
    steps_only = tmp_path / "steps"
    trainer_factory([Checkpointing(every_steps=3, every_epochs=None)], epochs=2, batches=4,
                    checkpoint_dir=steps_only).fit_sync()  # fmt: skip
    assert sorted(p.name for p in steps_only.iterdir()) == [
        "step-00000003.pt", "step-00000006.pt", "step-00000008-final.pt",  # the loop's final save
    ]  # fmt: skip


def test_an_evaluate_after_fit_is_not_one_of_the_runs_evaluations(tmp_path: Path) -> None:
    """fit() then evaluate(), as a script or a notebook does: the standalone evaluation's better
    score neither asks for a save no step is left for (no ``commands_not_applied``) nor moves
    the best the checkpoints were kept by."""
    cb = Checkpointing(monitor="val_score", mode="max", keep_best=1)
    t = make_trainer([cb], epochs=2, score=[1.0, 2.0, 5.0], checkpoint_dir=tmp_path)
    result = t.fit_sync()
    assert result.eval_metrics["val_score"] == 2.0
    best, files = cb.best_path, sorted(p.name for p in tmp_path.glob("*.pt"))
    with capture_logs() as logs:
        assert t.evaluate_sync()["val_score"] == 5.0  # better than any of the run's
    assert [x for x in logs if x["event"] == "commands_not_applied"] == []
    assert cb.best_path == best
    assert sorted(p.name for p in tmp_path.glob("*.pt")) == files
    assert cb.state_dict()["best"] == 2.0

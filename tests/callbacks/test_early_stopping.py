"""EarlyStopping: a patience pipeline on EvaluationEnded that stops the run at an exact step."""

from __future__ import annotations

from typing import Any

import pytest

from trainbus import ConfigError, EvalSchedule, EventBus
from trainbus import commands as cmd
from trainbus import events as ev
from trainbus.callbacks import Checkpointing, EarlyStopping, ReduceLROnPlateau
from trainbus.testing import EventRecorder

from .conftest import make_trainer, scripted


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"monitor": ""}, "monitor"),
        ({"monitor": None}, "monitor"),
        ({"patience": 0}, "patience"),
        ({"patience": 1.5}, "patience"),
        ({"mode": "lowest"}, "mode"),
        ({"min_delta": -0.5}, "min_delta"),
    ],
)
def test_invalid_arguments_name_the_argument(kwargs: dict[str, Any], name: str) -> None:
    with pytest.raises(ConfigError, match=f"^{name}="):
        EarlyStopping(**kwargs)


@pytest.mark.parametrize(
    ("name", "use"),
    [
        ("stopping_threshold", "ThresholdStopping(monitor, below="),
        ("divergence_threshold", "ThresholdStopping(monitor, above="),
    ],
)
def test_a_lightning_argument_names_the_trainbus_equivalent(name: str, use: str) -> None:
    with pytest.raises(TypeError) as raised:
        EarlyStopping(monitor="val_loss", **{name: 0.1})
    assert str(raised.value).startswith(
        f"EarlyStopping() got an unexpected keyword argument {name!r}: that is Lightning's "
        f"EarlyStopping({name}=); in trainbus: {use}"
    )


def test_stops_at_the_exact_step_of_the_deciding_evaluation(trainer_factory: Any) -> None:
    # Evaluations every 2 steps score 5, 4, 4, 4, ...: the best is at step 4, and the 2nd
    # evaluation without improvement (step 8) decides. EvaluationEnded is a barrier, so the
    # stop is applied before step 9 although 20 steps were planned.
    trainer = trainer_factory(
        [EarlyStopping(monitor="val_score", patience=2)],
        epochs=5, batches=4, score=[5.0, 4.0, 4.0, 4.0, 4.0, 4.0],
        eval_schedule=EvalSchedule(every_steps=2, epoch_end=False), )  # fmt: skip
    recorder = EventRecorder(trainer.bus, trainer.bus.stream(ev.EvaluationEnded, ev.FitEnded))
    result = trainer.fit_sync()
    assert result.reason == "stopped"
    assert result.steps == 8
    assert result.stop_reason is not None and result.stop_reason.startswith("early stopping")
    assert "val_score" in result.stop_reason
    # The reason names the best value's own step (4), and the deciding one's (8) apart.
    assert "(best 4.0 at step 4; 4.0 at step 8)" in result.stop_reason
    assert [e.step for e in recorder.of_type(ev.EvaluationEnded)] == [2, 4, 6, 8]
    (ended,) = recorder.of_type(ev.FitEnded)
    assert ended.reason == "stopped" and ended.stop_reason == result.stop_reason


@pytest.mark.parametrize(
    ("monitor", "mode"),
    [
        ("val_acc", "max"),
        ("test/f1", "max"),
        ("top1_accuracy", "max"),
        ("val_auc", "max"),
        ("val_loss", "min"),
        ("val_score", "min"),
        ("val_acc_loss", "min"),
        ("val_accumulated", "min"),
    ],
)
def test_auto_mode_is_resolved_from_the_name_once(monitor: str, mode: str) -> None:
    assert EarlyStopping(monitor).mode == mode
    assert ReduceLROnPlateau(monitor).mode == mode
    assert Checkpointing(monitor=monitor).mode == mode
    assert EarlyStopping(monitor, mode="min").mode == "min"  # an explicit mode wins


@pytest.mark.parametrize("build", [EarlyStopping, ReduceLROnPlateau])
def test_an_unknown_mode_names_the_three_allowed(build: Any) -> None:
    with pytest.raises(ConfigError, match=r"^mode='maximum'.*'min'.*'max'.*'auto'"):
        build("val_acc", mode="maximum")
    with pytest.raises(ConfigError, match=r"^mode='maximum'.*'min'.*'max'.*'auto'"):
        Checkpointing(monitor="val_acc", mode="maximum")  # type: ignore[arg-type]


def test_early_stopping_on_val_acc_keeps_training_while_accuracy_improves() -> None:
    # What a user writes first: no mode. Accuracy rising every epoch must not stop the run.
    trainer = make_trainer([EarlyStopping("val_acc", patience=2)], epochs=5, batches=2,
                           metrics={"acc": scripted([0.2, 0.4, 0.6, 0.8, 0.9])})  # fmt: skip
    result = trainer.fit_sync()
    assert result.reason == "completed" and result.steps == 10


def test_mode_max_and_min_delta(trainer_factory: Any) -> None:
    # Accuracy creeping up by less than min_delta does not count: stop after 3 evaluations.
    trainer = trainer_factory(
        [EarlyStopping(monitor="val_score", mode="max", patience=2, min_delta=0.05)],
        epochs=6, batches=2, score=[0.80, 0.82, 0.84, 0.99],
    )  # fmt: skip
    result = trainer.fit_sync()
    assert result.reason == "stopped" and result.steps == 6  # 3 epochs of 2 steps
    # 0.84 beats 0.80 but not by min_delta: the reason says why it did not count.
    assert result.stop_reason is not None and result.stop_reason.startswith(
        "early stopping: val_score did not improve by more than min_delta=0.05 for 2 "
        "evaluations (best 0.80"
    )


def test_a_patience_of_one_says_one_evaluation(trainer_factory: Any) -> None:
    trainer = trainer_factory([EarlyStopping(monitor="val_score", patience=1)],
                              epochs=4, batches=2, score=[4.0, 5.0])  # fmt: skip
    result = trainer.fit_sync()
    assert result.stop_reason is not None
    assert "did not improve for 1 evaluation (best 4.0" in result.stop_reason


def test_keeps_training_while_the_metric_improves(trainer_factory: Any) -> None:
    trainer = trainer_factory(
        [EarlyStopping(monitor="val_score", patience=1)],
        epochs=4, batches=2, score=[4.0, 3.0, 2.0, 1.0],
    )  # fmt: skip
    result = trainer.fit_sync()
    assert result.reason == "completed" and result.steps == 8 and result.stop_reason is None


def test_failed_evaluations_neither_count_nor_fail(vbus: EventBus, eval_event: Any) -> None:
    EarlyStopping(patience=1).setup(vbus)
    vbus.publish(eval_event({"val_loss": 1.0}))
    for _ in range(3):
        vbus.publish(ev.EvaluationEnded(step=1, epoch=0, error=RuntimeError("eval failed")))
    vbus.flush()
    assert vbus.port().poll_commands() == [] and vbus.statistics().failed == 0
    vbus.publish(eval_event({"val_loss": 1.0}))
    vbus.flush()
    (stop,) = vbus.port().poll_commands()
    assert isinstance(stop, cmd.StopTraining) and "early stopping" in stop.reason


def test_the_best_step_survives_a_resume(trainer_factory: Any, tmp_path: Any) -> None:
    # Best 3.0 at step 2; a resume from step 3's checkpoint still names step 2 when it stops
    # (saves every 3 steps: none at an evaluation step).
    from trainbus.callbacks import Checkpointing

    def run(score: list[float], **kwargs: Any) -> Any:
        trainer = trainer_factory(
            [
                EarlyStopping(monitor="val_score", patience=3),
                Checkpointing(every_steps=3, every_epochs=None),
            ],
            epochs=5,
            batches=4,
            score=score,
            eval_schedule=EvalSchedule(every_steps=2, epoch_end=False),
            checkpoint_dir=tmp_path,
        )
        return trainer.fit_sync(**kwargs)

    first = run([3.0, 4.0, 4.0, 4.0])
    assert first.steps == 8 and first.stop_reason is not None
    assert "(best 3.0 at step 2; 4.0 at step 8)" in first.stop_reason
    resumed = run([4.0], resume=tmp_path / "step-00000003.pt")
    assert resumed.steps == 8 and resumed.stop_reason == first.stop_reason

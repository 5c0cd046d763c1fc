"""Stoppers: ThresholdStopping and TimeLimit, in real runs and in virtual time."""

from __future__ import annotations

import datetime as dt
import time
from typing import Any

import pytest

from trainbus import ConfigError, EventBus
from trainbus import commands as cmd
from trainbus import events as ev
from trainbus.callbacks import ThresholdStopping, TimeLimit
from trainbus.testing import EventRecorder, tiny_loader

from .conftest import make_trainer


@pytest.mark.parametrize(
    ("build", "name"),
    [
        (lambda: ThresholdStopping("val_acc"), "above"),
        (lambda: ThresholdStopping("", above=1.0), "monitor"),
        (lambda: ThresholdStopping("loss", above="high"), "above"),  # type: ignore[arg-type]
        (lambda: ThresholdStopping("loss", below=float("nan")), "below"),
        (lambda: ThresholdStopping("loss", above=1.0, below=2.0), "below"),
        (lambda: ThresholdStopping("loss", above=1.0, source="test"), "source"),  # type: ignore[arg-type]
        (lambda: TimeLimit(), "seconds"),
        (lambda: TimeLimit(10, deadline=time.time()), "seconds"),
        (lambda: TimeLimit(0), "seconds"),
        (lambda: TimeLimit(deadline="tomorrow"), "deadline"),  # type: ignore[arg-type]
        (lambda: TimeLimit(10, margin_s=-1), "margin_s"),
        (lambda: TimeLimit(10, steps_margin=0), "steps_margin"),
        (lambda: TimeLimit(10, save=1), "save"),  # type: ignore[arg-type]
        (lambda: TimeLimit(2.0), "margin_s"),  # the default margin_s=60 would stop at once
    ],
)
def test_invalid_options_fail_at_construction(build: Any, name: str) -> None:
    with pytest.raises(ConfigError, match=f"^{name}="):
        build()


def test_threshold_on_an_evaluation_metric_stops_at_that_evaluation(trainer_factory: Any) -> None:
    stopper = ThresholdStopping("val_score", above=0.8)
    trainer = trainer_factory([stopper], epochs=5, batches=4, score=[0.1, 0.5, 0.9, 0.95])
    result = trainer.fit_sync()
    assert result.reason == "stopped" and result.steps == 12  # the third evaluation, a barrier
    assert result.stop_reason.startswith("threshold: val_score=0.9 went above 0.8 at step 12")


def test_threshold_below_on_a_training_metric(trainer_factory: Any) -> None:
    trainer = trainer_factory(
        [ThresholdStopping("lr", below=0.15)], epochs=3, batches=4, lr=0.1, log_every=2
    )
    result = trainer.fit_sync()
    assert result.reason == "stopped" and result.stop_reason.startswith("threshold: lr=0.1")
    assert result.steps < 12


@pytest.mark.parametrize("source", ["auto", "eval"])
def test_threshold_on_a_named_set_metric_reads_that_sets_evaluations(source: Any) -> None:
    # The "val" set's evaluation, first, lacks test/score: it is skipped, not an error.
    sets = {"val": tiny_loader(1, seed=1), "test": tiny_loader(1, seed=2)}
    stopper = ThresholdStopping("test/score", above=0.5, source=source)
    trainer = make_trainer([stopper], epochs=3, batches=2, eval_data=sets,
                           metrics={"score": lambda outputs, targets: 1.0})  # fmt: skip
    result = trainer.fit_sync()
    assert stopper.source == "eval"
    assert result.reason == "stopped" and result.steps == 2
    assert result.stop_reason.startswith("threshold: test/score=1 went above 0.5 at step 2")


def test_unknown_metric_fails_before_the_run_naming_what_exists(trainer_factory: Any) -> None:
    trainer = trainer_factory([ThresholdStopping("val_acc", above=0.5)], epochs=2, batches=2)
    rec = EventRecorder(trainer.bus)
    with pytest.raises(ConfigError, match=r"ThresholdStopping\.monitor='val_acc'.*val_loss"):
        trainer.fit_sync()
    assert trainer.result is None and not rec.of_type(ev.FitStarted)  # nothing trained


def commands_of(bus: EventBus) -> list[cmd.Command]:
    return bus.port().poll_commands()


def test_time_limit_leaves_a_margin_from_the_measured_step_time(
    vbus: EventBus, step_event: Any
) -> None:
    TimeLimit(10.0, margin_s=1.0).setup(vbus)
    vbus.publish(ev.FitStarted(step=0, epoch=0, max_steps=None, max_epochs=None, device="cpu",
                               time=50.0))  # fmt: skip
    for i in range(1, 7):  # one step per second: 50 + 6 + 2 x 1 + 1 < 60
        vbus.publish(step_event(i, time=50.0 + i, duration_s=1.0))
    vbus.flush()
    assert commands_of(vbus) == []
    vbus.publish(step_event(7, time=57.0, duration_s=1.0))  # 57 + 2 + 1 >= 60: stop now
    vbus.flush()
    out = commands_of(vbus)
    assert out[0] == cmd.SaveCheckpoint(tag="time_limit")
    assert isinstance(out[1], cmd.StopTraining) and out[1].reason.startswith("time limit")
    assert "step 7" in out[1].reason and len(out) == 2
    vbus.publish(step_event(8, time=58.0, duration_s=1.0))
    vbus.flush()
    assert commands_of(vbus) == []  # decided once


def test_time_limit_counts_a_long_evaluation_gap(vbus: EventBus, step_event: Any) -> None:
    TimeLimit(100.0, margin_s=0.0, save=False).setup(vbus)
    vbus.publish(ev.FitStarted(step=0, epoch=0, max_steps=None, max_epochs=None, device="cpu",
                               time=0.0))  # fmt: skip
    vbus.publish(step_event(1, time=1.0, duration_s=1.0))
    vbus.publish(step_event(2, time=41.0, duration_s=1.0))  # 40 s gap (an evaluation)
    vbus.flush()
    (stop,) = commands_of(vbus)  # 41 + 2 x 40 > 100: the next gap could pass the limit
    assert isinstance(stop, cmd.StopTraining) and "step 2" in stop.reason


def test_time_limit_with_a_past_deadline_saves_then_stops_a_real_run(
    trainer_factory: Any, tmp_path: Any
) -> None:
    past = dt.datetime.now() - dt.timedelta(seconds=1)
    trainer = trainer_factory([TimeLimit(deadline=past, margin_s=0)], epochs=50, batches=4,
                              checkpoint_dir=tmp_path)  # fmt: skip
    rec = EventRecorder(trainer.bus)
    result = trainer.fit_sync()
    assert result.reason == "stopped" and result.stop_reason.startswith("time limit")
    assert result.steps < 200
    saved = [e for e in rec.of_type(ev.CheckpointSaved) if e.tag == "time_limit"]
    assert len(saved) == 1

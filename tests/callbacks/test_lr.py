"""ReduceLROnPlateau (commands that really change the optimizer) and LearningRateMonitor."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from structlog.testing import capture_logs

from trainbus import ConfigError, EventBus
from trainbus import commands as cmd
from trainbus import events as ev
from trainbus.callbacks import LearningRateMonitor, ReduceLROnPlateau
from trainbus.testing import EventRecorder


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"monitor": ""}, "monitor"),
        ({"patience": 0}, "patience"),
        ({"factor": 1.0}, "factor"),
        ({"factor": 0}, "factor"),
        ({"factor": "half"}, "factor"),
        ({"mode": "down"}, "mode"),
        ({"cooldown": -1}, "cooldown"),
        ({"max_reductions": 0}, "max_reductions"),
        ({"min_delta": float("inf")}, "min_delta"),
    ],
)
def test_plateau_invalid_arguments_name_the_argument(kwargs: dict[str, Any], name: str) -> None:
    with pytest.raises(ConfigError, match=f"^{name}="):
        ReduceLROnPlateau(**kwargs)


def step_lrs_by_epoch(recorder: EventRecorder) -> dict[int, set[float]]:
    out: dict[int, set[float]] = {}
    for e in recorder.of_type(ev.StepEnded):
        out.setdefault(e.epoch, set()).add(e.lr)
    return out


def test_plateau_reduces_the_optimizer_lr(trainer_factory: Any) -> None:
    # A flat metric: evaluation 1 sets the best, evaluations 2-3 and 4-5 are plateaus.
    trainer = trainer_factory(
        [ReduceLROnPlateau(monitor="val_score", patience=2, factor=0.5)],
        epochs=5, batches=2, score=[1.0], lr=0.1,
    )  # fmt: skip
    recorder = EventRecorder(trainer.bus, trainer.bus.stream(ev.StepEnded))
    trainer.fit_sync()
    optimizer: torch.optim.Optimizer = trainer.settings.optimizer
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.025)
    # Applied at the evaluation barrier: epoch 3 already trains at the reduced rate.
    assert step_lrs_by_epoch(recorder) == {0: {0.1}, 1: {0.1}, 2: {0.1}, 3: {0.05}, 4: {0.05}}


def test_plateau_max_reductions(trainer_factory: Any) -> None:
    trainer = trainer_factory(
        [ReduceLROnPlateau(monitor="val_score", patience=1, factor=0.1, max_reductions=1)],
        epochs=4, batches=1, score=[1.0], lr=0.1,
    )  # fmt: skip
    trainer.fit_sync()
    assert trainer.settings.optimizer.param_groups[0]["lr"] == pytest.approx(0.01)


def test_lr_monitor_logs_each_change_once(vbus: EventBus, step_event: Any) -> None:
    monitor = LearningRateMonitor()
    monitor.setup(vbus)
    with capture_logs() as logs:
        vbus.publish(ev.SchedulerStepped(step=1, epoch=0, lr=0.1))
        vbus.publish(step_event(1, lr=0.1))
        vbus.publish(ev.SchedulerStepped(step=2, epoch=0, lr=0.1))
        vbus.publish(step_event(2, lr=0.1))
        vbus.publish(ev.SchedulerStepped(step=3, epoch=0, lr=0.05))
        vbus.publish(step_event(3, lr=0.05))
        vbus.publish(step_event(4, lr=0.01))  # changed by a command, no scheduler
        vbus.flush()
    changes = [x for x in logs if x["event"] == "lr_changed"]
    assert [(x["step"], x["lr"], x["previous"]) for x in changes] == [
        (1, 0.1, None), (3, 0.05, 0.1), (4, 0.01, 0.05)
    ]  # fmt: skip
    assert monitor.history == [(1, 0.1), (3, 0.05), (4, 0.01)]


def test_lr_monitor_logs_lr_commands_and_their_errors(vbus: EventBus) -> None:
    LearningRateMonitor().setup(vbus)
    with capture_logs() as logs:
        for command, error in [
            (cmd.ScaleLearningRate(factor=0.5), None),
            (cmd.StopTraining(reason="x"), None),  # not an LR command: not logged
            (cmd.SetLearningRate(lr=0.2, param_group=3), ConfigError("param_group=3")),
        ]:
            vbus.publish(ev.CommandApplied(step=5, epoch=1, command=command, error=error))
        vbus.flush()
    scaled, refused = logs
    assert scaled == {"event": "lr_command_applied", "log_level": "info", "step": 5, "epoch": 1,
                      "command": "ScaleLearningRate", "factor": 0.5, "param_group": None,
                      "error": None}  # fmt: skip
    assert refused["log_level"] == "warning" and refused["command"] == "SetLearningRate"
    assert refused["lr"] == 0.2 and refused["param_group"] == 3
    assert "param_group=3" in refused["error"]


def test_lr_monitor_in_a_run_with_plateau(trainer_factory: Any) -> None:
    monitor = LearningRateMonitor()
    trainer = trainer_factory(
        [ReduceLROnPlateau(monitor="val_score", patience=1, factor=0.5), monitor],
        epochs=3, batches=2, score=[1.0], lr=0.1,
    )  # fmt: skip
    with capture_logs() as logs:
        trainer.fit_sync()
    # Reductions after evaluations 2 and 3; the last one happens after the last step.
    applied = [x for x in logs if x["event"] == "lr_command_applied"]
    assert [(x["step"], x["factor"]) for x in applied] == [(4, 0.5), (6, 0.5)]
    assert monitor.history == [(1, 0.1), (5, 0.05)]

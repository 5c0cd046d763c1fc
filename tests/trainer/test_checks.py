"""Every Trainer argument is validated up front: a ConfigError (a ValueError) naming the field,
raised by the constructor, before anything runs or touches the disk."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from structlog.testing import capture_logs

from trainbus import Callback, ConfigError, EvalSchedule, EventBus, PerEpoch, Trainer, TrainingError
from trainbus import commands as cmd
from trainbus import events as ev
from trainbus.bus import BusClosedError
from trainbus.callbacks import (
    Checkpointing,
    EarlyStopping,
    EvaluateCheckpoints,
    ReduceLROnPlateau,
    RunPlan,
    ThresholdStopping,
    register_global_callback,
)
from trainbus.testing import EventRecorder, tiny_loader, tiny_model


class _Noop(Callback):
    pass


def _touch(path: Path) -> Path:
    path.write_text("not a folder")
    return path


# (id, overrides(tmp_path) -> kwargs for Trainer, the field the message must name)
# Positional arguments are passed as "model" / "optimizer" / "train_data" overrides.
Case = tuple[Callable[[Path], dict[str, Any]], str]

CASES = [
    pytest.param(lambda p: {"model": "not a module"}, "model", id="model-not-module"),
    pytest.param(lambda p: {"model": torch.nn.ReLU()}, "optimizer", id="model-without-params"),
    pytest.param(lambda p: {"optimizer": "sgd"}, "optimizer", id="optimizer-not-optimizer"),
    pytest.param(
        lambda p: {"optimizer": torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)},
        "optimizer",
        id="optimizer-over-other-params",
    ),
    pytest.param(lambda p: {"train_data": []}, "train_data", id="empty-loader"),
    pytest.param(lambda p: {"train_data": 5}, "train_data", id="train-data-not-iterable"),
    pytest.param(lambda p: {"train_data": torch.zeros(3)}, "train_data", id="train-data-tensor"),
    pytest.param(lambda p: {"eval_data": []}, "eval_data", id="empty-eval-loader"),
    pytest.param(lambda p: {"loss_fn": 5}, "loss_fn", id="loss-fn-not-callable"),
    pytest.param(lambda p: {"max_steps": 0}, "max_steps", id="max-steps-zero"),
    pytest.param(lambda p: {"max_steps": -3}, "max_steps", id="max-steps-negative"),
    pytest.param(lambda p: {"max_steps": 2.5}, "max_steps", id="max-steps-float"),
    pytest.param(lambda p: {"max_steps": True}, "max_steps", id="max-steps-bool"),
    pytest.param(lambda p: {"max_epochs": 0}, "max_epochs", id="max-epochs-zero"),
    pytest.param(lambda p: {"max_steps": None, "max_epochs": None}, "max_steps", id="no-limit"),
    pytest.param(
        lambda p: {"eval_schedule": EvalSchedule(every_steps=2)},
        "eval_schedule.every_steps",
        id="eval-every-without-eval-data",
    ),
    pytest.param(lambda p: {"eval_schedule": 2}, "eval_schedule", id="eval-schedule-int"),
    pytest.param(lambda p: {"precision": "16"}, "precision", id="bad-precision"),
    pytest.param(lambda p: {"precision": 32}, "precision", id="precision-int"),
    pytest.param(lambda p: {"precision": "fp16", "device": "cpu"}, "precision", id="fp16-cpu"),
    pytest.param(lambda p: {"device": "gpu0"}, "device", id="bad-device-string"),
    pytest.param(lambda p: {"device": None}, "device", id="device-none"),
    pytest.param(
        lambda p: {"device": "cuda"},
        "device",
        id="cuda-without-cuda",
        marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available"),
    ),
    pytest.param(lambda p: {"log_every": 0}, "log_every", id="log-every-0"),
    pytest.param(lambda p: {"log_every": "10"}, "log_every", id="log-every-str"),
    pytest.param(lambda p: {"accumulate": 0}, "accumulate", id="accumulate-0"),
    pytest.param(lambda p: {"accumulate": None}, "accumulate", id="accumulate-none"),
    pytest.param(lambda p: {"clip_grad_norm": 0}, "clip_grad_norm", id="clip-0"),
    pytest.param(lambda p: {"clip_grad_norm": -1.0}, "clip_grad_norm", id="clip-negative"),
    pytest.param(lambda p: {"clip_grad_norm": float("inf")}, "clip_grad_norm", id="clip-inf"),
    pytest.param(lambda p: {"clip_grad_norm": "1.0"}, "clip_grad_norm", id="clip-str"),
    pytest.param(lambda p: {"on_nonfinite": "warn"}, "on_nonfinite", id="bad-on-nonfinite"),
    pytest.param(lambda p: {"metrics": {"acc": 3}}, "metrics", id="metric-not-callable"),
    pytest.param(
        lambda p: {"metrics": {"not an id": lambda o, t: 0.0}}, "metrics", id="metric-bad-name"
    ),
    pytest.param(lambda p: {"metrics": 5}, "metrics", id="metrics-int"),
    pytest.param(lambda p: {"metrics": "acc"}, "metrics", id="metrics-str"),
    pytest.param(lambda p: {"seed": -1}, "seed", id="seed-negative"),
    pytest.param(lambda p: {"scheduler": object()}, "scheduler", id="scheduler-without-step"),
    pytest.param(
        lambda p: {
            "scheduler": torch.optim.lr_scheduler.StepLR(
                torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1), 1
            )
        },
        "scheduler",
        id="scheduler-of-another-optimizer",
    ),
    pytest.param(
        lambda p: {"eval_data": iter(tiny_loader(1))}, "eval_data", id="eval-data-one-shot"
    ),
    pytest.param(
        lambda p: {"train_data": iter(tiny_loader(2)), "max_epochs": 2},
        "train_data",
        id="train-data-one-shot-for-two-epochs",
    ),
    pytest.param(lambda p: {"accumulate": 0}, "accumulate", id="accumulate-zero"),
    pytest.param(lambda p: {"accumulate": "2"}, "accumulate", id="accumulate-str"),
    pytest.param(
        lambda p: {"checkpoint_dir": _touch(p / "afile")}, "checkpoint_dir", id="ckpt-dir-is-file"
    ),
    pytest.param(lambda p: {"checkpoint_dir": 5}, "checkpoint_dir", id="ckpt-dir-int"),
    pytest.param(lambda p: {"checkpoint_dir": ""}, "checkpoint_dir", id="ckpt-dir-empty"),
    pytest.param(lambda p: {"callbacks": [object()]}, "callbacks", id="callback-not-callback"),
    pytest.param(lambda p: {"callbacks": [int]}, "callbacks", id="callback-class-not-callback"),
    pytest.param(lambda p: {"callbacks": 5}, "callbacks", id="callbacks-not-iterable"),
    pytest.param(lambda p: {"on_signal": "yes"}, "on_signal", id="on-signal-str"),
    pytest.param(lambda p: {"on_signal": False}, "on_signal", id="on-signal-false"),
    pytest.param(lambda p: {"bus": object()}, "bus", id="bus-not-eventbus"),
]


@pytest.mark.parametrize(("overrides", "field"), CASES)
def test_bad_argument_is_a_config_error_naming_the_field(
    tmp_path: Path, overrides: Callable[[Path], dict[str, Any]], field: str
) -> None:
    model = tiny_model()
    kwargs: dict[str, Any] = {
        "model": model,
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
        "train_data": tiny_loader(2, 4),
        "loss_fn": F.cross_entropy,
        "max_steps": 2,
        "checkpoint_dir": tmp_path / "run",
        "on_signal": None,
    }
    kwargs.update(overrides(tmp_path))
    before = sorted(tmp_path.rglob("*"))
    positional = (kwargs.pop("model"), kwargs.pop("optimizer"), kwargs.pop("train_data"))
    with pytest.raises(ConfigError) as info:
        Trainer(*positional, **kwargs)
    assert isinstance(info.value, ValueError)
    assert field in str(info.value), str(info.value)
    # Nothing touched the disk: no run folder, no new file.
    assert not (tmp_path / "run").exists()
    assert sorted(tmp_path.rglob("*")) == before


def test_valid_arguments_construct(tmp_path: Path) -> None:
    """Control: the base arguments of the cases above are valid (so each case fails alone)."""
    model = tiny_model()
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        tiny_loader(2, 4),
        loss_fn=F.cross_entropy,
        max_steps=2,
        checkpoint_dir=tmp_path / "run",
        on_signal=None,
        callbacks=[_Noop],
    )
    assert trainer.settings.max_steps == 2
    assert not (tmp_path / "run").exists()  # created at the first save, never before


def test_misspelt_callback_method_is_a_config_error() -> None:
    class Typo(Callback):
        def on_step_end(self, event: Any) -> None:  # should be on_step_ended
            pass

    model = tiny_model()
    with pytest.raises(ConfigError, match="on_step_ended"):
        Trainer(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            tiny_loader(2, 4),
            loss_fn=F.cross_entropy,
            max_steps=2,
            callbacks=[Typo()],
        )


class _LightningStyle(Callback):
    def on_train_batch_end(self, event: Any) -> None:  # Lightning's name
        pass


def test_a_lightning_callback_method_is_a_config_error_naming_the_trainbus_one() -> None:
    model = tiny_model()
    with pytest.raises(ConfigError) as info:
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_loader(2, 4),
                loss_fn=F.cross_entropy, max_steps=2, callbacks=[_LightningStyle()])  # fmt: skip
    assert str(info.value) == (
        "_LightningStyle.on_train_batch_end='on_train_batch_end' is invalid: that is "
        "Lightning's Callback.on_train_batch_end; in trainbus: on_step_ended (after each "
        "optimizer step)"
    )


def test_a_lightning_callback_method_is_refused_by_a_driver_too() -> None:
    from trainbus._launcher import add_driver_callback

    with pytest.raises(ConfigError, match="in trainbus: on_step_ended"):
        add_driver_callback(EventBus(), _LightningStyle)


def test_a_user_event_named_like_a_lightning_method_is_subscribed() -> None:
    from dataclasses import dataclass

    @dataclass(frozen=True, slots=True, kw_only=True)
    class TrainBatchEnd(ev.BaseEvent):
        pass

    class Mine(Callback):
        def on_train_batch_end(self, event: TrainBatchEnd) -> None:
            pass

    model = tiny_model()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_loader(2, 4),
                      loss_fn=F.cross_entropy, max_steps=2, callbacks=[Mine()])  # fmt: skip
    assert len(trainer.callbacks) == 1


def test_every_lightning_callback_method_is_refused_naming_its_migration_row() -> None:
    """The hint is read from the migration table: each Lightning ``on_*`` hook has one, naming
    the ``on_*`` / ``hook_*`` methods of its row (which are trainbus Callback methods)."""
    import tomllib

    from trainbus._moved import lightning_method_hint
    from trainbus.callbacks._base import EVENT_METHODS, HOOK_METHODS

    table = tomllib.loads((Path(__file__).parents[2] / "src/trainbus/migration.toml").read_text())
    hooks = [h for h in table["frameworks"]["lightning"]["hooks"] if h.startswith("on_")]
    assert len(hooks) >= 30
    for entry in table["entries"]:
        if entry["framework"] != "lightning" or entry["name"] not in hooks:
            continue
        hint = lightning_method_hint(entry["name"])
        assert hint is not None, entry
        use = hint.split("in trainbus: ")[1]
        named = re.findall(r"\b(?:on|hook)_[a-z_]+", use.split(" (")[0])
        assert all(n in EVENT_METHODS or n in HOOK_METHODS for n in named), (hint, named)
        events = entry.get("event", [])
        assert len(named) == len([events] if isinstance(events, str) else events) + (
            "hook" in entry
        ), hint
        assert named or entry["note"].replace("`", "") in hint, hint
    assert lightning_method_hint("on_step_ended") is None


# Misconfiguration up front: what can never work fails before the run, naming the option, not as
# a silent no-op or a subscriber failure mid-run; a command sent after the run is an error; a
# plain function given to ``subscribe_async`` is refused at subscription.


DATA = tiny_loader(4, 8)


def _acc(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return (outputs.argmax(-1) == targets).float().mean()


def _trainer(callbacks: Any = (), **kwargs: Any) -> Trainer:
    model = tiny_model()
    kwargs.setdefault("max_epochs", 1)
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), DATA,
                   loss_fn=F.cross_entropy, callbacks=callbacks, on_signal=None,
                   progress=False, **kwargs)  # fmt: skip


def _refused(trainer: Trainer, pattern: str) -> ConfigError:
    rec = EventRecorder(trainer.bus)
    with pytest.raises(ConfigError, match=pattern) as info:
        trainer.fit_sync()
    # Refused before anything ran: no FitStarted, no step, no result.
    assert not rec.of_type(ev.FitStarted) and trainer.result is None
    return info.value


def _one_argument(outputs: torch.Tensor) -> torch.Tensor:
    return outputs.mean()


class _OneArgumentUpdate:
    def update(self, outputs: Any) -> dict[str, float]:
        return {"n": 1.0}

    def compute(self, totals: Any) -> float:
        return 0.0


def test_a_metric_that_cannot_take_outputs_and_targets_is_refused_up_front() -> None:
    """Not at the first evaluation, after an epoch of training: at the constructor."""
    with pytest.raises(
        ConfigError,
        match=r"^metrics\['mean'\]=<function _one_argument .*"
        r"fn\(outputs, targets\).*takes \(outputs",
    ):
        _trainer(eval_data=DATA, metrics={"mean": _one_argument})
    with pytest.raises(ConfigError, match=r"^set_metrics\['n'\]=.*its update takes \(outputs"):
        _trainer(eval_data=DATA, set_metrics={"n": _OneArgumentUpdate()})
    # Control: what takes two positional arguments passes (defaults and *args included).
    metrics = {"acc": _acc, "ce": F.cross_entropy, "any": lambda *a: 0.0}
    assert set(_trainer(eval_data=DATA, metrics=metrics).evaluate_sync()) == {
        "val_loss",
        "val_acc",
        "val_ce",
        "val_any",
    }


# ====================================================================== monitored metrics
def test_checkpointing_monitor_without_eval_data(tmp_path: Path) -> None:
    folder = tmp_path / "ck"
    trainer = _trainer([Checkpointing(monitor="val_loss")], checkpoint_dir=folder)
    err = _refused(trainer, r"Checkpointing\.monitor='val_loss'.*no eval_data")
    assert "EvaluateCheckpoints" in str(err)
    assert not folder.exists()  # today's silent run would have saved cadence checkpoints


def test_checkpointing_monitor_of_a_metric_eval_data_lacks(tmp_path: Path) -> None:
    trainer = _trainer([Checkpointing(monitor="val_acc", mode="max")], eval_data=DATA,
                       checkpoint_dir=tmp_path)  # fmt: skip
    _refused(trainer, r"Checkpointing\.monitor='val_acc'.*produces: val_loss \(")


def test_checkpointing_monitor_of_a_produced_metric_saves_best(tmp_path: Path) -> None:
    trainer = _trainer([Checkpointing(monitor="val_acc", mode="max", every_epochs=None)],
                       eval_data=DATA, metrics={"acc": _acc}, checkpoint_dir=tmp_path)  # fmt: skip
    rec = EventRecorder(trainer.bus)
    assert trainer.fit_sync().reason == "completed"
    # Saved at the last step: the final checkpoint would be the same file, so none is written.
    assert [s.tag for s in rec.of_type(ev.CheckpointSaved)] == ["best"]


def test_checkpointing_without_a_checkpoint_dir() -> None:
    # Every SaveCheckpoint would be refused (acknowledged with an error nobody reads).
    _refused(_trainer([Checkpointing(every_epochs=1)]), r"checkpoint_dir=None.*Checkpointing")


def test_checkpointing_monitor_with_evaluation_jobs_only_is_accepted(tmp_path: Path) -> None:
    async def job(path: str) -> dict[str, float]:
        return {"val_loss": 0.5}

    jobs = EvaluateCheckpoints(job)
    trainer = _trainer([Checkpointing(monitor="val_loss"), jobs], checkpoint_dir=tmp_path)
    rec = EventRecorder(trainer.bus)
    assert trainer.fit_sync().reason == "completed"
    assert rec.of_type(ev.ExternalEvaluationEnded)  # the jobs do produce it


def test_early_stopping_on_a_metric_no_evaluation_produces() -> None:
    trainer = _trainer([EarlyStopping("val_acc")], eval_data=DATA)
    _refused(trainer, r"EarlyStopping\.monitor='val_acc'.*val_loss")


def test_early_stopping_without_eval_data() -> None:
    _refused(_trainer([EarlyStopping()]), r"EarlyStopping\.monitor='val_loss'.*no eval_data")


def test_early_stopping_on_a_named_set_metric() -> None:
    sets = {"val": DATA, "test": DATA}
    ok = _trainer([EarlyStopping("test/acc", mode="max")], eval_data=sets, metrics={"acc": _acc})
    assert ok.fit_sync().reason == "completed"
    bad = _trainer([EarlyStopping("test/acc", mode="max")], eval_data=sets)
    _refused(bad, r"'test/acc'.*test/loss, val/loss")


def test_reduce_lr_on_plateau_without_eval_data() -> None:
    _refused(_trainer([ReduceLROnPlateau()]), r"ReduceLROnPlateau\.monitor='val_loss'")


@pytest.mark.parametrize(
    ("stopper", "eval_data", "pattern"),
    [
        (ThresholdStopping("los", below=0.0), None, r"'los'.*grad_norm, loss, lr"),
        (ThresholdStopping("val_acc", above=2.0), DATA, r"'val_acc'.*val_loss"),
        (ThresholdStopping("val_loss", below=0.0), None, r"'val_loss'.*no eval_data"),
        (ThresholdStopping("loss", below=0.0, source="eval"), DATA, r"'loss'.*val_loss"),
    ],
)
def test_threshold_stopping_on_a_metric_its_source_lacks(
    stopper: ThresholdStopping, eval_data: Any, pattern: str
) -> None:
    _refused(_trainer([stopper], eval_data=eval_data), r"ThresholdStopping\.monitor=" + pattern)


def test_threshold_stopping_on_training_metrics_is_accepted() -> None:
    result = _trainer([ThresholdStopping("steps_per_s", below=0.0)], log_every=1).fit_sync()
    assert result.reason == "completed"


def test_a_refused_run_leaves_the_trainer_usable() -> None:
    stopper = EarlyStopping("val_acc")
    global_stopper = ThresholdStopping("val_typo", above=1.0)
    handle = register_global_callback(global_stopper)
    try:
        trainer = _trainer([stopper], eval_data=DATA)
        _refused(trainer, r"'val_acc'")
        assert global_stopper not in trainer.callbacks  # detached again
    finally:
        handle.remove()
    trainer.remove_callback(stopper)
    assert trainer.fit_sync().reason == "completed"


def test_the_plan_a_callback_sees() -> None:
    seen: list[RunPlan] = []

    class Probe(Callback):
        def check(self, plan: RunPlan) -> None:
            seen.append(plan)

    _trainer([Probe()], eval_data={"a": DATA, "b": DATA}, metrics={"acc": _acc}).fit_sync()
    (plan,) = seen
    assert plan.eval_metrics == {"a/loss", "a/acc", "b/loss", "b/acc"}
    assert {"loss", "lr", "steps_per_s", "samples_per_s"} <= plan.train_metrics
    assert plan.checkpoint_dir is None and not plan.external_evaluations


# ====================================================================== silent mistakes
def test_a_scheduler_of_another_optimizer_is_refused() -> None:
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    other = torch.optim.SGD(model.parameters(), lr=0.1)  # a second optimizer, same model
    with pytest.raises(ConfigError, match=r"^scheduler='StepLR' is invalid: a scheduler of "
                                          r"the Trainer's optimizer.*never change"):  # fmt: skip
        Trainer(model, opt, DATA, loss_fn=F.cross_entropy, max_steps=2,
                scheduler=torch.optim.lr_scheduler.StepLR(other, 1, gamma=0.5))  # fmt: skip
    # Control: on the Trainer's own optimizer the learning rate moves.
    trainer = Trainer(model, opt, DATA, loss_fn=F.cross_entropy, max_steps=2,
                      scheduler=torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5),
                      on_signal=None, progress=False)  # fmt: skip
    trainer.fit_sync()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.025)


def test_a_scheduler_of_another_optimizer_under_a_name_is_refused() -> None:
    model = torch.nn.Sequential(tiny_model(), torch.nn.Linear(10, 10))
    g = torch.optim.SGD(model[0].parameters(), lr=0.1)
    d = torch.optim.SGD(model[1].parameters(), lr=0.1)
    stray = torch.optim.SGD(model[1].parameters(), lr=0.1)
    with pytest.raises(ConfigError, match=r"^scheduler\['d'\]="):
        Trainer(model, {"g": g, "d": d}, DATA, loss_fn=F.cross_entropy, max_steps=2,
                scheduler={"d": torch.optim.lr_scheduler.StepLR(stray, 1)})  # fmt: skip


@pytest.mark.parametrize("per_epoch", [False, True], ids=["per-step", "per-epoch"])
def test_torch_reduce_lr_on_plateau_is_refused_for_the_callback(per_epoch: bool) -> None:
    """Its ``.step()`` needs a metric the loop does not pass: refused before the run."""
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
    with pytest.raises(
        ConfigError,
        match=r"^scheduler='ReduceLROnPlateau' is invalid: .*"
        r"trainbus\.callbacks\.ReduceLROnPlateau\(monitor='val_loss'\)",
    ):
        Trainer(model, opt, DATA, loss_fn=F.cross_entropy, max_steps=2,
                scheduler=PerEpoch(plateau) if per_epoch else plateau)  # fmt: skip


def _generator(n: int = 4) -> Any:
    return (batch for batch in tiny_loader(n, 8))


@pytest.mark.parametrize(
    ("eval_data", "field"),
    [(_generator, "eval_data"), (lambda: {"val": DATA, "test": iter(DATA)}, "eval_data['test']")],
)
def test_a_one_shot_iterator_as_eval_data_is_refused(eval_data: Any, field: str) -> None:
    # It would pass the first evaluation and score nothing at the second.
    with pytest.raises(ConfigError, match=rf"^{re.escape(field)}='<one-shot \w+>' is invalid: "
                                          r"data that can be iterated again \(each evaluation "
                                          r".*a list of batches, a DataLoader"):  # fmt: skip
        _trainer(eval_data=eval_data(), max_epochs=2)
    # One pass of a generator is fine where only one is made: a standalone evaluation.
    metrics = _trainer(eval_data=DATA).evaluate_sync(_generator())
    assert set(metrics) == {"val_loss"}


def test_a_one_shot_iterator_as_train_data_for_several_epochs_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"^train_data='<one-shot generator>' is invalid: .*"
                                          r"max_epochs=2 makes a new pass per epoch"):  # fmt: skip
        _train_on(_generator(), max_epochs=2)


def _train_on(data: Any, **kwargs: Any) -> Any:
    model = tiny_model()
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
                   loss_fn=F.cross_entropy, on_signal=None, progress=False,
                   **kwargs).fit_sync()  # fmt: skip


def test_a_one_shot_iterator_trains_within_its_one_pass() -> None:
    assert _train_on(_generator(4), max_epochs=1).steps == 4
    assert _train_on(_generator(4), max_steps=3).steps == 3
    # Spent before max_steps: the error says so, not "an empty loader".
    with pytest.raises(
        TrainingError,
        match=r"train_data, a one-shot generator, was spent "
        r"after epoch 0 at step 4, before max_steps=6",
    ):
        _train_on(_generator(4), max_steps=6)


# ====================================================================== the bus
def test_send_after_the_run_is_an_error() -> None:
    trainer = _trainer(max_steps=1)
    trainer.fit_sync()
    trainer.close()  # the bus outlives a call (the next may resume); closing ends it
    with pytest.raises(BusClosedError, match=r"StopTraining.*while fit"):
        trainer.bus.send(cmd.StopTraining(reason="late"))
    with pytest.raises(BusClosedError):
        trainer.bus.commands.on_next(cmd.SaveCheckpoint())


def test_send_while_the_bus_closes_is_logged_not_raised() -> None:
    # A subscriber answering FitEnded runs while the bus closes: its command cannot be applied
    # any more, which is logged; it is not a subscriber failure.
    trainer = _trainer(max_steps=1)
    trainer.bus.subscribe(trainer.bus.stream(ev.FitEnded),
                          lambda e: trainer.bus.send(cmd.StopTraining(reason="late")))  # fmt: skip
    trainer.bus.subscribe(trainer.bus.stream(ev.FitEnded),
                          lambda e: trainer.bus.send(cmd.SaveCheckpoint(tag="late")))  # fmt: skip
    with capture_logs() as logs:
        result = trainer.fit_sync()
    assert result.reason == "completed" and result.subscriber_failures == {}
    # The save is lost work, a warning; the stop asks for what already happened, no warning.
    (late,) = [e for e in logs if e["event"] == "commands_not_applied"]
    assert late["log_level"] == "warning" and "SaveCheckpoint" in repr(late["commands"])
    assert "StopTraining" not in repr(late["commands"])
    (stop,) = [e for e in logs if e["event"] == "stop_after_the_end"]
    assert stop["log_level"] == "info" and "late" in repr(stop["commands"])
    # Dropped at the call's end, not carried into the next call: an evaluation after it scores
    # every batch and applies no command.
    applied: list[ev.CommandApplied] = []
    trainer.bus.subscribe(trainer.bus.stream(ev.CommandApplied), applied.append)
    scored: list[ev.EvalBatchEnded] = []
    trainer.bus.subscribe(trainer.bus.stream(ev.EvalBatchEnded), scored.append)
    trainer.evaluate_sync(DATA)
    assert applied == [] and len(scored) == len(DATA)


def test_send_before_the_run_is_applied_at_its_start() -> None:
    trainer = _trainer(max_steps=5)
    trainer.bus.send(cmd.StopTraining(reason="early"))
    result = trainer.fit_sync()
    assert (result.reason, result.stop_reason, result.steps) == ("stopped", "early", 0)


@pytest.mark.asyncio
async def test_subscribe_async_refuses_a_plain_function() -> None:
    bus = EventBus()

    def plain(event: ev.BaseEvent) -> None:
        pass

    with pytest.raises(ConfigError, match=r"fn='.*plain' is invalid: an async def function.*"
                                          r"bus\.subscribe"):  # fmt: skip
        bus.subscribe_async(bus.stream(ev.StepEnded), plain)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="fn="):
        bus.subscribe_async(bus.events, lambda e: None)  # type: ignore[arg-type,return-value]
    assert bus.statistics().subscriptions == ()


@pytest.mark.asyncio
async def test_subscribe_async_accepts_every_async_callable() -> None:
    got: list[tuple[str, int]] = []

    async def record(tag: str, event: ev.StepEnded) -> None:
        got.append((tag, event.step))

    class Sink:
        async def __call__(self, event: ev.StepEnded) -> None:
            got.append(("object", event.step))

        async def method(self, event: ev.StepEnded) -> None:
            got.append(("method", event.step))

    async with EventBus() as bus:
        bus.subscribe_async(bus.stream(ev.StepEnded), functools.partial(record, "partial"))
        bus.subscribe_async(bus.stream(ev.StepEnded), Sink())
        bus.subscribe_async(bus.stream(ev.StepEnded), Sink().method)
        bus.publish(ev.StepEnded(step=1, epoch=0, loss=torch.tensor(0.0), lr=0.1,
                                 grad_norm=None, samples=1, duration_s=0.0))  # fmt: skip
    assert sorted(got) == [("method", 1), ("object", 1), ("partial", 1)]


def test_a_dataset_of_samples_is_refused_naming_the_dataloader_that_batches_it() -> None:
    # A Hugging Face habit: the Trainer there takes a Dataset (train_dataset, eval_dataset).
    class Pairs(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
        def __len__(self) -> int:
            return 8

        def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.full((32,), float(i)), torch.tensor(i % 10)

    batches = r"a Dataset gives single samples; wrap it, DataLoader\(dataset, batch_size=N"
    with pytest.raises(ConfigError, match=rf"^train_data='Pairs' is invalid: .*{batches}"):
        _train_on(Pairs(), max_steps=1)
    with pytest.raises(ConfigError, match=rf"^eval_data\['test'\]='Pairs' is invalid: .*{batches}"):
        _train_on(DATA, max_steps=1, eval_data={"val": DATA, "test": Pairs()})
    # Wrapped as the message says, it trains.
    loader = torch.utils.data.DataLoader(Pairs(), batch_size=4)
    assert _train_on(loader, max_steps=2, eval_data=loader).steps == 2


# Lightning's precision spellings: each one trainbus means is accepted, every other one is
# refused with the accepted spellings listed.


def _precision_trainer(**kwargs: Any) -> Trainer:
    model = tiny_model()
    kwargs.setdefault("max_steps", 4)
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_loader(8, 4),
                   loss_fn=F.cross_entropy, progress=False, **kwargs)  # fmt: skip


@pytest.mark.parametrize(
    ("spelling", "meant"), [("32-true", "32"), ("bf16-mixed", "bf16"), ("32", "32")]
)
def test_lightning_precision_spellings_are_accepted(spelling: str, meant: str) -> None:
    trainer = _precision_trainer(precision=spelling, max_steps=2)
    assert trainer.settings.precision == meant
    assert trainer.fit_sync().steps == 2


def test_16_mixed_on_the_cpu_names_what_was_written_and_bf16() -> None:
    with pytest.raises(ConfigError) as info:
        _precision_trainer(precision="16-mixed", device="cpu")
    assert str(info.value) == (
        "precision='16-mixed' is invalid: '32' or 'bf16' on cpu: '16-mixed' is fp16 with a "
        "grad scaler, which needs CUDA; mixed precision on cpu is precision='bf16'"
    )


@pytest.mark.parametrize("spelling", ["16", "float16", "bf16-true", "16-true", "64-true", 32])
def test_an_unknown_precision_lists_the_accepted_spellings(spelling: object) -> None:
    with pytest.raises(ConfigError) as info:
        _precision_trainer(precision=spelling)
    message = str(info.value)
    assert f"precision={spelling!r}" in message
    for accepted in ("'32'", "'bf16'", "'fp16'", "'32-true'", "'bf16-mixed'", "'16-mixed'"):
        assert accepted in message
    if isinstance(spelling, str) and spelling.endswith("-true"):
        dtype = {"16-true": "float16", "bf16-true": "bfloat16", "64-true": "float64"}[spelling]
        assert f"cast it yourself (model.to(torch.{dtype}))" in message
    if spelling == 32:
        assert "strings: precision='32'" in message


# add_hook checks its hook where it is added, not at the step that would call it.


def test_a_hook_that_cannot_take_the_context_is_refused_at_add_hook() -> None:
    trainer = _precision_trainer(max_steps=1)
    with pytest.raises(ConfigError) as info:
        trainer.add_hook("loss", lambda: None)
    assert str(info.value).startswith("fn=<function ")
    assert "a 'loss' hook is called with one argument, the StepContext; this one takes ()" in (
        str(info.value)
    )
    assert trainer.fit_sync().steps == 1  # nothing was added


def test_a_lightning_style_hook_point_names_the_hook_points_and_the_event_stream() -> None:
    trainer = _precision_trainer()
    with pytest.raises(ConfigError) as info:
        trainer.add_hook("on_step_end", lambda ctx: None)  # type: ignore[arg-type]
    message = str(info.value)
    assert message.startswith("point='on_step_end' is invalid: one of 'batch', ")
    assert "trainer.bus.stream(events.StepEnded).subscribe(fn)" in message


def test_max_time_names_the_time_limit_callback() -> None:
    with pytest.raises(TypeError) as info:
        _precision_trainer(max_time=3600)
    assert "callbacks=[TimeLimit(seconds)]" in str(info.value)


def test_a_model_without_forward_and_eval_data_is_refused_up_front() -> None:
    """A GAN's ``ModuleDict`` trained by its own step: evaluation would call ``model(inputs)``,
    which it cannot, one epoch in; it is refused before any step."""
    from trainbus import TrainContext
    from trainbus.testing import tiny_loader

    gan = torch.nn.ModuleDict({"g": torch.nn.Linear(32, 32), "d": torch.nn.Linear(32, 10)})

    def step(ctx: TrainContext) -> torch.Tensor:
        loss = F.cross_entropy(gan["d"](gan["g"](ctx.batch[0])), ctx.batch[1])
        ctx.backward(loss)
        ctx.optimizer_step()
        return loss

    said = r"^eval_data=.* is invalid: None for a model without forward\(\) \(ModuleDict\)"
    with pytest.raises(ConfigError, match=said):
        Trainer(gan, torch.optim.SGD(gan.parameters(), lr=0.1), tiny_loader(4),
                eval_data=tiny_loader(1, seed=1), train_step=step, max_steps=4)  # fmt: skip


# ------------------------------------------------------------------ a class, or None, given
@pytest.mark.parametrize(
    ("field", "given", "says"),
    [
        ("optimizer", torch.optim.SGD, "optimizer=<class SGD> is invalid: a torch.optim.Optimizer"),
        ("optimizer", None, "optimizer=None is invalid: a torch.optim.Optimizer"),
        ("model", torch.nn.Linear, "model=<class Linear> is invalid: a torch.nn.Module"),
        ("model", tiny_model, "model=<function tiny_model> is invalid: a torch.nn.Module"),
        ("train_data", None, "train_data=None is invalid: an iterable of batches"),
        ("train_data", 3, "train_data='int' is invalid: an iterable of batches"),
        ("scheduler", torch.optim.lr_scheduler.StepLR,
         "scheduler=<class StepLR> is invalid: an LR scheduler"),
    ],
)  # fmt: skip
def test_a_class_or_none_given_for_an_argument_is_named_as_such(
    field: str, given: Any, says: str
) -> None:
    """The Lightning habit of passing the class (``optimizer=torch.optim.SGD``) is told to
    build it; None reads as None, not as the name of its type."""
    model = tiny_model()
    args: dict[str, Any] = dict(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                train_data=tiny_loader(3))  # fmt: skip
    kwargs: dict[str, Any] = dict(loss_fn=F.cross_entropy, max_steps=2, on_signal=None)
    (args if field in args else kwargs)[field] = given
    with pytest.raises(ConfigError) as raised:
        Trainer(args["model"], args["optimizer"], args["train_data"], **kwargs)
    assert str(raised.value).startswith(says)
    if callable(given):
        assert f"pass what it builds, {given.__qualname__}(...)" in str(raised.value)

"""Misconfiguration up front: what can never work fails before the run, naming the option, not as
a silent no-op or a subscriber failure mid-run; a command sent after the run is an error; a plain
function given to ``subscribe_async`` is refused at subscription."""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from structlog.testing import capture_logs

from trainbus import Callback, ConfigError, EventBus, Trainer, TrainingError
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

DATA = tiny_loader(4, 8)


def _acc(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return (outputs.argmax(-1) == targets).float().mean()


def _trainer(callbacks: Any = (), **kwargs: Any) -> Trainer:
    model = tiny_model()
    kwargs.setdefault("max_epochs", 1)
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), DATA,
                   loss_fn=F.cross_entropy, callbacks=callbacks, handle_signals=False,
                   progress=False, **kwargs)  # fmt: skip


def _refused(trainer: Trainer, pattern: str) -> ConfigError:
    rec = EventRecorder(trainer.bus)
    with pytest.raises(ConfigError, match=pattern) as info:
        trainer.fit_sync()
    # Refused before anything ran: no FitStarted, no step, no result.
    assert not rec.of_type(ev.FitStarted) and trainer.result is None
    return info.value


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
    _refused(trainer, r"EarlyStopping\.metric='val_acc'.*val_loss")


def test_early_stopping_without_eval_data() -> None:
    _refused(_trainer([EarlyStopping()]), r"EarlyStopping\.metric='val_loss'.*no eval_data")


def test_early_stopping_on_a_named_set_metric() -> None:
    sets = {"val": DATA, "test": DATA}
    ok = _trainer([EarlyStopping("test/acc", mode="max")], eval_data=sets, metrics={"acc": _acc})
    assert ok.fit_sync().reason == "completed"
    bad = _trainer([EarlyStopping("test/acc", mode="max")], eval_data=sets)
    _refused(bad, r"'test/acc'.*test/loss, val/loss")


def test_reduce_lr_on_plateau_without_eval_data() -> None:
    _refused(_trainer([ReduceLROnPlateau()]), r"ReduceLROnPlateau\.metric='val_loss'")


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
    _refused(_trainer([stopper], eval_data=eval_data), r"ThresholdStopping\.metric=" + pattern)


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
                      handle_signals=False, progress=False)  # fmt: skip
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
                   loss_fn=F.cross_entropy, handle_signals=False, progress=False,
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
    with capture_logs() as logs:
        result = trainer.fit_sync()
    assert result.reason == "completed" and result.subscriber_failures == {}
    (late,) = [e for e in logs if e["event"] == "commands_not_applied"]
    assert "late" in repr(late["commands"])
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

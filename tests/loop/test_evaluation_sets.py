"""Several named evaluation sets: validation, events, metric keys, and the kit naming one set."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from trainbus import ConfigError, EvalSchedule, Trainer
from trainbus import commands as cmd
from trainbus import events as ev
from trainbus.callbacks import Checkpointing, EarlyStopping
from trainbus.testing import EventRecorder, tiny_loader, tiny_model


def accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return (outputs.argmax(-1) == targets).float()


def make_trainer(eval_data: Any, **overrides: Any) -> Trainer:
    model = tiny_model()
    kwargs: dict[str, Any] = dict(
        loss_fn=F.cross_entropy, eval_data=eval_data, max_epochs=2, device="cpu",
        on_signal=None, progress=False, metrics={"acc": accuracy},
    )  # fmt: skip
    kwargs.update(overrides)
    lr = kwargs.pop("lr", 0.1)
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=lr), tiny_loader(3), **kwargs)


def two_sets() -> dict[str, Any]:
    return {"val": tiny_loader(2, seed=1), "test": tiny_loader(1, seed=2)}


def test_named_sets_key_metrics_per_set_and_events_name_the_set() -> None:
    trainer = make_trainer(two_sets(), trace={"forward"})
    recorder = EventRecorder(trainer.bus)
    result = trainer.fit_sync()
    assert set(result.eval_metrics) == {"val/loss", "val/acc", "test/loss", "test/acc"}
    ends = recorder.of_type(ev.EvaluationEnded)
    assert [e.dataset for e in ends] == ["val", "test"] * 2
    assert all(set(e.metrics) == {f"{e.dataset}/loss", f"{e.dataset}/acc"} for e in ends)
    assert [b.dataset for b in recorder.of_type(ev.EvalBatchEnded)] == ["val", "val", "test"] * 2
    forwards = recorder.of_type(ev.SpanTraced)
    assert {e.dataset for e in forwards if e.phase == "eval"} == {"val", "test"}
    assert all(e.dataset is None for e in forwards if e.phase == "train")
    rounds = recorder.of_type(ev.EvaluationRoundEnded)
    assert len(rounds) == 2 and dict(rounds[-1].metrics) == dict(result.eval_metrics)
    # The per-set value is the per-sample mean over that set only.
    test_x, test_y = tiny_loader(1, seed=2)[0]
    with torch.no_grad():
        expected = F.cross_entropy(trainer.settings.model(test_x), test_y).item()
    assert result.eval_metrics["test/loss"] == pytest.approx(expected, rel=1e-5)


def test_a_single_loader_keeps_todays_keys() -> None:
    trainer = make_trainer(tiny_loader(2, seed=1))
    recorder = EventRecorder(trainer.bus)
    result = trainer.fit_sync()
    assert set(result.eval_metrics) == {"val_loss", "val_acc"}
    assert {e.dataset for e in recorder.of_type(ev.EvaluationEnded)} == {"val"}
    assert all(r.datasets == ("val",) for r in recorder.of_type(ev.EvaluationRoundStarted))


def test_evaluate_command_with_named_sets_answers_with_the_round() -> None:
    trainer = make_trainer(two_sets(), max_epochs=1, eval_schedule=EvalSchedule(epoch_end=False))

    def send(ctx: Any) -> None:
        if ctx.step == 1:
            trainer.bus.send(cmd.Evaluate())

    trainer.add_hook("after_optimizer_step", send)
    recorder = EventRecorder(trainer.bus)
    trainer.fit_sync()
    (ack,) = recorder.of_type(ev.CommandApplied)
    assert isinstance(ack.result, ev.EvaluationRoundEnded) and ack.result.trigger == "command"
    assert set(ack.result.metrics) == {"val/loss", "val/acc", "test/loss", "test/acc"}


def test_early_stopping_and_checkpointing_name_one_set(tmp_path: Path) -> None:
    # lr=0: nothing improves, so patience 1 stops after the second epoch's evaluation.
    stopper = EarlyStopping(monitor="test/loss", patience=1)
    saver = Checkpointing(monitor="val/acc", mode="max")
    trainer = make_trainer(two_sets(), max_epochs=5, lr=0.0, checkpoint_dir=tmp_path,
                           callbacks=[stopper, saver])  # fmt: skip
    recorder = EventRecorder(trainer.bus)
    result = trainer.fit_sync()
    assert result.subscriber_failures == {}
    assert (result.reason, result.steps) == ("stopped", 6)  # after the second evaluation
    best = [s for s in recorder.of_type(ev.CheckpointSaved) if s.tag == "best"]
    assert len(best) == 1 and best[0].step == 3  # the first val/acc; later ones are equal


def test_a_key_no_set_has_fails_before_the_run_with_the_keys() -> None:
    trainer = make_trainer(two_sets(), max_epochs=1, callbacks=[EarlyStopping(monitor="val_loss")])
    with pytest.raises(ConfigError, match=r"EarlyStopping\.monitor='val_loss'.*test/acc.*val/loss"):
        trainer.fit_sync()
    assert trainer.result is None


@pytest.mark.parametrize(
    ("eval_data", "field"),
    [
        pytest.param({}, "eval_data", id="empty-mapping"),
        pytest.param({1: [1]}, "eval_data", id="name-not-a-string"),
        pytest.param({"": tiny_loader(1)}, "eval_data", id="empty-name"),
        pytest.param({"a/b": tiny_loader(1)}, "eval_data", id="name-with-slash"),
        pytest.param({"val": 3}, "eval_data['val']", id="set-not-iterable"),
        pytest.param({"val": []}, "eval_data['val']", id="set-empty"),
        pytest.param({"val": torch.zeros(3)}, "eval_data['val']", id="set-is-a-tensor"),
        pytest.param(5, "eval_data", id="not-iterable"),
    ],
)
def test_bad_eval_data_is_a_config_error_naming_the_field(eval_data: Any, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        make_trainer(eval_data)
    assert str(info.value).startswith(f"{field}=")


def test_a_failing_metric_function_closes_the_batch_set_and_round_spans() -> None:
    def broken(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("metric bug")

    trainer = make_trainer(two_sets(), metrics={"broken": broken}, trace=True)
    recorder = EventRecorder(trainer.bus)
    with pytest.raises(RuntimeError, match="metric bug") as info:
        trainer.fit_sync()
    assert any("evaluation of 'val'" in note for note in info.value.__notes__)
    names = recorder.names()
    i = names.index("EvalBatchStarted")
    assert names[i : i + 5] == [
        "EvalBatchStarted", "SpanTraced", "EvalBatchEnded", "EvaluationEnded",
        "EvaluationRoundEnded",
    ]  # fmt: skip
    (forward,) = [e for e in recorder.of_type(ev.SpanTraced) if e.phase == "eval"]
    assert forward.error is None  # the forward ran; the metric function raised after it
    for event_type in (ev.EvalBatchEnded, ev.EvaluationEnded, ev.EvaluationRoundEnded):
        (ended,) = recorder.of_type(event_type)
        assert ended.error is info.value
    assert [e.dataset for e in recorder.of_type(ev.EvaluationStarted)] == ["val"]

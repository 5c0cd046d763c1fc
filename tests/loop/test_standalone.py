"""trainer.evaluate() and trainer.predict() outside fit(): events, results, stops, bad input."""

from __future__ import annotations

import math
from typing import Any

import anyio
import pytest
import torch
import torch.nn.functional as F

from trainbus import ConfigError, EventBus, Trainer
from trainbus import commands as cmd
from trainbus import events as ev
from trainbus.testing import EventRecorder, tiny_loader, tiny_model


def make_trainer(**overrides: Any) -> Trainer:
    model = overrides.pop("model", None) or tiny_model()
    kwargs: dict[str, Any] = dict(loss_fn=F.cross_entropy, max_epochs=1, device="cpu",
                                  on_signal=None, progress=False)  # fmt: skip
    kwargs.update(overrides)
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_loader(3), **kwargs)


class Failing(torch.nn.Module):
    """Raises in forward from the ``fail_at``-th call on."""

    def __init__(self, fail_at: int) -> None:
        super().__init__()
        self.inner, self.calls, self.fail_at = tiny_model(), 0, fail_at

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls > self.fail_at:
            raise ValueError("boom")
        out: torch.Tensor = self.inner(x)
        return out


# ====================================================================== evaluate
def test_evaluate_without_fit_scores_the_eval_data_and_restores_the_mode() -> None:
    trainer = make_trainer(eval_data=tiny_loader(2, seed=1), trace=True)
    recorder = EventRecorder(trainer.bus)
    trainer.settings.model.train()
    metrics = trainer.evaluate_sync()
    assert set(metrics) == {"val_loss"} and math.isfinite(metrics["val_loss"])
    assert trainer.settings.model.training
    assert recorder.names() == [
        "TrainerBuilt", "EvaluationRoundStarted", "EvaluationStarted",
        *["EvalBatchStarted", "SpanTraced", "EvalBatchEnded"] * 2,
        "EvaluationEnded", "EvaluationRoundEnded",
    ]  # fmt: skip
    (start,) = recorder.of_type(ev.EvaluationRoundStarted)
    assert (start.trigger, start.step, start.epoch) == ("standalone", 0, 0)


def test_evaluate_takes_data_and_named_sets() -> None:
    trainer = make_trainer()
    metrics = trainer.evaluate_sync({"a": tiny_loader(1, seed=1), "b": tiny_loader(1, seed=2)})
    assert set(metrics) == {"a/loss", "b/loss"}


def test_evaluate_without_any_data_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"^data=None"):
        make_trainer().evaluate_sync()
    with pytest.raises(ConfigError, match=r"^eval_data="):
        make_trainer().evaluate_sync({})


def test_after_a_run_evaluate_runs_on_the_same_trainer() -> None:
    trainer = make_trainer()
    trainer.fit_sync()
    metrics = trainer.evaluate_sync(tiny_loader(1))
    assert set(metrics) == {"val_loss"}


def test_evaluate_after_fit_on_the_same_bus_stamps_the_run_position() -> None:
    trainer = make_trainer(eval_data=tiny_loader(1, seed=1), max_epochs=2)
    recorder = EventRecorder(trainer.bus)

    async def main() -> dict[str, float]:
        async with trainer.bus:
            await trainer.fit()
            return await trainer.evaluate()

    metrics = anyio.run(main)
    last = recorder.of_type(ev.EvaluationRoundStarted)[-1]
    assert (last.trigger, last.step, last.epoch) == ("standalone", 6, 2)
    assert metrics == dict(recorder.of_type(ev.EvaluationRoundEnded)[-1].metrics)


def test_stop_training_ends_a_long_evaluation_between_batches() -> None:
    trainer = make_trainer()

    def stop_at_two(ctx: Any) -> None:  # on the worker thread, before batch ctx.batch_index
        if ctx.batch_index == 2:
            trainer.bus.send(cmd.StopTraining(reason="enough"))

    trainer.add_hook("eval_batch", stop_at_two)
    recorder = EventRecorder(trainer.bus)
    metrics = trainer.evaluate_sync({"a": tiny_loader(10, seed=1), "b": tiny_loader(3, seed=2)})
    # Batches 0..2 of "a" scored, then the stop: "b" never starts; the spans still close.
    assert [b.batch_index for b in recorder.of_type(ev.EvalBatchEnded)] == [0, 1, 2]
    assert set(metrics) == {"a/loss"}
    assert [e.dataset for e in recorder.of_type(ev.EvaluationEnded)] == ["a"]
    assert len(recorder.of_type(ev.EvaluationRoundEnded)) == 1
    (ack,) = recorder.of_type(ev.CommandApplied)
    assert ack.command == cmd.StopTraining(reason="enough") and ack.error is None


# ====================================================================== predict
def test_predict_publishes_each_batch_and_returns_them_concatenated() -> None:
    trainer = make_trainer(trace={"forward"})
    recorder = EventRecorder(trainer.bus)
    data = tiny_loader(3, seed=4)
    outputs = trainer.predict_sync(data, return_outputs=True)
    model = trainer.settings.model
    with torch.no_grad():
        expected = torch.cat([model(x) for x, _ in data])
    assert torch.allclose(outputs, expected)
    batches = recorder.of_type(ev.PredictionBatchEnded)
    assert [(b.batch_index, b.samples) for b in batches] == [(0, 32), (1, 32), (2, 32)]
    assert all(not b.outputs.requires_grad for b in batches)
    (started,) = recorder.of_type(ev.PredictionStarted)
    (ended,) = recorder.of_type(ev.PredictionEnded)
    assert (started.batches, ended.batches, ended.error, ended.stopped) == (3, 3, None, False)
    assert [(e.span, e.phase) for e in recorder.of_type(ev.SpanTraced)] == [
        ("forward", "predict")
    ] * 3


def test_predict_without_return_outputs_returns_none() -> None:
    assert make_trainer().predict_sync(tiny_loader(2)) is None


def test_predict_on_an_empty_loader_returns_empty_and_pairs_the_span() -> None:
    trainer = make_trainer()
    recorder = EventRecorder(trainer.bus)
    assert trainer.predict_sync([], return_outputs=True) == []
    assert recorder.names() == ["TrainerBuilt", "PredictionStarted", "PredictionEnded"]
    (ended,) = recorder.of_type(ev.PredictionEnded)
    assert (ended.batches, ended.error) == (0, None)


def test_a_failing_forward_raises_after_prediction_ended_carries_it() -> None:
    trainer = make_trainer(model=Failing(fail_at=1), trace=True)
    recorder = EventRecorder(trainer.bus)
    with pytest.raises(ValueError, match="boom") as info:
        trainer.predict_sync(tiny_loader(3))
    (ended,) = recorder.of_type(ev.PredictionEnded)
    assert ended.error is info.value and ended.batches == 1
    (failed,) = [e for e in recorder.of_type(ev.SpanTraced) if e.error is not None]
    assert failed.batch_index == 1 and failed.error is info.value
    assert recorder.names()[-1] == "PredictionEnded"


def test_stop_training_ends_prediction_between_batches() -> None:
    trainer = make_trainer()
    trainer.add_hook(
        "eval_batch",
        lambda ctx: trainer.bus.send(cmd.StopTraining()) if ctx.batch_index == 1 else None,
    )
    recorder = EventRecorder(trainer.bus)
    outputs = trainer.predict_sync(tiny_loader(6), return_outputs=True)
    assert outputs.shape == (64, 10)
    (ended,) = recorder.of_type(ev.PredictionEnded)
    assert (ended.batches, ended.stopped) == (2, True)


def test_other_commands_are_refused_outside_fit() -> None:
    trainer = make_trainer()
    trainer.add_hook(
        "eval_batch",
        lambda ctx: trainer.bus.send(cmd.SaveCheckpoint()) if ctx.batch_index == 0 else None,
    )
    recorder = EventRecorder(trainer.bus)
    trainer.predict_sync(tiny_loader(2))
    (ack,) = recorder.of_type(ev.CommandApplied)
    assert isinstance(ack.error, ConfigError) and "StopTraining" in str(ack.error)
    assert recorder.of_type(ev.PredictionEnded)[0].batches == 2


def test_a_slow_subscriber_holds_at_most_the_buses_buffers_of_outputs() -> None:
    """With a "block" subscription and a small ``max_queue``, prediction waits for the
    subscriber: the batches published but not yet handled stay bounded, never the data set."""
    bus = EventBus(max_queue=4)
    trainer = make_trainer(bus=bus)
    handled = 0
    backlog: list[int] = []

    async def slow(e: ev.PredictionBatchEnded) -> None:
        nonlocal handled
        await anyio.sleep(0.002)
        handled += 1

    bus.subscribe_async(bus.stream(ev.PredictionBatchEnded), slow, buffer=2, overflow="block")
    # Before each batch: how many earlier batches' outputs the bus still holds.
    trainer.add_hook("eval_batch", lambda ctx: backlog.append(ctx.batch_index - handled))
    trainer.predict_sync(tiny_loader(60, batch_size=4))
    assert handled == 60  # "block" drops nothing
    # At most max_queue (4) queued, one held by the blocked drain, the buffer (2) and the one
    # being handled (8), with slack for the counter's race: never the 60 of the data set.
    assert max(backlog) <= 10, max(backlog)


@pytest.mark.parametrize("data", [5, "abc", torch.zeros(3), {"a": [1]}])
def test_predict_rejects_what_is_not_an_iterable_of_batches(data: Any) -> None:
    with pytest.raises(ConfigError, match=r"^data="):
        make_trainer().predict_sync(data)


def test_predict_on_a_dataset_says_to_wrap_it_in_a_dataloader() -> None:
    dataset = torch.utils.data.TensorDataset(torch.zeros(8, 32), torch.zeros(8))
    with pytest.raises(ConfigError, match=r"^data='TensorDataset' is invalid: .*a Dataset gives "
                       r"single samples; wrap it, DataLoader\(dataset, batch_size=N"):  # fmt: skip
        make_trainer().predict_sync(dataset)


def test_predict_rejects_a_non_bool_return_outputs() -> None:
    with pytest.raises(ConfigError, match=r"^return_outputs="):
        make_trainer().predict_sync([], return_outputs=1)  # type: ignore[arg-type]

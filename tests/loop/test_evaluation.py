"""The end-of-training evaluation (``Trainer(eval_at_end=True)``) and the step that begins only
once its first batch is there (data without a length)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from reactivex import operators as ops

from trainbus import ConfigError, EvalSchedule, Trainer
from trainbus import commands as cmd
from trainbus import events as ev
from trainbus import operators as tbops
from trainbus.testing import EventRecorder, tiny_loader, tiny_model


class Stream:
    """Batches without ``__len__``, as an iterable data set yields them."""

    def __init__(self, batches: Sequence[Any]) -> None:
        self._batches = list(batches)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._batches)


def make(train: Any = None, **kwargs: Any) -> Trainer:
    model = tiny_model()
    kwargs.setdefault("eval_data", tiny_loader(2, seed=1))
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                   tiny_loader(8) if train is None else train, loss_fn=F.cross_entropy,
                   device="cpu", progress=False, on_signal=None, **kwargs)  # fmt: skip


def record(trainer: Trainer) -> tuple[EventRecorder, Any]:
    recorder = EventRecorder(trainer.bus)
    result = trainer.fit_sync()
    trainer.close()
    return recorder, result


def rounds(recorder: EventRecorder) -> list[tuple[str, int]]:
    return [(e.trigger, e.step) for e in recorder.of_type(ev.EvaluationRoundEnded)]


@pytest.mark.parametrize("value", [{"acc": 1.0}, None, "0.5"], ids=["dict", "none", "str"])
def test_a_metric_returning_no_number_is_told_what_to_return(value: Any) -> None:
    trainer = make(max_steps=1, metrics={"both": lambda outputs, targets: value})
    with pytest.raises(
        ConfigError,
        match=r"^metrics\['both'\] returned .*: return a number or a "
        r"one-element tensor",
    ):
        trainer.evaluate_sync()
    trainer.close()
    # Control: a number and a tensor of several values (averaged) are metrics.
    trainer = make(max_steps=1, metrics={"n": lambda o, t: 0.5, "t": lambda o, t: o[:, 0]})
    assert set(trainer.evaluate_sync()) == {"val_loss", "val_n", "val_t"}
    trainer.close()


def test_max_steps_mid_epoch_evaluates_the_final_weights_before_the_final_save(
    tmp_path: Path,
) -> None:
    recorder, result = record(make(max_steps=5, checkpoint_dir=tmp_path))
    assert result.reason == "completed"
    assert rounds(recorder) == [("end", 5)]
    names = recorder.names()
    start = names.index("EvaluationRoundStarted")
    assert names[start - 1] == "StepEnded"  # right after the last step, in its epoch
    assert names.index("EvaluationRoundEnded") < names.index("EpochEnded")
    (final,) = recorder.of_type(ev.CheckpointSaved)
    (end,) = recorder.of_type(ev.EvaluationRoundEnded)
    assert final.tag == "final" and final.step == 5
    assert dict(final.metrics) == dict(end.metrics) and "val_loss" in final.metrics
    assert recorder.of_type(ev.EvaluationRoundStarted)[0].trigger == "end"
    assert [e.trigger for e in recorder.of_type(ev.EvaluationEnded)] == ["end"]


def test_an_eval_every_that_does_not_divide_the_last_step() -> None:
    recorder, _ = record(
        make(max_epochs=1, eval_schedule=EvalSchedule(every_steps=3, epoch_end=False))
    )
    assert rounds(recorder) == [("steps", 3), ("steps", 6), ("end", 8)]


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        (
            dict(max_epochs=1, eval_schedule=EvalSchedule(every_steps=4, epoch_end=False)),
            [("steps", 4), ("steps", 8)],
        ),
        (dict(max_epochs=2), [("epoch", 8), ("epoch", 16)]),
        (dict(max_steps=8), [("epoch", 8)]),  # max_steps on the epoch's last batch
        (dict(max_steps=5, eval_schedule=EvalSchedule(every_steps=5)), [("steps", 5)]),
    ],
)
def test_a_last_step_already_evaluated_is_not_evaluated_again(
    kwargs: dict[str, Any], expected: list[tuple[str, int]]
) -> None:
    recorder, _ = record(make(**kwargs))
    assert rounds(recorder) == expected


def test_eval_at_end_false_turns_it_off() -> None:
    recorder, _ = record(make(max_steps=5, eval_schedule=EvalSchedule(at_end=False)))
    assert rounds(recorder) == []
    recorder, _ = record(
        make(
            max_epochs=1,
            eval_schedule=EvalSchedule(every_steps=3, epoch_end=False, at_end=False),
        )
    )
    assert rounds(recorder) == [("steps", 3), ("steps", 6)]


def test_no_evaluation_configured_means_none_at_the_end() -> None:
    # eval_data only for Evaluate commands: nothing evaluates during the run, nor at its end.
    recorder, _ = record(make(max_steps=5, eval_schedule=EvalSchedule(epoch_end=False)))
    assert rounds(recorder) == []
    recorder, _ = record(make(max_steps=5, eval_data=None))
    assert rounds(recorder) == []


def test_a_stopped_run_is_not_evaluated_again() -> None:
    trainer = make(max_steps=7)
    bus = trainer.bus
    bus.stream(ev.StepEnded).pipe(
        tbops.once(at=3), ops.map(lambda e: cmd.StopTraining(reason="enough"))
    ).subscribe(bus.commands)
    recorder, result = record(trainer)
    assert result.reason == "stopped" and result.steps == 3
    assert rounds(recorder) == []


def test_an_evaluate_command_at_the_last_step_is_answered_by_its_evaluation() -> None:
    """The last step's evaluation runs before its poll; an Evaluate decided on its StepEnded
    is answered with it, not run a second time (one evaluation per step)."""
    trainer = make(max_steps=5)
    bus = trainer.bus
    evaluate = ops.map(lambda e: cmd.Evaluate())
    bus.stream(ev.StepEnded).pipe(tbops.once(at=5), evaluate).subscribe(bus.commands)
    recorder, _ = record(trainer)
    assert rounds(recorder) == [("end", 5)]
    (ack,) = recorder.of_type(ev.CommandApplied)
    (ended,) = recorder.of_type(ev.EvaluationEnded)
    assert ack.step == 5 and ack.result is ended and ended.triggers == ("end",)


def test_the_end_evaluation_runs_the_eval_batch_hooks() -> None:
    seen: list[tuple[str, int]] = []
    trainer = make(max_steps=3)
    trainer.add_hook("eval_batch", lambda ctx: seen.append((ctx.phase, ctx.step)))
    record(trainer)
    assert seen == [("eval", 3), ("eval", 3)]


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_at_end_must_be_a_bool(value: Any) -> None:
    with pytest.raises(ConfigError, match=r"^EvalSchedule\.at_end=") as info:
        make(max_steps=5, eval_schedule=EvalSchedule(at_end=value))
    assert "True or False" in str(info.value)


# ---------------------------------------------------------------- data without a length
@pytest.mark.parametrize(("batches", "accumulate"), [(5, 1), (5, 2), (4, 2)])
def test_data_without_a_length_begins_only_steps_that_run(batches: int, accumulate: int) -> None:
    trainer = make(Stream(tiny_loader(batches)), max_epochs=2, accumulate=accumulate,
                   eval_data=None, trace={"data_wait"})  # fmt: skip
    begun: list[int] = []  # the step of each step's first micro-batch
    trainer.add_hook("batch", lambda ctx: begun.append(ctx.step) if not ctx.micro_batch else None)
    recorder, result = record(trainer)
    steps_per_epoch = -(-batches // accumulate)
    assert result.steps == 2 * steps_per_epoch
    assert begun == [e.step - 1 for e in recorder.of_type(ev.StepEnded)]
    # One probe per epoch finds the data exhausted, as Composer's extra BEFORE_DATALOADER.
    waits = [(e.epoch, e.batch_index) for e in recorder.of_type(ev.SpanTraced)]
    assert waits == [(epoch, b) for epoch in (0, 1) for b in range(batches + 1)]

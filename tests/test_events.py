"""The event vocabulary: frozen, slotted, keyword-only, complete, with paired spans."""

from __future__ import annotations

import dataclasses
import inspect
import time
import typing
from typing import assert_never

import pytest
import torch

from trainbus import commands as cmd
from trainbus import events as ev

ALL = pytest.mark.parametrize("cls", ev.EVENT_TYPES, ids=lambda c: c.__name__)


def test_event_types_are_every_event_class_of_the_module() -> None:
    defined = {
        obj
        for obj in vars(ev).values()
        if inspect.isclass(obj) and issubclass(obj, ev.BaseEvent) and obj is not ev.BaseEvent
    }
    assert set(ev.EVENT_TYPES) == defined
    assert len(ev.EVENT_TYPES) == len(set(ev.EVENT_TYPES))


def test_event_union_covers_event_types() -> None:
    assert set(typing.get_args(ev.Event)) == set(ev.EVENT_TYPES)


def test_vocabulary_coverage_does_not_shrink() -> None:
    names = {c.__name__ for c in ev.EVENT_TYPES}
    required = {
        "FitStarted", "FitEnded", "EpochStarted", "EpochEnded", "SpanTraced",
        "SchedulerStepped", "StepEnded",
        "EvaluationStarted", "EvalBatchEnded", "EvaluationEnded", "CheckpointSaved",
        "CheckpointLoaded", "MetricsLogged", "CommandApplied",
    }  # fmt: skip
    assert required <= names


@ALL
def test_frozen(cls: type[ev.BaseEvent], make_event) -> None:
    e = make_event(cls)
    with pytest.raises(dataclasses.FrozenInstanceError):
        e.step = 99  # type: ignore[misc]
    assert e.step == 1


@ALL
def test_slotted(cls: type[ev.BaseEvent], make_event) -> None:
    assert "__slots__" in vars(cls)
    e = make_event(cls)
    assert not hasattr(e, "__dict__")


@ALL
def test_keyword_only(cls: type[ev.BaseEvent], make_event) -> None:
    assert all(f.kw_only for f in dataclasses.fields(cls))
    e = make_event(cls)
    positional = [getattr(e, f.name) for f in dataclasses.fields(cls)]
    with pytest.raises(TypeError):
        cls(*positional)


@ALL
def test_common_fields(cls: type[ev.BaseEvent], make_event) -> None:
    names = [f.name for f in dataclasses.fields(cls)]
    assert names[:3] == ["step", "epoch", "time"]
    before = time.monotonic()
    e = make_event(cls, step=7, epoch=2)
    assert (e.step, e.epoch) == (7, 2)
    assert before <= e.time <= time.monotonic()
    assert issubclass(cls, ev.BaseEvent)


@ALL
def test_time_does_not_take_part_in_equality(cls: type[ev.BaseEvent], make_event) -> None:
    assert make_event(cls, time=1.0) == make_event(cls, time=2.0)
    assert make_event(cls, step=1) != make_event(cls, step=2)


def test_spans_pair_started_with_ended() -> None:
    assert len(ev.SPANS) >= 6
    for start, end in ev.SPANS.items():
        assert start in ev.EVENT_TYPES and end in ev.EVENT_TYPES
        assert start.__name__.endswith("Started")
        assert end.__name__ == start.__name__.removesuffix("Started") + "Ended"
        # The loop guarantees the pair even on failure: the end carries the error.
        assert "error" in {f.name for f in dataclasses.fields(end)}
    # Every XStarted in the vocabulary has its pair.
    starts = {c for c in ev.EVENT_TYPES if c.__name__.endswith("Started")}
    assert starts == set(ev.SPANS)


def test_spans_is_read_only() -> None:
    with pytest.raises(TypeError):
        ev.SPANS[ev.StepEnded] = ev.StepEnded  # type: ignore[index]


@pytest.mark.parametrize("cls", [ev.EvaluationEnded, ev.CheckpointSaved, ev.MetricsLogged])
def test_metrics_are_a_read_only_copy(cls: type[ev.BaseEvent], make_event) -> None:
    source = {"val_loss": 0.5}
    e = make_event(cls, metrics=source)
    with pytest.raises(TypeError):
        e.metrics["val_loss"] = 0.1  # type: ignore[attr-defined]
    source["val_loss"] = 9.0
    source["new"] = 1.0
    assert dict(e.metrics) == {"val_loss": 0.5}


def test_default_metrics_are_empty_and_read_only() -> None:
    for e in (ev.EvaluationEnded(step=0, epoch=0), ev.CheckpointSaved(step=0, epoch=0, path="x")):
        assert dict(e.metrics) == {}
        with pytest.raises(TypeError):
            e.metrics["x"] = 1.0  # type: ignore[index]


def test_as_float() -> None:
    assert ev.as_float(None) is None
    assert ev.as_float(2) == 2.0
    value = ev.as_float(torch.tensor(2.5))
    assert value == 2.5 and type(value) is float


def test_command_applied_carries_command_and_result(make_event) -> None:
    command = cmd.SaveCheckpoint(tag="best")
    saved = make_event(ev.CheckpointSaved, path="a.pt")
    ack = ev.CommandApplied(step=3, epoch=0, command=command, result=saved)
    assert ack.command is command and ack.result is saved and ack.error is None


def describe(e: ev.Event) -> str:
    """Exhaustive match: a class missing here falls through to ``assert_never``."""
    match e:
        case ev.FitStarted():
            return "fit"
        case ev.FitEnded():
            return "fit"
        case ev.EpochStarted():
            return "epoch"
        case ev.EpochEnded():
            return "epoch"
        case ev.SpanTraced():
            return "step"
        case ev.SchedulerStepped():
            return "step"
        case ev.StepEnded():
            return "step"
        case ev.EvaluationStarted():
            return "eval"
        case ev.EvalBatchEnded():
            return "eval"
        case ev.EvaluationEnded():
            return "eval"
        case ev.TrainerBuilt():
            return "fit"
        case ev.EvaluationRoundStarted() | ev.EvaluationRoundEnded() | ev.EvalBatchStarted():
            return "eval"
        case ev.PredictionStarted() | ev.PredictionBatchEnded() | ev.PredictionEnded():
            return "predict"
        case ev.CheckpointSaving() | ev.CheckpointLoading():
            return "checkpoint"
        case ev.CheckpointSaved():
            return "checkpoint"
        case ev.CheckpointLoaded():
            return "checkpoint"
        case ev.MetricsLogged():
            return "metrics"
        case ev.CommandApplied():
            return "control"
        case ev.WorkersRestarted():
            return "control"
        case ev.GradientNormMeasured():
            return "metrics"
        case ev.OptimizerStatsMeasured():
            return "metrics"
        case ev.MemoryMeasured():
            return "metrics"
        case ev.RuntimeEstimated():
            return "metrics"
        case ev.ExternalEvaluationEnded():
            return "eval"
        case _:
            assert_never(e)


@ALL
def test_exhaustive_match_covers_every_event(cls: type[ev.BaseEvent], make_event) -> None:
    kinds = {"fit", "epoch", "step", "eval", "predict", "checkpoint", "metrics", "control"}
    assert describe(make_event(cls)) in kinds  # type: ignore[arg-type]


def test_exhaustive_match_rejects_a_foreign_object() -> None:
    with pytest.raises(AssertionError):
        describe(object())  # type: ignore[arg-type]


def test_events_are_frozen_keyword_only_dataclasses() -> None:
    import dataclasses
    import time as _time

    before = _time.monotonic()
    e = ev.StepEnded(step=3, epoch=1, loss=0.5, lr=0.1, grad_norm=None, samples=32,
                     duration_s=0.01)  # fmt: skip
    assert (e.step, e.epoch, e.loss, e.samples, e.data_wait_s) == (3, 1, 0.5, 32, 0.0)
    assert before <= e.time <= _time.monotonic()  # default factory ran
    assert e == dataclasses.replace(e)
    with pytest.raises(dataclasses.FrozenInstanceError):
        e.step = 4  # type: ignore[misc]
    with pytest.raises(TypeError, match="positional"):
        ev.StepEnded(3, 1)  # type: ignore[misc]
    with pytest.raises(TypeError, match="missing"):
        ev.StepEnded(step=3)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="unexpected"):
        ev.EpochStarted(step=0, epoch=0, nope=1)  # type: ignore[call-arg]
    ended = ev.EvaluationEnded(step=1, epoch=0, metrics={"val_loss": 1.0})
    assert ended.trigger == "epoch" and ended.error is None
    with pytest.raises(TypeError):
        ended.metrics["val_loss"] = 2.0  # type: ignore[index]  # __post_init__ still runs


@pytest.mark.parametrize("name", sorted(ev.REMOVED))
def test_a_removed_phase_event_names_what_replaces_it(name: str) -> None:
    with pytest.raises(ImportError, match=r"was removed.*SpanTraced") as caught:
        getattr(ev, name)
    assert ev.REMOVED[name] in str(caught.value) and name not in dir(ev)
    with pytest.raises(ImportError, match=rf"events\.{name} was removed.*SpanTraced"):
        exec(f"from trainbus.events import {name}", {})


def test_an_unknown_name_is_a_plain_attribute_error() -> None:
    with pytest.raises(AttributeError, match="has no attribute 'Nope'"):
        ev.Nope  # type: ignore[attr-defined]  # noqa: B018


def test_a_traced_span_times_itself(make_event) -> None:
    e = ev.SpanTraced(step=0, epoch=0, span="forward", started=1.0, ended=1.25)
    assert (e.duration_s, e.phase, e.error) == (0.25, "train", None)
    assert set(ev.TRACED_SPANS) == set(typing.get_args(ev.TracedSpan))

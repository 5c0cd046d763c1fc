"""The wire format: every event and command type round-trips through a JSON line."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainbus import ConfigError
from trainbus import _wire as wire
from trainbus import commands as cmd
from trainbus import events as ev
from trainbus.events import RecordedError

finite = st.floats(allow_nan=False, allow_infinity=False, width=32)
names = st.text(min_size=1, max_size=8)
tags = st.text(alphabet="abcXYZ019-_.", min_size=1, max_size=8)

COMMANDS: dict[type[Any], st.SearchStrategy[Any]] = {
    cmd.StopTraining: st.builds(cmd.StopTraining, reason=names),
    cmd.StopEpoch: st.just(cmd.StopEpoch()),
    cmd.SaveCheckpoint: st.builds(cmd.SaveCheckpoint, tag=st.none() | tags),
    cmd.Evaluate: st.just(cmd.Evaluate()),
    cmd.SetLearningRate: st.builds(
        cmd.SetLearningRate,
        lr=st.floats(0, 10),
        param_group=st.none() | st.integers(0, 9),
        optimizer=st.none() | st.sampled_from(["g", "d"]),
    ),
    cmd.ScaleLearningRate: st.builds(
        cmd.ScaleLearningRate,
        factor=st.floats(min_value=1e-3, max_value=1e3),
        param_group=st.none() | st.integers(0, 9),
        optimizer=st.none() | st.sampled_from(["g", "d"]),
    ),
    cmd.LogMetric: st.builds(cmd.LogMetric, name=names, value=finite),
}
any_command = st.one_of(*COMMANDS.values())
scalar = finite | finite.map(lambda x: torch.tensor(x))
errors = st.none() | names.map(lambda m: RuntimeError(m))

BY_TYPE: dict[str, st.SearchStrategy[Any]] = {
    "int": st.integers(0, 10**9),
    "int | None": st.none() | st.integers(0, 10**9),
    "float": finite,
    "float | None": st.none() | finite,
    "str": names,
    "str | None": st.none() | names,
    "bool": st.booleans(),
    "Scalar": scalar,
    "Scalar | None": st.none() | scalar,
    "Mapping[str, float]": st.dictionaries(names, finite, max_size=3),
    "BaseException | None": errors,
    "Command": any_command,
    "BaseEvent | None": st.none()
    | st.builds(
        ev.CheckpointSaved,
        step=st.integers(0, 99),
        epoch=st.integers(0, 9),
        path=names,
        metrics=st.dictionaries(names, finite, max_size=2),
    ),
    "Phase": st.sampled_from(["train", "eval", "predict"]),
    "TracedSpan": st.sampled_from(ev.TRACED_SPANS),
    "EvalTrigger": st.sampled_from(["epoch", "steps", "command", "standalone"]),
    "tuple[EvalTrigger, ...]": st.lists(
        st.sampled_from(["steps", "command", "epoch", "end"]), min_size=1, max_size=3, unique=True
    ).map(tuple),
    "tuple[str, ...]": st.lists(names, max_size=3).map(tuple),
    "Any": scalar,  # PredictionBatchEnded.outputs: a tensor reads back as numbers
    "ResumeSource | None": st.sampled_from([None, "path", "checkpoint_dir", "ray"]),
    "Literal['completed', 'stopped', 'failed', 'cancelled']": st.sampled_from(
        ["completed", "stopped", "failed", "cancelled"]
    ),
    "Literal['epoch', 'steps', 'command']": st.sampled_from(["epoch", "steps", "command"]),
    "Literal['psutil', 'statm', 'resource'] | None": st.sampled_from(
        [None, "psutil", "statm", "resource"]
    ),
}


def event_strategy(kind: type[ev.BaseEvent]) -> st.SearchStrategy[ev.BaseEvent]:
    fields = {f.name: BY_TYPE[str(f.type)] for f in dataclasses.fields(kind)}
    return st.fixed_dictionaries(fields).map(lambda kw: kind(**kw))


def plain(value: Any) -> Any:
    """What a value is expected to read back as: tensors as floats, errors as their repr."""
    if isinstance(value, torch.Tensor):
        return float(value)
    if isinstance(value, RecordedError):
        return str(value)
    if isinstance(value, BaseException):
        return repr(value)
    if isinstance(value, ev.BaseEvent) or isinstance(value, cmd.COMMAND_TYPES):
        out = {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return {"type": type(value).__name__, **out}
    if isinstance(value, dict) or hasattr(value, "items"):
        return {k: plain(v) for k, v in value.items()}
    return value


@pytest.mark.parametrize("kind", ev.EVENT_TYPES, ids=lambda t: t.__name__)
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_every_event_round_trips(kind: type[ev.BaseEvent], data: st.DataObject) -> None:
    event = data.draw(event_strategy(kind))
    back = wire.loads(wire.dumps(event))
    assert type(back) is kind
    assert plain(back) == plain(event)
    assert back.time == event.time  # compare=False in __eq__: checked on its own
    if getattr(event, "error", None) is not None:
        assert isinstance(back.error, RecordedError)  # type: ignore[attr-defined]


@pytest.mark.parametrize("kind", cmd.COMMAND_TYPES, ids=lambda t: t.__name__)
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_every_command_round_trips_equal(kind: type[Any], data: st.DataObject) -> None:
    command = data.draw(COMMANDS[kind])
    line = wire.dumps(command)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert wire.loads(line) == command


def test_records_are_versioned_json_never_pickles() -> None:
    event = ev.StepEnded(step=1, epoch=0, loss=torch.tensor(0.5), lr=0.1,
                         grad_norm=torch.tensor([3.0, 4.0]), samples=8,
                         duration_s=0.01)  # fmt: skip
    rec = json.loads(wire.dumps(event))
    assert rec["v"] == wire.FORMAT_VERSION and rec["type"] == "StepEnded"
    assert rec["loss"] == 0.5 and rec["grad_norm"] == [3.0, 4.0]
    nan = wire.loads(wire.dumps(ev.MetricsLogged(step=1, epoch=0, metrics={"loss": math.nan})))
    assert isinstance(nan, ev.MetricsLogged) and math.isnan(nan.metrics["loss"])


@pytest.mark.parametrize(
    ("line", "field"),
    [
        (b'{"v": 2, "type": "StopTraining"}', "v"),
        (b'{"v": 1, "type": "os.system"}', "type"),
        (b'{"v": 1, "type": "SetLearningRate", "lr": -1}', "lr"),
        (b'{"v": 1, "type": "StepEnded", "step": 1}', "StepEnded"),
        (b"[1, 2]", "record"),
        (b"not json", "line"),
    ],
)
def test_bad_records_are_refused_naming_the_field(line: bytes, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        wire.loads(line)


def test_unknown_fields_are_ignored() -> None:
    assert wire.decode({"v": 1, "type": "StopTraining", "reason": "x", "new": 1}) == (
        cmd.StopTraining(reason="x")
    )

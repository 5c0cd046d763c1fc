"""The command vocabulary: frozen dataclasses validated when built."""

from __future__ import annotations

import dataclasses
import inspect
import math
import typing

import pytest

from trainbus import ConfigError, TrainbusError
from trainbus import commands as cmd


def test_command_types_are_the_union() -> None:
    assert set(typing.get_args(cmd.Command)) == set(cmd.COMMAND_TYPES)
    defined = {
        obj
        for obj in vars(cmd).values()
        if inspect.isclass(obj) and dataclasses.is_dataclass(obj) and obj.__module__ == cmd.__name__
    }
    assert defined == set(cmd.COMMAND_TYPES)
    names = {c.__name__ for c in cmd.COMMAND_TYPES}
    assert {
        "StopTraining", "StopEpoch", "SaveCheckpoint", "Evaluate", "SetLearningRate",
        "ScaleLearningRate",
    } <= names  # fmt: skip


VALID = [
    cmd.StopTraining(),
    cmd.StopTraining(reason="diverged"),
    cmd.StopEpoch(),
    cmd.SaveCheckpoint(),
    cmd.SaveCheckpoint(tag="best-1.0_x"),
    cmd.Evaluate(),
    cmd.SetLearningRate(lr=0.0),
    cmd.SetLearningRate(lr=3, param_group=0),
    cmd.ScaleLearningRate(factor=0.5),
    cmd.ScaleLearningRate(factor=2.0, param_group=1),
]


@pytest.mark.parametrize("command", VALID, ids=repr)
def test_valid_commands_are_frozen_slotted_keyword_only(command: cmd.Command) -> None:
    cls = type(command)
    assert cls in cmd.COMMAND_TYPES
    assert "__slots__" in vars(cls) and not hasattr(command, "__dict__")
    assert all(f.kw_only for f in dataclasses.fields(cls))
    fields = dataclasses.fields(cls)
    if fields:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(command, fields[0].name, None)
        with pytest.raises(TypeError):
            cls(*[getattr(command, f.name) for f in fields])


def test_defaults() -> None:
    assert cmd.StopTraining().reason == "requested"
    assert cmd.SaveCheckpoint().tag is None
    assert cmd.SetLearningRate(lr=0.1).param_group is None


def check_config_error(exc: pytest.ExceptionInfo[ConfigError], field: str, value: object) -> None:
    assert isinstance(exc.value, ValueError) and isinstance(exc.value, TrainbusError)
    message = str(exc.value)
    assert message.startswith(f"{field}="), message
    assert repr(value) in message


@pytest.mark.parametrize("lr", [-0.1, math.nan, math.inf, -math.inf, "0.1", None])
def test_set_learning_rate_rejects_bad_lr(lr: object) -> None:
    with pytest.raises(ConfigError) as exc:
        cmd.SetLearningRate(lr=lr)  # type: ignore[arg-type]
    check_config_error(exc, "lr", lr)


@pytest.mark.parametrize("factor", [0, 0.0, -1.0, math.nan, math.inf, "2"])
def test_scale_learning_rate_rejects_bad_factor(factor: object) -> None:
    with pytest.raises(ConfigError) as exc:
        cmd.ScaleLearningRate(factor=factor)  # type: ignore[arg-type]
    check_config_error(exc, "factor", factor)


@pytest.mark.parametrize("tag", ["", "a/b", "a b", "../x", 3, "é/"])
def test_save_checkpoint_rejects_bad_tag(tag: object) -> None:
    with pytest.raises(ConfigError) as exc:
        cmd.SaveCheckpoint(tag=tag)  # type: ignore[arg-type]
    check_config_error(exc, "tag", tag)


@pytest.mark.parametrize("group", [-1, 1.5, "0"])
@pytest.mark.parametrize("make", [
    lambda g: cmd.SetLearningRate(lr=0.1, param_group=g),
    lambda g: cmd.ScaleLearningRate(factor=0.5, param_group=g),
], ids=["SetLearningRate", "ScaleLearningRate"])  # fmt: skip
def test_param_group_must_be_an_index(
    make: typing.Callable[[object], object], group: object
) -> None:
    with pytest.raises(ConfigError) as exc:
        make(group)
    check_config_error(exc, "param_group", group)


def test_commands_compare_by_value() -> None:
    assert cmd.StopTraining(reason="x") == cmd.StopTraining(reason="x")
    assert cmd.StopTraining(reason="x") != cmd.StopTraining(reason="y")
    assert cmd.StopEpoch() != cmd.Evaluate()


@pytest.mark.parametrize("cls", cmd.COMMAND_TYPES, ids=lambda c: c.__name__)
def test_a_positional_argument_names_the_keywords(cls: type) -> None:
    with pytest.raises(TypeError, match=rf"^{cls.__name__} takes keyword arguments only: "):
        cls("x")


def test_the_positional_error_shows_the_call_to_write() -> None:
    with pytest.raises(TypeError) as exc:
        cmd.StopTraining("x")  # type: ignore[call-arg]
    assert str(exc.value) == "StopTraining takes keyword arguments only: StopTraining(reason=...)"

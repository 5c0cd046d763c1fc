"""Fuzzing the configuration: every bad value is a ConfigError naming its field, every good
combination trains, and nothing hangs, leaks a deep torch traceback or silently succeeds.

Trainer: each argument is drawn either from values it must accept or from values it must refuse
(wrong types, bools for numbers, NaN/inf, empty, out of range, strings where a loader goes...).
The oracle: with any refused value, the constructor (or, for a checkpoint to resume, ``fit()``)
raises ``ConfigError`` naming one of the refused fields; with none, a short run completes.

Built-in callbacks: every constructor parameter drawn from a pool of junk and plausible values;
construction succeeds or raises ``ConfigError`` naming a parameter; a constructed callback runs
a short training run ending in a result or a ``TrainbusError``, never another exception.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from trainbus import Callback, ConfigError, EventBus, Perplexity, TrainbusError, Trainer
from trainbus import callbacks as cbs
from trainbus import events as ev
from trainbus.testing import tiny_loader, tiny_model

pytestmark = pytest.mark.timeout(300)

FUZZ = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

_TMP = Path(tempfile.mkdtemp(prefix="trainbus-fuzz-"))
_FILE = _TMP / "a_file"
_FILE.write_text("not a folder")
_GARBAGE = _TMP / "garbage.pt"
_GARBAGE.write_bytes(b"not a checkpoint at all")


class _Marker:
    """Placeholders resolved per example (they need the example's model or folder)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<{self.name}>"


CKPT = _Marker("fresh checkpoint folder")
SCHED = _Marker("StepLR on the optimizer")
OTHER_OPT = _Marker("an optimizer over other parameters")


def _acc(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return (outputs.argmax(-1) == targets).float().mean()


NAN, INF = math.nan, math.inf
JUNK = [None, True, False, 0, -1, 2.5, NAN, INF, "", "x", [], {}, (), object(), torch.zeros(2)]

# field -> (values it must accept, values it must refuse)
FIELDS: dict[str, tuple[list[Any], list[Any]]] = {
    "max_steps": ([1, 3], [0, -1, 2.5, True, "3", NAN, [], torch.tensor(2)]),
    "max_epochs": ([None, 1], [0, -2, 1.0, "1", False, INF]),
    "accumulate": ([1, 2], [0, -1, 1.5, True, "2", None]),
    "accumulate_by": (["batches", "items"], ["tokens", None, 3, "", str]),
    "clip_grad_norm": ([None, 0.5, 1, 1e3], [0, -1, NAN, INF, "1", True, [1.0]]),
    "precision": (["32", "bf16"], ["fp16", "16", 32, None, "", ["32"]]),
    "device": (["cpu", torch.device("cpu")], ["gpu", None, 5, "", "cpu:x", ["cpu"]]),
    "seed": ([None, 0, 7], [-1, 1.5, True, "1", NAN]),
    "scheduler_interval": (["step", "epoch"], ["batch", None, 1, "", ["step"]]),
    "log_every": ([1, 3], [0, -4, True, 1.0, None, "1"]),
    "eval_data": ([None], [5, [], "abc", b"xy", torch.zeros(4), {}]),
    "eval_at_epoch_end": ([True, False], [1, None, "yes", 0.0]),
    "metrics": ([None, {}, {"acc": _acc}], [{"1x": _acc}, {"acc": 5}, [("acc", _acc)], "acc", 5]),
    "set_metrics": ([None, {}, {"ppl": Perplexity()}], [{"1x": Perplexity()}, {"ppl": _acc},
                                                         [Perplexity()], "ppl", 5]),
    "checkpoint_dir": ([None, CKPT], ["", 5, _FILE, _FILE / "sub", ["runs"], True]),
    "barriers": ([(), [ev.EpochEnded], (ev.EvaluationEnded, ev.EpochEnded)],
                 ["EpochEnded", [ev.FitStarted], 5, [5], None, [Callback]]),
    "barrier_timeout": ([0.5, 60], [0, -1, NAN, True, "1", None]),
    "on_nonfinite": (["raise", "stop", "skip", "ignore"], ["warn", None, 1, ["raise"], ""]),
    "handle_signals": ([False], [0, "no", None, 1]),
    # A single callback (class or instance) is accepted as a one-item list.
    "callbacks": ([(), [cbs.Checkpointing], [cbs.LearningRateMonitor], cbs.LearningRateMonitor],
                  [5, [5], [int], "x", [None]]),
    "bus": ([None, "new"], [5, "bus", object()]),
    "loss_fn": ([F.cross_entropy], [5, "cross_entropy", torch.zeros(1)]),
    "scheduler": ([None, SCHED], [5, "StepLR", object()]),
    "model": (["tiny"], ["m", torch.nn.ReLU(), None, 5]),
    "optimizer": (["sgd"], ["sgd-name", OTHER_OPT, None, 3]),
    "train_data": (["loader"], [5, [], "abcd", torch.zeros(3, 4), None, {}]),
}  # fmt: skip


@st.composite
def configurations(draw: st.DrawFn) -> tuple[dict[str, Any], set[str]]:
    """A Trainer configuration and the fields given a value they must refuse."""
    config: dict[str, Any] = {}
    bad: set[str] = set()
    # Mostly zero or one refused field, so both the runs and each field's check get examples.
    n_bad = draw(st.sampled_from([0, 0, 1, 1, 1, 2]))
    chosen = set(draw(st.permutations(sorted(FIELDS)))[:n_bad])
    for field, (good, refused) in FIELDS.items():
        if field in chosen:
            config[field] = draw(st.sampled_from(refused))
            bad.add(field)
        elif field not in ("max_epochs", "max_steps") or draw(st.booleans()):
            config[field] = draw(st.sampled_from(good))
    if "max_steps" not in config and config.get("max_epochs") is None:
        config["max_steps"] = 2  # keep every run short: a limit is always set
    # Couplings between fields.
    if config.get("callbacks") == [cbs.Checkpointing] and "checkpoint_dir" not in bad:
        # Checkpointing without a folder is refused when the run starts (Callback.check; its
        # own test is in tests/trainer/test_checks.py), not at construction.
        config["checkpoint_dir"] = CKPT
    if config.get("eval_every") is not None or draw(st.booleans()):
        if "eval_data" not in bad and draw(st.booleans()):
            config["eval_data"] = "eval-loader"
    # Checkpointing needs a folder (refused when fit() starts, not at construction).
    if (
        config.get("callbacks") == [cbs.Checkpointing]
        and "checkpoint_dir" not in bad
        and config.get("checkpoint_dir") is None
    ):
        config["checkpoint_dir"] = CKPT
    every = draw(st.sampled_from([None, None, None, 1, 2, 0, True, "2"] if n_bad else [None, 1]))
    if every is not None:
        config["eval_every"] = every
        if every in (0, "2") or every is True or config.get("eval_data") is None:
            bad.add("eval_every")
    return config, bad


def _build(config: dict[str, Any], folder: Path) -> dict[str, Any]:
    kwargs = dict(config)
    model = tiny_model() if kwargs.pop("model", "tiny") == "tiny" else config["model"]
    params = list(model.parameters()) if isinstance(model, torch.nn.Module) else []
    opt_value = kwargs.pop("optimizer", "sgd")
    if opt_value == "sgd":
        optimizer: Any = torch.optim.SGD(params or tiny_model().parameters(), lr=0.1)
    elif opt_value is OTHER_OPT:
        optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    else:
        optimizer = opt_value
    data = kwargs.pop("train_data", "loader")
    train_data = tiny_loader(3, 8) if data == "loader" else data
    if kwargs.get("eval_data") == "eval-loader":
        kwargs["eval_data"] = tiny_loader(2, 8)
    if kwargs.get("checkpoint_dir") is CKPT:
        kwargs["checkpoint_dir"] = folder / "ckpt"
    if kwargs.get("scheduler") is SCHED:
        kwargs["scheduler"] = (
            torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
            if isinstance(optimizer, torch.optim.Optimizer)
            else object()
        )
    if kwargs.get("bus") == "new":
        kwargs["bus"] = EventBus()
    kwargs.setdefault("handle_signals", False)
    kwargs.setdefault("loss_fn", F.cross_entropy)
    return {"model": model, "optimizer": optimizer, "train_data": train_data, **kwargs}


def _named(message: str, fields: set[str]) -> bool:
    # train_data / model problems may surface through the optimizer check (a model without
    # parameters): the message names the field the check is about.
    aliases = {"model": {"model", "optimizer"}, "optimizer": {"optimizer", "model"}}
    return any(
        f"{name}=" in message or f"{name}[" in message
        for field in fields
        for name in aliases.get(field, {field})
    )


@FUZZ
@given(configurations())
def test_trainer_configuration_fuzz(case: tuple[dict[str, Any], set[str]]) -> None:
    config, bad = case
    with tempfile.TemporaryDirectory(dir=_TMP) as tmp:
        kwargs = _build(config, Path(tmp))
        model, optimizer, data = (
            kwargs.pop("model"),
            kwargs.pop("optimizer"),
            kwargs.pop("train_data"),
        )
        event("ran" if not bad else "refused")
        if not bad:
            result = Trainer(model, optimizer, data, **kwargs).fit_sync()
            assert result.reason == "completed", (config, result)
            return
        try:
            trainer = Trainer(model, optimizer, data, **kwargs)
        except ConfigError as exc:
            assert _named(str(exc), bad), (str(exc), bad)
            return
        pytest.fail(f"accepted {sorted(bad)} in {config!r}; built {trainer!r}")


# ---------------------------------------------------------------------------- callbacks

CALLBACKS: list[type[Callback]] = [
    cbs.Checkpointing,
    cbs.EarlyStopping,
    cbs.ReduceLROnPlateau,
    cbs.LearningRateMonitor,
    cbs.Progress,
    cbs.MetricsLogger,
    cbs.JsonlEventLog,
    cbs.ThroughputMonitor,
    cbs.GradientNormMonitor,
    cbs.OptimizerMonitor,
    cbs.MemoryMonitor,
    cbs.RuntimeEstimator,
    cbs.ThresholdStopping,
    cbs.TimeLimit,
    cbs.CurvePlot,
]
assert all(issubclass(c, Callback) for c in CALLBACKS)

PLAUSIBLE = [1, 2, 0.5, "val_loss", "loss", "min", "max", 10, 0.001, "steps", "epoch"]
VALUES = st.sampled_from(JUNK + PLAUSIBLE + [[1], {"a": 1}, -0.5, 10**9, "-"])


@st.composite
def callback_cases(draw: st.DrawFn) -> tuple[type[Callback], dict[str, Any]]:
    cls = draw(st.sampled_from(CALLBACKS))
    params = [
        p
        for p in inspect.signature(cls.__init__).parameters.values()
        if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    kwargs: dict[str, Any] = {}
    for p in params:
        required = p.default is inspect.Parameter.empty
        if required or draw(st.sampled_from([False, False, True])):
            kwargs[p.name] = draw(VALUES)
    return cls, kwargs


def _paths_for(cls: type[Callback], kwargs: dict[str, Any], folder: Path) -> dict[str, Any]:
    # A plausible path for path-like parameters, so the fuzz reaches past "not a path".
    out = dict(kwargs)
    for name, value in kwargs.items():
        if name in ("path", "folder", "directory", "log_dir", "out", "output") and value == "x":
            out[name] = folder / "out"
    return out


@FUZZ
@given(callback_cases())
def test_callback_options_fuzz(case: tuple[type[Callback], dict[str, Any]]) -> None:
    cls, kwargs = case
    # In a scratch folder: a fuzzed string such as "val_loss" is a valid file path for a logger.
    with tempfile.TemporaryDirectory(dir=_TMP) as tmp, contextlib.chdir(tmp):
        folder = Path(tmp)
        kwargs = _paths_for(cls, kwargs, folder)
        names = set(inspect.signature(cls.__init__).parameters)
        try:
            callback = cls(**kwargs)
        except ConfigError as exc:
            event("refused")
            assert _named(str(exc), names | {"mode", "monitor", "metric"}), (str(exc), kwargs)
            return
        except TypeError as exc:  # only a missing/unknown argument, never a type error inside
            pytest.fail(f"{cls.__name__}(**{kwargs!r}) raised TypeError: {exc}")
        model = tiny_model()
        trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_loader(3, 8),
                          loss_fn=F.cross_entropy, eval_data=tiny_loader(2, 8), max_steps=4,
                          eval_every=2, checkpoint_dir=folder / "ckpt", handle_signals=False,
                          callbacks=[callback])  # fmt: skip
        event(f"ran {cls.__name__}")
        try:
            result = trainer.fit_sync()
        except TrainbusError:
            return
        assert result.reason in ("completed", "stopped"), result

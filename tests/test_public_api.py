"""The public surface, pinned: which modules are public, and what each one exports.

A change here is a decision about the API (httpx's ``test_exported_members`` idea): a name added
to or dropped from a public module, or a module that becomes importable without an underscore,
fails until this file says so. Names of the earlier layout give an ``ImportError`` naming where
they live now.
"""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path
from types import ModuleType

import pytest
import torch

import trainbus

SRC = Path(trainbus.__file__).parent

EXPORTS: dict[str, set[str]] = {
    "trainbus": {
        "Accumulate",
        "AttachError",
        "Attachment",
        "Callback",
        "CheckpointDir",
        "CheckpointError",
        "ConfigError",
        "DistributedError",
        "EvalSchedule",
        "EventBus",
        "FitResult",
        "HookHandle",
        "LaunchError",
        "LaunchResult",
        "Launcher",
        "LostWorkError",
        "MissingExtraError",
        "NonFiniteLossError",
        "PerEpoch",
        "Perplexity",
        "SetMetric",
        "StepContext",
        "TokenAccuracy",
        "TrainContext",
        "TrainbusError",
        "Trainer",
        "TrainingError",
        "attach",
        "default_train_step",
        "launch",
        "replay",
        "seed_everything",
    },
    "trainbus.bus": {
        "AnyioScheduler",
        "AsyncSubscription",
        "BusClosedError",
        "BusObservable",
        "BusStatistics",
        "CommandError",
        "EventBus",
        "LostWork",
        "Subscription",
        "SubscriptionStatistics",
    },
    "trainbus.commands": {
        "COMMAND_TYPES",
        "Command",
        "Evaluate",
        "LogMetric",
        "SaveCheckpoint",
        "ScaleLearningRate",
        "SetLearningRate",
        "StopEpoch",
        "StopTraining",
    },
    "trainbus.operators": {
        "DecisionOperator",
        "Span",
        "Tracker",
        "every",
        "metric",
        "of_type",
        "once",
        "patience",
        "plateau",
        "span_durations",
        "threshold",
    },
    "trainbus.callbacks": {
        "Callback",
        "Checkpointing",
        "CurvePlot",
        "EMA",
        "EarlyStopping",
        "EvaluateCheckpoints",
        "EvaluationJobError",
        "GlobalCallbackHandle",
        "GradientNormMonitor",
        "JsonlEventLog",
        "LearningRateMonitor",
        "MLflowLogger",
        "MemoryMonitor",
        "MetricsLogger",
        "OptimizerMonitor",
        "Progress",
        "ReduceLROnPlateau",
        "RunPlan",
        "RuntimeEstimator",
        "SubscribeOptions",
        "TensorBoardLogger",
        "ThresholdStopping",
        "Throughput",
        "ThroughputMonitor",
        "TimeLimit",
        "WandbLogger",
        "global_callbacks",
        "register_global_callback",
    },
    "trainbus.checkpoint": {
        "Checkpoint",
        "CheckpointStore",
        "CheckpointWriteError",
        "EpochSampler",
        "FORMAT_VERSION",
        "LatestScan",
        "TrainState",
        "capture_data_order",
        "capture_rng",
        "check_checkpoint_dir",
        "export_full",
        "latest_checkpoint",
        "load_checkpoint",
        "load_sharded",
        "read_checkpoint",
        "read_folder",
        "replay_epoch",
        "restore_rng",
        "save_checkpoint",
        "save_sharded",
        "set_sampler_epoch",
    },
    "trainbus.testing": {
        "EventRecorder",
        "NaNLossAt",
        "VirtualTimeScheduler",
        "tiny_loader",
        "tiny_model",
    },
    "trainbus.ray": {"RayLaunchResult", "RayLauncher", "ReportToRay", "launch"},
    "trainbus.integrations": set(),
    "trainbus.integrations.optuna": {"OptunaPruning", "PrunerError"},
}
# trainbus.events exports every event type and the words their fields use; its list is the
# event vocabulary, pinned by its own tests (tests/test_events.py) and docs/events.md.
PUBLIC = {*EXPORTS, "trainbus.events"}


def public_modules_on_disk() -> set[str]:
    """Every module importable by a name without an underscored part."""
    found = set()
    for path in SRC.rglob("*.py"):
        parts = ["trainbus", *path.relative_to(SRC).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        if parts[-1] == "__main__" or any(p.startswith("_") for p in parts):
            continue
        found.add(".".join(parts))
    return found


def test_the_public_modules_are_the_few_a_user_imports() -> None:
    assert public_modules_on_disk() == PUBLIC


@pytest.mark.parametrize("name", sorted(EXPORTS))
def test_exported_members(name: str) -> None:
    module = importlib.import_module(name)
    assert set(module.__all__) == EXPORTS[name]
    assert len(module.__all__) == len(set(module.__all__)), f"duplicates in {name}.__all__"


def check_all(module: ModuleType) -> None:
    for name in module.__all__:
        assert hasattr(module, name), f"{module.__name__}.__all__ names missing {name!r}"


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_every_exported_name_exists_and_every_public_definition_is_exported(name: str) -> None:
    module = importlib.import_module(name)
    check_all(module)
    for attr, obj in vars(module).items():
        if attr.startswith("_") or not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue
        if obj.__module__ == name:
            assert attr in module.__all__, f"{name}.{attr} is public but not in __all__"


def test_the_package_only_re_exports() -> None:
    for name in trainbus.__all__:
        obj = getattr(trainbus, name)
        assert inspect.isclass(obj) or callable(obj), name
        module = obj.__module__
        assert module.startswith("trainbus.") and module != "trainbus", (name, module)


def test_every_exception_is_importable_from_a_public_module() -> None:
    from trainbus import _exceptions

    exported = {
        id(getattr(importlib.import_module(m), n))
        for m in PUBLIC
        for n in importlib.import_module(m).__all__
    }
    for name in _exceptions.__all__:
        assert id(getattr(_exceptions, name)) in exported, name


def test_star_import_gives_exactly_all() -> None:
    namespace: dict[str, object] = {}
    exec("from trainbus import *", namespace)
    assert set(namespace) - {"__builtins__"} == set(trainbus.__all__)


# What the docs of the earlier layout showed, and what the error must name.
MOVED_MODULES = [
    ("from trainbus.distributed.group import ProcessGroup", "trainbus._distributed"),
    ("from trainbus.hookpoints import StepContext", "import StepContext from trainbus"),
    ("import trainbus.loop.loop", "trainbus._loop"),
    ("from trainbus.loop.gradsync import no_sync", "trainbus._loop"),
    ("from trainbus.loop.settings import build_settings", "trainbus._loop"),
    ("from trainbus.trainer import Trainer", "import Trainer and FitResult from trainbus"),
    ("import trainbus.wire", "trainbus.replay() reads a JSONL event log"),
    (
        "from trainbus.callbacks.checkpoint import Checkpointing",
        "import its public names from trainbus.callbacks",
    ),
    (
        "from trainbus.checkpoint.store import CheckpointStore",
        "import its public names from trainbus.checkpoint",
    ),
    ("from trainbus.bus.subscriptions import Subscription", "from trainbus.bus"),
]


@pytest.mark.parametrize(("statement", "named"), MOVED_MODULES)
def test_an_import_of_a_moved_module_names_where_it_lives_now(statement: str, named: str) -> None:
    with pytest.raises(ImportError, match="is private now") as caught:
        exec(statement, {})
    assert named in str(caught.value)


def test_a_moved_module_error_names_only_modules_that_exist() -> None:
    from trainbus._moved import MOVED_MODULES

    for old in MOVED_MODULES:
        with pytest.raises(ImportError) as caught:
            importlib.import_module(old)
        message = str(caught.value)
        named = re.findall(r"\btrainbus(?:\.\w+)+", message.partition(";")[0])
        for module in named[1:]:  # the first is the old name itself
            importlib.import_module(module)
        assert "trainbus" in message.partition(";")[2], message  # what to import instead


@pytest.mark.parametrize(
    ("name", "home"),
    [
        ("Ending", "trainbus.events"),
        ("RecordedError", "trainbus.events"),
        ("AnyioScheduler", "trainbus.bus"),
    ],
)
def test_an_import_of_a_name_that_left_the_package_names_its_module(name: str, home: str) -> None:
    with pytest.raises(ImportError, match=f"from {home} import {name}"):
        exec(f"from trainbus import {name}", {})
    moved = importlib.import_module(home)
    assert getattr(moved, name).__name__ == name


def test_a_moved_name_is_no_attribute_and_says_where_it_went() -> None:
    assert not hasattr(trainbus, "AnyioScheduler")  # feature detection still answers
    assert getattr(trainbus, "AnyioScheduler", None) is None
    with pytest.raises(AttributeError, match=r"from trainbus\.bus import AnyioScheduler"):
        trainbus.AnyioScheduler  # noqa: B018
    with pytest.raises(ImportError, match=r"from trainbus\.bus import AnyioScheduler"):
        exec("import trainbus.AnyioScheduler", {})


def test_an_unknown_name_is_still_an_attribute_error() -> None:
    assert not hasattr(trainbus, "no_such_name")
    with pytest.raises(ImportError, match="cannot import name"):
        exec("from trainbus import no_such_name", {})


def test_a_renamed_operator_names_what_it_is_now() -> None:
    from trainbus import operators

    assert not hasattr(operators, "Scheduled")
    with pytest.raises(ImportError, match=r"trainbus\.operators\.DecisionOperator now"):
        exec("from trainbus.operators import Scheduled", {})


@pytest.mark.parametrize(
    ("old", "new"),
    [("metrics", "eval_metrics"), ("checkpoint", "last_checkpoint"), ("lost", "lost_work")],
)
def test_a_renamed_fit_result_attribute_names_what_it_is_now(old: str, new: str) -> None:
    from trainbus.testing import tiny_loader, tiny_model

    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    result = trainbus.Trainer(
        model,
        opt,
        tiny_loader(batches=4),
        loss_fn=torch.nn.functional.cross_entropy,
        max_steps=2,
        progress=False,
    ).fit_sync()
    assert getattr(result, new) is not None or new == "last_checkpoint"
    with pytest.raises(AttributeError, match=rf"FitResult\.{old} is FitResult\.{new} now"):
        getattr(result, old)
    assert not hasattr(result, "no_such_attribute")

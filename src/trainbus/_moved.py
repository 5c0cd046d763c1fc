"""Where the names of the earlier layout went (an ``ImportError`` naming the new place), and what
replaces Lightning's callback method names (:func:`lightning_method_hint`)."""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import re
import sys
import tomllib
from collections.abc import Sequence
from importlib import resources
from types import ModuleType

__all__ = [
    "lightning_method_hint",
    "moved_name",
    "renamed",
    "report_moved_modules",
]

# Names ``trainbus`` exported before, now in the topic module they belong to.
MOVED_NAMES = {
    "AnyioScheduler": "trainbus.bus",
    "AsyncSubscription": "trainbus.bus",
    "BusClosedError": "trainbus.bus",
    "BusObservable": "trainbus.bus",
    "BusStatistics": "trainbus.bus",
    "CommandError": "trainbus.bus",
    "LostWork": "trainbus.bus",
    "Subscription": "trainbus.bus",
    "SubscriptionStatistics": "trainbus.bus",
    "CheckpointWriteError": "trainbus.checkpoint",
    "EvaluationJobError": "trainbus.callbacks",
    "GlobalCallbackHandle": "trainbus.callbacks",
    "RunPlan": "trainbus.callbacks",
    "register_global_callback": "trainbus.callbacks",
    "Ending": "trainbus.events",
    "RecordedError": "trainbus.events",
}

# Old module (and every module under it) -> (the private package it is under now, what to do
# instead).
MOVED_MODULES: dict[str, tuple[str | None, str]] = {
    "trainbus.loop": (
        "trainbus._loop",
        "import Trainer, TrainContext, StepContext and SetMetric from trainbus",
    ),
    "trainbus.trainer": ("trainbus._trainer.trainer", "import Trainer and FitResult from trainbus"),
    "trainbus.attachment": (
        "trainbus._attachment",
        "import attach, Attachment and AttachError from trainbus",
    ),
    "trainbus.launcher": (
        "trainbus._launcher",
        "import launch, Launcher and LaunchResult from trainbus",
    ),
    "trainbus.replay": ("trainbus._replay", "import replay from trainbus"),
    "trainbus.seeding": ("trainbus._seeding", "import seed_everything from trainbus"),
    "trainbus.hookpoints": ("trainbus._hookpoints", "import StepContext from trainbus"),
    "trainbus.distributed": (
        "trainbus._distributed",
        "Trainer.fit() and trainbus.launch() set up the process group themselves",
    ),
    "trainbus.wire": ("trainbus._wire", "trainbus.replay() reads a JSONL event log"),
    "trainbus.cli": ("trainbus._cli", "run the `trainbus` command (python -m trainbus)"),
}
# The submodules of the public packages went private (and many were merged since): the error
# names the public package.
OLD_SUBMODULES = {
    "bus": (
        "async_subscription barrier channel clock doorbell failures host lifecycle observable "
        "port pressure queue rank_filter registry routes scheduler spent statistics "
        "subscriptions tasks watchdog"
    ),
    "callbacks": (
        "checkpoint early_stopping ema evaluate grad_norm logging lr memory mlflow "
        "optimizer_stats plot progress runtime stoppers tensorboard throughput wandb"
    ),
    "checkpoint": ("api data_order export keys reading rng sharded sharded_resume state store"),
    "operators": "decide select spans",
}
for _package, _names in OLD_SUBMODULES.items():
    for _name in _names.split():
        MOVED_MODULES[f"trainbus.{_package}.{_name}"] = (
            None,
            f"import its public names from trainbus.{_package}",
        )

# Names of the public packages that were renamed: ``from trainbus.operators import Scheduled``.
RENAMED = {"trainbus.operators.Scheduled": "trainbus.operators.DecisionOperator"}


def renamed(module: str, name: str) -> AttributeError:
    """The error for ``<module>.<name>`` (a package's ``__getattr__``): what it is called now."""
    new = RENAMED.get(f"{module}.{name}")
    if new is None:
        return AttributeError(f"module {module!r} has no attribute {name!r}")
    return AttributeError(f"{module}.{name} is {new} now")


def _moved(name: str, home: str) -> str:
    return f"trainbus.{name} moved to {home}: `from {home} import {name}`"


def moved_name(name: str) -> AttributeError:
    """The error for ``trainbus.<name>``: an ``AttributeError`` (so ``hasattr`` still answers)
    that says where a moved name lives."""
    home = MOVED_NAMES.get(name)
    if home is None:
        return AttributeError(f"module 'trainbus' has no attribute {name!r}")
    return AttributeError(_moved(name, home))


def _import_error(fullname: str) -> ImportError | None:
    package, _, name = fullname.rpartition(".")
    # ``from trainbus import X`` looks for a submodule once the attribute is missing: a plain
    # ImportError, which it does not replace with its own bare "no such submodule" message.
    if package == "trainbus" and name in MOVED_NAMES:
        return ImportError(_moved(name, MOVED_NAMES[name]), name=package)
    if fullname in RENAMED:
        return ImportError(f"{fullname} is {RENAMED[fullname]} now", name=package)
    for old, (new, public) in MOVED_MODULES.items():
        if fullname == old or fullname.startswith(old + "."):
            where = "" if new is None else f" (under {new})"
            return ModuleNotFoundError(f"{fullname} is private now{where}; {public}", name=fullname)
    return None


class _MovedModules(importlib.abc.MetaPathFinder):
    """Last on ``sys.meta_path``: asked only about a module no other finder found."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        error = _import_error(fullname)
        if error is not None:
            raise error
        return None


def report_moved_modules() -> None:
    """Install the finder once per interpreter (a reload of trainbus adds no second one)."""
    if not any(type(f).__name__ == "_MovedModules" for f in sys.meta_path):
        sys.meta_path.append(_MovedModules())


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


@functools.cache
def _lightning_methods() -> dict[str, str]:
    """Lightning's ``Callback`` methods and what a trainbus ``Callback`` defines instead, from
    the migration table (migration.toml, rendered as docs/migration.md)."""
    table = tomllib.loads(resources.files("trainbus").joinpath("migration.toml").read_text("utf-8"))
    methods = {}
    for row in table["entries"]:
        if row["framework"] != "lightning" or not row["name"].startswith("on_"):
            continue
        events = row.get("event", [])
        uses = [f"on_{_snake(e)}" for e in ([events] if isinstance(events, str) else events)]
        if "match" in row:
            uses[-1] += " where " + ", ".join(f"{k}={v!r}" for k, v in row["match"].items())
        use = " or ".join(uses + ([f"hook_{row['hook']}"] if "hook" in row else []))
        note = row.get("note", "").replace("`", "")
        methods[row["name"]] = f"{use} ({note})" if use and note else use or note
    return methods


def lightning_method_hint(name: str) -> str | None:
    """What a trainbus ``Callback`` defines instead of Lightning's method ``name``, or None."""
    use = _lightning_methods().get(name)
    if use is None:
        return None
    return f"that is Lightning's Callback.{name}; in trainbus: {use}"

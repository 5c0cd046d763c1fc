"""Where the names of the earlier layout went (an ``ImportError`` naming the new place), and what
replaces Lightning's callback method names (:func:`lightning_method_hint`)."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType

__all__ = [
    "LIGHTNING_METHODS",
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

# Old module (and every module under it) -> (its private place now, what to do instead).
MOVED_MODULES = {
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
# The submodules of the public packages went private; their names stay in the package.
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
# Old callbacks modules folded into the private module of their concept.
_FOLDED = {
    "early_stopping": "stoppers",
    "runtime": "progress",
    **dict.fromkeys(("tensorboard", "mlflow", "wandb"), "trackers"),
    **dict.fromkeys(("grad_norm", "memory", "optimizer_stats", "throughput"), "monitors"),
}
for _package, _names in OLD_SUBMODULES.items():
    for _name in _names.split():
        _home = _FOLDED.get(_name, _name) if _package == "callbacks" else _name
        MOVED_MODULES[f"trainbus.{_package}.{_name}"] = (
            f"trainbus._bus.{_name}" if _package == "bus" else f"trainbus.{_package}._{_home}",
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
            where = new + fullname[len(old) :]
            return ModuleNotFoundError(
                f"{fullname} is private now ({where}); {public}", name=fullname
            )
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


_EVAL_ROUND = "on_evaluation_round_{}ed (hook_{} to swap weights {})"
# fmt: off
LIGHTNING_METHODS: dict[str, str] = {
    "on_fit_start": "on_fit_started", "on_train_start": "on_fit_started",
    "on_fit_end": "on_fit_ended", "on_train_end": "on_fit_ended",
    "on_exception": "on_fit_ended (FitEnded.error)",
    "on_sanity_check_start": "no sanity check: trainer.evaluate_sync() before fit_sync()",
    "on_sanity_check_end": "no sanity check: trainer.evaluate_sync() before fit_sync()",
    "on_train_epoch_start": "on_epoch_started", "on_train_epoch_end": "on_epoch_ended",
    "on_train_batch_start": "hook_batch (inline, before the forward)",
    "on_train_batch_end": "on_step_ended (after each optimizer step)",
    "on_validation_start": _EVAL_ROUND.format("start", "before_evaluation", "in"),
    "on_test_start": _EVAL_ROUND.format("start", "before_evaluation", "in"),
    "on_validation_end": _EVAL_ROUND.format("end", "after_evaluation", "back"),
    "on_test_end": _EVAL_ROUND.format("end", "after_evaluation", "back"),
    "on_validation_epoch_start": "on_evaluation_started (one per evaluation set)",
    "on_test_epoch_start": "on_evaluation_started (one per evaluation set)",
    "on_validation_epoch_end": "on_evaluation_ended (its metrics)",
    "on_test_epoch_end": "on_evaluation_ended (its metrics)",
    "on_validation_batch_start": "on_eval_batch_started, or hook_eval_batch (inline)",
    "on_test_batch_start": "on_eval_batch_started, or hook_eval_batch (inline)",
    "on_validation_batch_end": "on_eval_batch_ended", "on_test_batch_end": "on_eval_batch_ended",
    "on_predict_start": "on_prediction_started", "on_predict_epoch_start": "on_prediction_started",
    "on_predict_end": "on_prediction_ended", "on_predict_epoch_end": "on_prediction_ended",
    "on_predict_batch_start": "hook_eval_batch (inline; ctx.phase == 'predict')",
    "on_predict_batch_end": "on_prediction_batch_ended",
    "on_save_checkpoint": "on_checkpoint_saving; a callback's own state: override state_dict()",
    "on_load_checkpoint": "on_checkpoint_loaded; a callback's own state: load_state_dict()",
    "on_before_backward": "hook_loss (inline: may scale or replace the loss)",
    "on_after_backward": "hook_after_backward (inline)",
    "on_before_optimizer_step": "hook_before_optimizer_step (inline)",
    "on_before_zero_grad": "on_span_traced (span 'zero_grad', with Trainer(trace=True)); "
    "inline: hook_after_optimizer_step",
}
# fmt: on
"""Lightning's ``Callback`` methods and the trainbus method (``on_<event>`` subscriber or
``hook_<point>``) a trainbus ``Callback`` defines instead (docs/migration.md's table)."""


def lightning_method_hint(name: str) -> str | None:
    """What a trainbus ``Callback`` defines instead of Lightning's method ``name``, or None."""
    use = LIGHTNING_METHODS.get(name)
    if use is None:
        return None
    return f"that is Lightning's Callback.{name}; in trainbus: {use}"

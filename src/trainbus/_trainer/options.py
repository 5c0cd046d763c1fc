"""The Trainer's options (declared in ``Trainer.__init__``'s signature): each one's check
(:data:`CHECKS`), the groups of related ones, and the loop's settings built from them."""

from __future__ import annotations

import inspect
import math
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, ParamSpec, TypeVar

import torch

from .. import events as ev
from .._bus import EventBus
from .._exceptions import ConfigError
from .._hookpoints import HOOK_POINTS
from .._loop import Settings
from .._loop.optimizers import DEFAULT_NAME, OptimizerSet, SchedulerSet
from .._loop.set_metrics import SetMetric
from .._loop.settings import Precision
from .._signals import check_on_signal
from .._tensors import bf16_supported, is_sharded_model, resolve_device
from .._validate import check_bool, check_int, explains_unknown_keywords, unknown_keyword_message
from ..callbacks._base import Callback
from ..checkpoint import check_checkpoint_dir
from .hf_options import fit_hint, option_hint

__all__ = [
    "CHECKS",
    "Accumulate",
    "CheckpointDir",
    "EvalSchedule",
    "PerEpoch",
    "build_settings",
    "check_hook",
    "check_options",
    "eval_sets",
    "explains_fit_keywords",
    "explains_unknown_options",
]

Check = Callable[[str, Any], Any]
"""``check(name, value) -> the value the run uses``; raises ConfigError."""


def int_at_least(minimum: int, *, optional: bool = False) -> Check:
    return lambda name, value: check_int(name, value, minimum, optional=optional)


def accepting(allowed: str, ok: Callable[[Any], bool], *, by_type: bool = False) -> Check:
    """The value itself when ``ok(value)``, else a ``ConfigError`` saying ``allowed``."""

    def check(name: str, value: Any) -> Any:
        if not ok(value):
            if by_type:
                raise ConfigError.wrong_kind(name, value, allowed)
            raise ConfigError.invalid(name, value, allowed)
        return value

    return check


def _none_or(kind: type) -> Callable[[Any], bool]:
    return lambda value: value is None or isinstance(value, kind)


progress = accepting("None (when stderr is a terminal), True or False", _none_or(bool))
bus = accepting("a trainbus.EventBus or None", _none_or(EventBus))
train_step = accepting(
    "a callable step(ctx) or None", lambda value: value is None or callable(value), by_type=True
)
on_nonfinite = accepting(
    "'raise', 'stop', 'skip' or 'ignore'",
    lambda value: value in ("raise", "stop", "skip", "ignore"),
)


def loss_fn(name: str, value: Any) -> Any:
    if value is not None and not callable(value):
        raise ConfigError.invalid(name, value, "a callable loss_fn(outputs, targets) or None")
    if isinstance(value, type) and issubclass(value, torch.nn.Module):
        raise ConfigError.invalid(
            name, value, f"an instance, such as {value.__name__}(), not the class"
        )
    return value


def clip_grad_norm(name: str, value: Any) -> float | None:
    if value is None:
        return None
    if not (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
    ):
        raise ConfigError.invalid(name, value, "a finite number > 0 or None")
    return float(value)


accumulate_by = accepting(
    "'batches', 'items' (labels != -100 per micro-batch) or fn(batch) -> int",
    lambda value: (
        value in ("batches", "items")
        if isinstance(value, str)
        else callable(value) and not isinstance(value, type)
    ),
)


def _refuses_arguments(fn: Callable[..., Any], count: int) -> str | None:
    """``fn``'s signature when it cannot take ``count`` positional arguments, else None."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    try:
        signature.bind(*[None] * count)
    except TypeError:
        return str(signature)
    return None


def check_hook(point: Any, fn: Any) -> None:
    """A hook point and a callable ``fn(ctx)`` for ``Trainer.add_hook``."""
    if point not in HOOK_POINTS:
        raise ConfigError.invalid(
            "point",
            point,
            "one of " + ", ".join(map(repr, HOOK_POINTS)) + " (a hook runs inline and may "
            "change the step); to observe a step or an epoch, subscribe to its event: "
            "trainer.bus.stream(events.StepEnded).subscribe(fn)",
        )
    taken = _refuses_arguments(fn, 1) if callable(fn) else None
    if taken is not None:
        raise ConfigError.invalid(
            "fn",
            fn,
            f"fn(ctx): a {point!r} hook is called with one argument, the "
            f"StepContext; this one takes {taken}",
        )


def _named(
    name: str, value: Any, allowed: str, ok: Callable[[Any], bool], called: str
) -> dict[str, Any]:
    """None or a mapping of identifiers to what ``ok`` accepts, whose ``called`` (``""``: the
    entry itself, or a method) takes ``(outputs, targets)``."""
    if value is not None and not isinstance(value, Mapping):
        raise ConfigError.invalid(name, value, f"a mapping of names to {allowed}")
    out = dict(value or {})
    for key, entry in out.items():
        if not isinstance(key, str) or not key.isidentifier() or not ok(entry):
            raise ConfigError.invalid(
                f"{name}[{key!r}]", entry, f"an identifier mapped to {allowed}"
            )
        taken = _refuses_arguments(getattr(entry, called) if called else entry, 2)
        if taken is not None:
            raise ConfigError.invalid(
                f"{name}[{key!r}]",
                entry,
                f"{allowed}, called with two arguments per evaluation batch; "
                f"{'its ' + called if called else 'this one'} takes {taken}",
            )
    return out


def metrics(name: str, value: Any) -> dict[str, Callable[[Any, Any], Any]]:
    return _named(name, value, "fn(outputs, targets)", callable, "")


def set_metrics(name: str, value: Any) -> dict[str, SetMetric]:
    return _named(
        name,
        value,
        "objects with update(outputs, targets) -> {name: sum} and compute(totals) -> float "
        "(trainbus.SetMetric; e.g. trainbus.Perplexity())",
        lambda metric: not isinstance(metric, type) and isinstance(metric, SetMetric),
        "update",
    )


def callbacks(name: str, value: Any) -> tuple[Callback | type[Callback], ...]:
    if isinstance(value, Callback | type):
        value = [value]
    if not isinstance(value, Iterable):
        raise ConfigError.invalid(name, value, "an iterable of Callbacks")
    out = tuple(value)
    for cb in out:
        if not (isinstance(cb, Callback) or (isinstance(cb, type) and issubclass(cb, Callback))):
            raise ConfigError.invalid(name, cb, "Callback subclasses or instances")
    return out


def checked_later(name: str, value: Any) -> Any:
    """The value as given: checked with the other arguments (``build_settings``, the Trainer)."""
    return value


def trace(name: str, value: Any) -> frozenset[str]:
    allowed = f"True, False or a set of {list(ev.TRACED_SPANS)}"
    if isinstance(value, bool):
        return frozenset(ev.TRACED_SPANS) if value else frozenset()
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise ConfigError.invalid(name, value, allowed)
    spans = frozenset(value)
    unknown = sorted(str(s) for s in spans if s not in ev.TRACED_SPANS)
    if unknown:
        raise ConfigError.invalid(name, value, f"{allowed} (not {unknown})")
    return spans


def refuse_dataset(name: str, value: Any) -> None:
    """A map-style Dataset yields samples, not batches: refused, saying how to batch it."""
    if isinstance(value, torch.utils.data.Dataset) and not isinstance(value, Iterable):
        raise ConfigError.invalid(
            name,
            type(value).__name__,
            "an iterable of batches: a Dataset gives single samples; wrap it, "
            "DataLoader(dataset, batch_size=N, shuffle=..., collate_fn=...)",
        )


def check_loader(name: str, value: Any) -> int | None:
    """A non-empty iterable of batches; its length when it has one."""
    refuse_dataset(name, value)
    if isinstance(value, torch.Tensor | str | bytes) or not isinstance(value, Iterable):
        raise ConfigError.wrong_kind(
            name, value, "an iterable of batches, such as a DataLoader or a list"
        )
    try:
        length = len(value)  # type: ignore[arg-type]
    except TypeError:
        return None
    if length == 0:
        raise ConfigError.invalid(
            name, f"<{type(value).__name__} of length 0>", "a non-empty loader"
        )
    return length


def _refuse_one_shot(name: str, value: Any, why: str, alternative: str = "") -> None:
    """Refuse ``value`` when it is a one-shot iterator (tested without an ``iter()``, which
    would start a ``DataLoader``'s workers)."""
    if isinstance(value, Iterator):
        raise ConfigError.invalid(
            name,
            f"<one-shot {type(value).__name__}>",
            f"data that can be iterated again ({why}, and a {type(value).__name__} is "
            "spent after its first pass): a list of batches, a DataLoader, or an "
            "IterableDataset whose __iter__ starts a new pass (wrapped in a DataLoader)"
            f"{alternative}",
        )


def check_passes(
    train_data: Any, sets: Iterable[tuple[str, Any]], named: bool, max_epochs: int | None
) -> None:
    """Refuse a one-shot iterator the run iterates twice."""
    if max_epochs is not None and max_epochs > 1:
        _refuse_one_shot(
            "train_data",
            train_data,
            f"max_epochs={max_epochs} makes a new pass per epoch",
            "; or keep it, leave max_epochs out and set a max_steps within its one pass",
        )
    for name, data in sets:
        field = f"eval_data[{name!r}]" if named else "eval_data"
        _refuse_one_shot(field, data, "each evaluation makes a new pass")


PRECISION_SPELLINGS: Mapping[str, Precision] = {
    "32": "32",
    "bf16": "bf16",
    "fp16": "fp16",
    # Lightning's spellings of the same three (a user's Trainer(precision=...) carried over).
    "32-true": "32",
    "bf16-mixed": "bf16",
    "16-mixed": "fp16",
}
_TRUE_DTYPES = {
    "16-true": "torch.float16",
    "bf16-true": "torch.bfloat16",
    "64-true": "torch.float64",
}


def precision(name: str, value: Any) -> str:
    """One of :data:`PRECISION_SPELLINGS`, as given; a ``"*-true"`` names the cast instead."""
    allowed = ", ".join(repr(k) for k in PRECISION_SPELLINGS)
    if isinstance(value, str) and value in PRECISION_SPELLINGS:
        return value
    if isinstance(value, str) and value in _TRUE_DTYPES:
        raise ConfigError.invalid(
            "precision",
            value,
            f"one of {allowed}; trainbus does not cast the model: for weights in another "
            f"dtype cast it yourself (model.to({_TRUE_DTYPES[value]})) and train with "
            "precision='32'",
        )
    if isinstance(value, int) and not isinstance(value, bool):
        raise ConfigError.invalid(
            "precision",
            value,
            f"one of {allowed} (strings: precision='{value}' if that is one of them)",
        )
    raise ConfigError.invalid("precision", value, f"one of {allowed}")


def eval_sets(eval_data: Any) -> tuple[tuple[tuple[str, Iterable[Any]], ...], bool]:
    """``((name, data), ...)`` of ``eval_data`` and whether the sets are named."""
    if eval_data is None:
        return (), False
    if isinstance(eval_data, Mapping):
        if not eval_data:
            raise ConfigError.invalid(
                "eval_data", "<empty mapping>", "a loader, or a mapping of set names to loaders"
            )
        sets: list[tuple[str, Iterable[Any]]] = []
        for name, data in eval_data.items():
            if not isinstance(name, str) or not name or "/" in name:
                raise ConfigError.invalid(
                    "eval_data",
                    name,
                    "set names that are non-empty strings without '/' "
                    "(metrics are keyed '<set>/<metric>')",
                )
            check_loader(f"eval_data[{name!r}]", data)
            sets.append((name, data))
        return tuple(sets), True
    check_loader("eval_data", eval_data)
    return (("val", eval_data),), False


def skip_final(name: str, value: Any) -> frozenset[ev.Ending]:
    allowed = (
        "an iterable of 'stopped', 'pruned', 'signal' (the stopped runs whose final "
        "checkpoint to skip), e.g. {'pruned'}; empty: always write it"
    )
    if isinstance(value, str) or not isinstance(value, Iterable):
        raise ConfigError.invalid(name, value, allowed)
    out = set()
    for item in value:
        if item not in (ev.Ending.STOPPED, ev.Ending.PRUNED, ev.Ending.SIGNAL):
            raise ConfigError.invalid(name, item, allowed)
        out.add(ev.Ending(item))
    return frozenset(out)


def _over_model(name: str, opt: Any, params: set[int], *, sharded: bool) -> None:
    if not isinstance(opt, torch.optim.Optimizer):
        raise ConfigError.wrong_kind(name, opt, "a torch.optim.Optimizer")
    if not any(id(p) in params for g in opt.param_groups for p in g["params"]):
        raise ConfigError.invalid(
            name,
            type(opt).__name__,
            "an optimizer built after fully_shard(model), over its sharded (DTensor) "
            "parameters: fully_shard replaces every parameter, so an optimizer built before "
            "it would step the old, unsharded ones"
            if sharded
            else "an optimizer over this model's parameters",
        )


def check_optimizers(
    model: torch.nn.Module, optimizer: Any
) -> tuple[torch.optim.Optimizer, dict[str, torch.optim.Optimizer]]:
    """``(the optimizer the loop steps, {name: optimizer})``: one over the model's parameters,
    or a mapping of names to distinct optimizers over disjoint ones (an :class:`OptimizerSet`)."""
    params, sharded = {id(p) for p in model.parameters()}, is_sharded_model(model)
    if isinstance(optimizer, torch.optim.Optimizer):
        _over_model("optimizer", optimizer, params, sharded=sharded)
        return optimizer, {DEFAULT_NAME: optimizer}
    if not isinstance(optimizer, Mapping):
        raise ConfigError.wrong_kind(
            "optimizer",
            optimizer,
            "a torch.optim.Optimizer, or a mapping of names to optimizers "
            "(e.g. {'g': opt_g, 'd': opt_d})",
        )
    if not optimizer:
        raise ConfigError.invalid("optimizer", "<empty mapping>", "at least one optimizer")
    seen: dict[int, str] = {}  # optimizer id -> its name
    owner: dict[int, str] = {}  # parameter id -> the name of its optimizer
    for name, opt in optimizer.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise ConfigError.invalid("optimizer", name, "names that are identifiers")
        _over_model(f"optimizer[{name!r}]", opt, params, sharded=sharded)
        if id(opt) in seen:
            raise ConfigError.invalid(
                f"optimizer[{name!r}]",
                type(opt).__name__,
                f"a different optimizer than optimizer[{seen[id(opt)]!r}]",
            )
        seen[id(opt)] = name
        for p in (q for g in opt.param_groups for q in g["params"]):
            if id(p) in owner:
                raise ConfigError.invalid(
                    f"optimizer[{name!r}]",
                    type(opt).__name__,
                    f"optimizers over disjoint parameters (it shares one with "
                    f"optimizer[{owner[id(p)]!r}])",
                )
            owner[id(p)] = name
    named = dict(optimizer)
    return OptimizerSet(named), named


def _stepper(name: str, scheduler: Any) -> None:
    if isinstance(scheduler, type) or not callable(getattr(scheduler, "step", None)):
        raise ConfigError.wrong_kind(name, scheduler, "an LR scheduler with .step()")
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise ConfigError.invalid(
            name,
            type(scheduler).__name__,
            "a scheduler the loop steps without arguments; torch's ReduceLROnPlateau needs a "
            "metric in .step(metric): use callbacks=[trainbus.callbacks.ReduceLROnPlateau("
            "monitor='val_loss')] instead",
        )


def check_schedulers(
    scheduler: Any, optimizers: Mapping[str, torch.optim.Optimizer]
) -> tuple[Any | None, dict[str, Any]]:
    """``(the scheduler the loop steps, {optimizer name: scheduler})``; a mapping of them is a
    :class:`SchedulerSet`. Each must drive its own optimizer."""
    if scheduler is None:
        return None, {}
    named = isinstance(scheduler, Mapping)
    if named and len(optimizers) == 1 and DEFAULT_NAME in optimizers:
        raise ConfigError.invalid(
            "scheduler", "<mapping>", "one scheduler (a mapping needs named optimizers)"
        )
    if not named and len(optimizers) > 1:
        _stepper("scheduler", scheduler)
        belongs = next(
            (n for n, o in optimizers.items() if o is getattr(scheduler, "optimizer", 0)), None
        )
        where = (
            f"it belongs to optimizer {belongs!r}: pass scheduler={{{belongs!r}: scheduler}}"
            if belongs is not None
            else "pass a mapping of optimizer names to schedulers"
        )
        raise ConfigError.invalid(
            "scheduler",
            type(scheduler).__name__,
            f"one scheduler per optimizer with several optimizers ({sorted(optimizers)}); " + where,
        )
    pairs = dict(scheduler) if named else {next(iter(optimizers)): scheduler}
    for name, sched in pairs.items():
        field = f"scheduler[{name!r}]" if named else "scheduler"
        if name not in optimizers:
            raise ConfigError.invalid(
                "scheduler", name, "names of the optimizers: " + ", ".join(map(repr, optimizers))
            )
        _stepper(field, sched)
        target = getattr(sched, "optimizer", None)
        if target is not None and target is not optimizers[name]:
            other = next((n for n, o in optimizers.items() if o is target), None)
            whose = f"optimizer {name!r}" if named else "the Trainer's optimizer"
            drives = f"optimizer {other!r}" if other else "another one"
            raise ConfigError.invalid(
                field,
                type(sched).__name__,
                f"a scheduler of {whose}; it drives {drives}, so the run's learning rate "
                "would never change: build it on that optimizer",
            )
    return (SchedulerSet(scheduler) if named else scheduler), pairs


P = ParamSpec("P")
R = TypeVar("R")

AccumulateBy = Literal["batches", "items"] | Callable[[Any], int]


@dataclass(frozen=True, slots=True, kw_only=True)
class EvalSchedule:
    """When a run evaluates ``eval_data``: ``Trainer(eval_schedule=EvalSchedule(...))``.

    Args:
        every_steps: Also evaluate every N optimizer steps (None: not by steps).
        epoch_end: Evaluate after each epoch.
        at_end: Evaluate the final weights once more when the last step was not evaluated
            (docs/trainer.md).

    Raises:
        ConfigError: naming the field (``EvalSchedule.every_steps``...), the value and what
            is allowed.
    """

    every_steps: int | None = None
    epoch_end: bool = True
    at_end: bool = True

    def __post_init__(self) -> None:
        check_int("EvalSchedule.every_steps", self.every_steps, 1, optional=True)
        check_bool("EvalSchedule.epoch_end", self.epoch_end)
        check_bool("EvalSchedule.at_end", self.at_end)


def _accumulate_keyword(name: str, value: Any, known: list[str]) -> str:
    return unknown_keyword_message(
        "Accumulate",
        name,
        ["micro_batches", "by"],
        f"the micro-batches per step are micro_batches: Accumulate({value!r}) or "
        f"Accumulate(micro_batches={value!r})"
        if isinstance(value, int)
        else None,
    )


@dataclass(frozen=True, slots=True, init=False)
class Accumulate:
    """Gradient accumulation with a weighing of its own (``accumulate=4`` is ``Accumulate(4)``).

    Args:
        micro_batches: Micro-batches per optimizer step.
        by: How the micro-batches weigh: ``"batches"`` alike, ``"items"`` by their labels
            ``!= -100``, or ``fn(batch) -> items`` (docs/trainer.md).

    Raises:
        ConfigError: naming the field (``Accumulate.micro_batches``, ``Accumulate.by``).
        TypeError: another keyword (``Accumulate(n=4)``), naming ``micro_batches``.
    """

    micro_batches: int
    by: AccumulateBy

    @explains_unknown_keywords(_accumulate_keyword)
    def __init__(self, micro_batches: int, by: AccumulateBy = "batches") -> None:
        check_int("Accumulate.micro_batches", micro_batches, 1)
        accumulate_by("Accumulate.by", by)
        object.__setattr__(self, "micro_batches", micro_batches)
        object.__setattr__(self, "by", by)


@dataclass(frozen=True, slots=True)
class CheckpointDir:
    """A checkpoint folder with a final-checkpoint policy of its own (docs/trainer.md).

    Args:
        path: The folder; checked now (creatable, writable), created at the first save.
        skip_final: Stopped runs that write no final checkpoint: any of ``"stopped"``,
            ``"pruned"``, ``"signal"`` (:class:`~trainbus.events.Ending`); default none.

    Raises:
        ConfigError: naming the field (``CheckpointDir.path``, ``CheckpointDir.skip_final``).
    """

    path: str | os.PathLike[str]
    skip_final: Iterable[ev.Ending | str] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.path, str | os.PathLike):
            raise ConfigError.invalid("CheckpointDir.path", self.path, "a folder (str or Path)")
        # Creatable and writable, not under a file: found now, not at the first save.
        object.__setattr__(self, "path", check_checkpoint_dir(self.path))
        object.__setattr__(
            self, "skip_final", skip_final("CheckpointDir.skip_final", self.skip_final)
        )


@dataclass(frozen=True, slots=True)
class PerEpoch:
    """An LR scheduler stepped once per epoch instead of once per optimizer step.

    Args:
        scheduler: The scheduler, or a mapping of optimizer names to schedulers.
    """

    scheduler: Any


def _scheduler(name: str, value: Any) -> tuple[Any, Literal["step", "epoch"]]:
    if isinstance(value, PerEpoch):
        return value.scheduler, "epoch"
    return value, "step"


def _accumulate(name: str, value: Any) -> Accumulate:
    if isinstance(value, Accumulate):
        return value
    try:
        return Accumulate(value)
    except ConfigError:
        raise ConfigError.invalid(
            name,
            value,
            "an int >= 1 (micro-batches per step) or trainbus.Accumulate(micro_batches, by=...)",
        ) from None


def _checkpoint_dir(name: str, value: Any) -> CheckpointDir | None:
    if value is None or isinstance(value, CheckpointDir):
        return value
    if not isinstance(value, str | os.PathLike):
        raise ConfigError.invalid(
            name,
            value,
            "None, a folder (str or Path) or trainbus.CheckpointDir(path, skip_final=...)",
        )
    return CheckpointDir(value)


CHECKS: dict[str, Check] = {
    "train_step": train_step,
    "loss_fn": loss_fn,
    "eval_data": checked_later,  # eval_sets
    "max_epochs": int_at_least(1, optional=True),
    "max_steps": int_at_least(1, optional=True),
    "scheduler": _scheduler,
    "accumulate": _accumulate,
    "clip_grad_norm": clip_grad_norm,
    "precision": precision,
    "device": lambda _, value: resolve_device(value),  # resolved once, for every thread
    "seed": int_at_least(0, optional=True),
    "metrics": metrics,
    "set_metrics": set_metrics,
    "eval_schedule": accepting(
        "a trainbus.EvalSchedule", lambda value: isinstance(value, EvalSchedule)
    ),
    "log_every": int_at_least(1),
    "checkpoint_dir": _checkpoint_dir,
    "callbacks": callbacks,
    "progress": progress,
    "on_nonfinite": on_nonfinite,
    "on_signal": lambda _, value: check_on_signal(value),
    "bus": bus,
    "ddp": checked_later,  # check_ddp
    "attach": checked_later,  # attach_folder
    "trace": trace,
}
"""The check of each keyword option of ``Trainer.__init__``, in its signature's order."""


def check_options(given: Mapping[str, Any]) -> dict[str, Any]:
    """``{name: the value the run uses}`` of ``Trainer.__init__``'s ``locals()``."""
    return {name: check(name, given[name]) for name, check in CHECKS.items()}


def unknown_option_message(name: str, value: Any, options: Iterable[str]) -> str:
    hint = option_hint(name, value)
    if hint is None and name in inspect.signature(EventBus).parameters:
        hint = f"bus=EventBus({name}={value!r}) (an option of the bus)"
    return unknown_keyword_message("Trainer", name, options, hint)


explains_unknown_options = explains_unknown_keywords(unknown_option_message)


def explains_fit_keywords(owner: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """``fit`` / ``fit_sync`` refusing another framework's keyword naming ``fit(resume=...)``."""
    return explains_unknown_keywords(
        lambda name, value, known: unknown_keyword_message(
            owner, name, known, fit_hint(name, value)
        )
    )


def build_settings(
    model: Any, optimizer: Any, train_data: Any, options: Mapping[str, Any], bus: EventBus
) -> Settings:
    """The loop's :class:`Settings`, after the checks of the positional arguments and of
    options that depend on each other."""
    if not isinstance(model, torch.nn.Module):
        raise ConfigError.wrong_kind("model", model, "a torch.nn.Module")
    optimizer, optimizers = check_optimizers(model, optimizer)
    train_len = check_loader("train_data", train_data)
    sets, named = eval_sets(options["eval_data"])
    if options["max_epochs"] is None and options["max_steps"] is None:
        raise ConfigError.invalid("max_epochs", None, "set max_epochs or max_steps (or both)")
    given_scheduler, interval = options["scheduler"]
    scheduler, schedulers = check_schedulers(given_scheduler, optimizers)
    given, device = options["precision"], options["device"]
    precision = PRECISION_SPELLINGS[given]
    if precision == "bf16" and not bf16_supported(device):
        props = torch.cuda.get_device_properties(device)
        raise ConfigError.invalid(
            "precision",
            given,
            f"'32' or 'fp16' on {device} ({props.name}, compute "
            f"capability {props.major}.{props.minor}): bf16 needs compute capability 8.0 or "
            "later (torch would only emulate it, slower than fp32)",
        )
    if precision == "fp16" and device.type != "cuda":
        raise ConfigError.invalid(
            "precision",
            given,
            f"'32' or 'bf16' on {device.type}: {given!r} is fp16 with a grad scaler, which "
            f"needs CUDA; mixed precision on {device.type} is precision='bf16'",
        )
    no_forward = getattr(model.forward, "__func__", None) is torch.nn.Module.forward
    if options["eval_data"] is not None and no_forward:
        # A ModuleDict of a GAN, say: its custom train_step calls the parts; evaluation cannot.
        # (Read on the instance: torch.compile's module sets its forward there.)
        raise ConfigError.invalid(
            "eval_data",
            type(options["eval_data"]).__name__,
            f"None for a model without forward() ({type(model).__name__}): "
            "evaluation calls model(inputs); evaluate in a subscriber of your own instead, or "
            "give the model a forward",
        )
    schedule: EvalSchedule = options["eval_schedule"]
    if schedule.every_steps is not None and options["eval_data"] is None:
        raise ConfigError.invalid(
            "eval_schedule.every_steps", schedule.every_steps, "None unless eval_data is given"
        )
    for name in options["set_metrics"]:
        if name == "loss" or name in options["metrics"]:
            raise ConfigError.invalid(
                f"set_metrics[{name!r}]",
                options["set_metrics"][name],
                f"a name that is neither 'loss' nor one of metrics= ({sorted(options['metrics'])}):"
                " both would be the same key in EvaluationEnded.metrics",
            )
    check_passes(train_data, sets, named, options["max_epochs"])
    accumulate: Accumulate = options["accumulate"]
    folder: CheckpointDir | None = options["checkpoint_dir"]
    return Settings(
        model=model,
        optimizer=optimizer,
        train_data=train_data,
        train_len=train_len,
        loss_fn=options["loss_fn"],
        eval_data=options["eval_data"],
        max_epochs=options["max_epochs"],
        max_steps=options["max_steps"],
        scheduler=scheduler,
        scheduler_interval=interval,
        accumulate=accumulate.micro_batches,
        accumulate_by=accumulate.by,
        clip_grad_norm=options["clip_grad_norm"],
        precision=precision,
        device=device,
        seed=options["seed"],
        metrics=options["metrics"],
        set_metrics=options["set_metrics"],
        eval_every=schedule.every_steps,
        eval_at_epoch_end=schedule.epoch_end,
        eval_at_end=schedule.at_end,
        log_every=options["log_every"],
        checkpoint_dir=None if folder is None else Path(folder.path),
        skip_final_checkpoint=frozenset(map(ev.Ending, folder.skip_final if folder else ())),
        barriers=bus.barriers,
        on_nonfinite=options["on_nonfinite"],
        scaler=torch.amp.GradScaler("cuda") if precision == "fp16" else None,
        eval_sets=sets,
        eval_named=named,
        optimizers=optimizers,
        schedulers=schedulers,
        train_step=options["train_step"],
        trace=options["trace"],
    )

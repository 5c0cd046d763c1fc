"""The checks of single Trainer options, named by :data:`~trainbus._trainer.options.CHECKS`,
of the data (a loader, the evaluation sets, a one-shot iterator iterated twice), and of the
optimizers and their schedulers.

Each option's check takes the option's (or a group field's) name and value, returns the value
the run uses, and raises :class:`~trainbus.ConfigError` naming the option, the value and what
is allowed. The groups of options (``EvalSchedule``...) and the checks of a precision and its
device live in :mod:`~trainbus._trainer.options`.
"""

from __future__ import annotations

import inspect
import math
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from .. import events as ev
from .._bus import EventBus
from .._exceptions import ConfigError
from .._loop.optimizers import DEFAULT_NAME, OptimizerSet, SchedulerSet
from .._loop.set_metrics import SetMetric
from .._loop.settings import Precision
from .._tensors import is_sharded_model
from .._validate import check_int
from ..callbacks._base import Callback

Check = Callable[[str, Any], Any]
"""``check(name, value) -> the value the run uses``; raises ConfigError."""


def int_at_least(minimum: int, *, optional: bool = False) -> Check:
    """An int >= ``minimum`` (or None when ``optional``)."""
    return lambda name, value: check_int(name, value, minimum, optional=optional)


def accepting(allowed: str, ok: Callable[[Any], bool], *, by_type: bool = False) -> Check:
    """The value itself when ``ok(value)``, else a ``ConfigError`` saying ``allowed`` (showing
    the value's type when ``by_type``)."""

    def check(name: str, value: Any) -> Any:
        if not ok(value):
            raise ConfigError.invalid(name, type(value).__name__ if by_type else value, allowed)
        return value

    return check


def _none_or(kind: type) -> Callable[[Any], bool]:
    return lambda value: value is None or isinstance(value, kind)


def _none_or_callable(value: Any) -> bool:
    return value is None or callable(value)


boolean = accepting("True or False", lambda value: isinstance(value, bool))
progress = accepting("None (when stderr is a terminal), True or False", _none_or(bool))
bus = accepting("a trainbus.EventBus or None", _none_or(EventBus))
train_step = accepting("a callable step(ctx) or None", _none_or_callable, by_type=True)
on_nonfinite = accepting(
    "'raise', 'stop', 'skip' or 'ignore'",
    lambda value: value in ("raise", "stop", "skip", "ignore"),
)
ddp = accepting(
    "None (DDP unless the model is sharded with fully_shard), True or False", _none_or(bool)
)


def clip_grad_norm(name: str, value: Any) -> float | None:
    """A finite number > 0, or None."""
    if value is None:
        return None
    if not (isinstance(value, int | float) and not isinstance(value, bool)
            and math.isfinite(value) and value > 0):  # fmt: skip
        raise ConfigError.invalid(name, value, "a finite number > 0 or None")
    return float(value)


def accumulate_by(name: str, value: Any) -> Any:
    """``"batches"``, ``"items"`` or a function ``fn(batch) -> items``."""
    if (
        value in ("batches", "items")
        if isinstance(value, str)
        else callable(value) and not isinstance(value, type)
    ):
        return value
    raise ConfigError.invalid(
        name, value, "'batches', 'items' (labels != -100 per micro-batch) or fn(batch) -> int"
    )


def _refuses_two_arguments(fn: Callable[..., Any]) -> str | None:
    """``fn``'s signature when it cannot be called with two positional arguments, else None
    (also when it has no signature to read, as some builtins)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    try:
        signature.bind(None, None)
    except TypeError:
        return str(signature)
    return None


def metrics(name: str, value: Any) -> dict[str, Callable[[Any, Any], Any]]:
    """None or a mapping of identifiers to ``fn(outputs, targets)``."""
    if value is not None and not isinstance(value, Mapping):
        raise ConfigError.invalid(name, value, "a mapping of names to fn(outputs, targets)")
    out = dict(value or {})
    for key, fn in out.items():
        if not isinstance(key, str) or not key.isidentifier() or not callable(fn):
            raise ConfigError.invalid(
                f"metrics[{key!r}]", fn, "an identifier mapped to fn(outputs, targets)"
            )
        taken = _refuses_two_arguments(fn)
        if taken is not None:
            raise ConfigError.invalid(
                f"metrics[{key!r}]",
                fn,
                f"fn(outputs, targets), called with two arguments per evaluation batch; this "
                f"one takes {taken}",
            )
    return out


def set_metrics(name: str, value: Any) -> dict[str, SetMetric]:
    """None or a mapping of identifiers to objects with ``update`` and ``compute``."""
    allowed = "a mapping of names to set metrics (update(outputs, targets), compute(totals))"
    if value is not None and not isinstance(value, Mapping):
        raise ConfigError.invalid(name, value, allowed)
    out = dict(value or {})
    for key, metric in out.items():
        if (not isinstance(key, str) or not key.isidentifier()
                or isinstance(metric, type) or not isinstance(metric, SetMetric)):  # fmt: skip
            raise ConfigError.invalid(
                f"{name}[{key!r}]", metric, "an identifier mapped to an object with "
                "update(outputs, targets) -> {name: sum} and compute(totals) -> float "
                "(trainbus.SetMetric; e.g. trainbus.Perplexity())",
            )  # fmt: skip
        taken = _refuses_two_arguments(metric.update)
        if taken is not None:
            raise ConfigError.invalid(
                f"{name}[{key!r}]",
                metric,
                f"a set metric whose update(outputs, targets) takes two arguments; its update "
                f"takes {taken}",
            )
    return out


def callbacks(name: str, value: Any) -> tuple[Callback | type[Callback], ...]:
    """Callback classes or instances (one alone too), checked, not instantiated."""
    if isinstance(value, Callback | type):
        value = [value]
    if not isinstance(value, Iterable):
        raise ConfigError.invalid(name, value, "an iterable of Callbacks")
    out = tuple(value)
    for cb in out:
        if not (isinstance(cb, Callback) or (isinstance(cb, type) and issubclass(cb, Callback))):
            raise ConfigError.invalid(name, cb, "Callback subclasses or instances")
    return out


def loss_fn(name: str, value: Any) -> Any:
    """A callable ``loss_fn(outputs, targets)`` or None; a loss class is refused."""
    if value is not None and not callable(value):
        raise ConfigError.invalid(name, value, "a callable loss_fn(outputs, targets) or None")
    if isinstance(value, type) and issubclass(value, torch.nn.Module):
        raise ConfigError.invalid(
            name, value, f"an instance, such as {value.__name__}(), not the class"
        )
    return value


def attach(name: str, value: Any) -> bool | str | os.PathLike[str]:
    """True, False or a folder; the folder itself is checked with the run's checkpoint_dir
    (:func:`~trainbus._distributed.attach_server.attach_folder`)."""
    if isinstance(value, bool):
        return value
    if not isinstance(value, str | os.PathLike) or not os.fspath(value):
        raise ConfigError.invalid(name, value, "True (listen in checkpoint_dir), False, or a "
                                  "folder to listen in")  # fmt: skip
    return value


def trace(name: str, value: Any) -> frozenset[str]:
    """The parts of a step to time: True (every one of ``events.TRACED_SPANS``), False (none)
    or a collection of their names.

    Raises:
        ConfigError: ``value`` is none of those, or names a part that is not traced.
    """
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


def check_loader(name: str, value: Any) -> int | None:
    """A non-empty iterable of batches (not a tensor, a string, a map-style ``Dataset``); its
    length when it has one."""
    # A map-style Dataset yields samples, not batches: say how to batch it.
    if isinstance(value, torch.utils.data.Dataset) and not isinstance(value, Iterable):
        raise ConfigError.invalid(
            name, type(value).__name__,
            "an iterable of batches: a Dataset gives single samples; wrap it, "
            "DataLoader(dataset, batch_size=N, shuffle=..., collate_fn=...)",
        )  # fmt: skip
    if isinstance(value, torch.Tensor | str | bytes) or not isinstance(value, Iterable):
        raise ConfigError.invalid(
            name, type(value).__name__, "an iterable of batches, such as a DataLoader or a list"
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


def check_passes(train_data: Any, sets: Iterable[tuple[str, Any]], named: bool,
                 max_epochs: int | None) -> None:  # fmt: skip
    """Refuse a one-shot iterator the run iterates twice: as ``eval_data``, or as
    ``train_data`` for more than one epoch. The test is the iterator protocol, not a call of
    ``iter()``, which would start a ``DataLoader``'s workers."""
    twice = [(f"eval_data[{name!r}]" if named else "eval_data", data,
              "each evaluation makes a new pass", "") for name, data in sets]  # fmt: skip
    if max_epochs is not None and max_epochs > 1:
        twice.insert(0, ("train_data", train_data, f"max_epochs={max_epochs} makes a new pass "
                         "per epoch", "; or keep it, leave max_epochs out and set a max_steps "
                         "within its one pass"))  # fmt: skip
    for name, value, why, alternative in twice:
        if isinstance(value, Iterator):
            raise ConfigError.invalid(
                name, f"<one-shot {type(value).__name__}>",
                f"data that can be iterated again ({why}, and a {type(value).__name__} is "
                "spent after its first pass): a list of batches, a DataLoader, or an "
                "IterableDataset whose __iter__ starts a new pass (wrapped in a DataLoader)"
                f"{alternative}",
            )  # fmt: skip


PRECISION_SPELLINGS: Mapping[str, Precision] = {
    "32": "32", "bf16": "bf16", "fp16": "fp16",
    # Lightning's spellings of the same three (a user's Trainer(precision=...) carried over).
    "32-true": "32", "bf16-mixed": "bf16", "16-mixed": "fp16",
}  # fmt: skip
"""Every accepted ``precision`` and what it means here."""

_TRUE_DTYPES = {"16-true": "torch.float16", "bf16-true": "torch.bfloat16",
                "64-true": "torch.float64"}  # fmt: skip
"""Lightning's ``"*-true"`` spellings and the dtype they cast the model to."""


def precision(name: str, value: Any) -> Precision:
    """``"32"``, ``"bf16"``, ``"fp16"`` or a Lightning spelling of one; a Lightning ``"*-true"``
    is refused naming the cast to do instead."""
    allowed = ", ".join(repr(k) for k in PRECISION_SPELLINGS)
    if isinstance(value, str) and value in PRECISION_SPELLINGS:
        return PRECISION_SPELLINGS[value]
    if isinstance(value, str) and value in _TRUE_DTYPES:
        raise ConfigError.invalid(
            "precision", value,
            f"one of {allowed}; trainbus does not cast the model: for weights in another "
            f"dtype cast it yourself (model.to({_TRUE_DTYPES[value]})) and train with "
            "precision='32'",
        )  # fmt: skip
    if isinstance(value, int) and not isinstance(value, bool):
        raise ConfigError.invalid("precision", value,
                                  f"one of {allowed} (strings: precision='{value}' if that is "
                                  "one of them)")  # fmt: skip
    raise ConfigError.invalid("precision", value, f"one of {allowed}")


def eval_sets(eval_data: Any) -> tuple[tuple[tuple[str, Iterable[Any]], ...], bool]:
    """``((name, data), ...)`` of ``eval_data`` (None, one loader, or a mapping of set names
    without ``/`` to loaders) and whether the sets are named."""
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
                    "eval_data", name, "set names that are non-empty strings without '/' "
                    "(metrics are keyed '<set>/<metric>')",
                )  # fmt: skip
            check_loader(f"eval_data[{name!r}]", data)
            sets.append((name, data))
        return tuple(sets), True
    check_loader("eval_data", eval_data)
    return (("val", eval_data),), False


def eval_data(name: str, value: Any) -> Any:
    """None, an iterable of batches, or a mapping of set names to them."""
    eval_sets(value)  # raises on a bad set; the settings build the sets
    return value


def skip_final(name: str, value: Any) -> frozenset[ev.Ending]:
    """``CheckpointDir(skip_final=)``: an iterable of ``"stopped"``, ``"pruned"``,
    ``"signal"``, as a set of endings."""
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
        raise ConfigError.invalid(name, type(opt).__name__, "a torch.optim.Optimizer")
    if not any(id(p) in params for g in opt.param_groups for p in g["params"]):
        raise ConfigError.invalid(
            name, type(opt).__name__,
            "an optimizer built after fully_shard(model), over its sharded (DTensor) "
            "parameters: fully_shard replaces every parameter, so an optimizer built before "
            "it would step the old, unsharded ones" if sharded
            else "an optimizer over this model's parameters",
        )  # fmt: skip


def check_optimizers(
    model: torch.nn.Module, optimizer: Any
) -> tuple[torch.optim.Optimizer, dict[str, torch.optim.Optimizer]]:
    """``(the optimizer the loop steps, {name: optimizer})`` of ``optimizer``: one over the
    model's parameters (itself and ``{"default": it}``), or a non-empty mapping of identifiers
    to distinct optimizers over disjoint parameters (an :class:`OptimizerSet` and the mapping)."""
    params, sharded = {id(p) for p in model.parameters()}, is_sharded_model(model)
    if isinstance(optimizer, torch.optim.Optimizer):
        _over_model("optimizer", optimizer, params, sharded=sharded)
        return optimizer, {DEFAULT_NAME: optimizer}
    if not isinstance(optimizer, Mapping):
        raise ConfigError.invalid(
            "optimizer", type(optimizer).__name__,
            "a torch.optim.Optimizer, or a mapping of names to optimizers "
            "(e.g. {'g': opt_g, 'd': opt_d})",
        )  # fmt: skip
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
                f"optimizer[{name!r}]", type(opt).__name__,
                f"a different optimizer than optimizer[{seen[id(opt)]!r}]",
            )  # fmt: skip
        seen[id(opt)] = name
        for p in (q for g in opt.param_groups for q in g["params"]):
            if id(p) in owner:
                raise ConfigError.invalid(
                    f"optimizer[{name!r}]", type(opt).__name__,
                    f"optimizers over disjoint parameters (it shares one with "
                    f"optimizer[{owner[id(p)]!r}])",
                )  # fmt: skip
            owner[id(p)] = name
    named = dict(optimizer)
    return OptimizerSet(named), named


def _stepper(name: str, scheduler: Any) -> None:
    if not callable(getattr(scheduler, "step", None)):
        raise ConfigError.invalid(name, type(scheduler).__name__, "an LR scheduler with .step()")
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
    """``(the scheduler the loop steps, {optimizer name: scheduler})``: None and ``{}``
    without one; one scheduler of the one optimizer is itself; a mapping of optimizer names
    to their schedulers is a :class:`SchedulerSet`. Refused: no ``.step()``, torch's
    ``ReduceLROnPlateau`` (its ``.step()`` needs a metric), a scheduler of another optimizer,
    one scheduler for several optimizers (naming the one it belongs to)."""
    if scheduler is None:
        return None, {}
    if isinstance(scheduler, Mapping):
        if len(optimizers) == 1 and DEFAULT_NAME in optimizers:
            raise ConfigError.invalid(
                "scheduler", "<mapping>", "one scheduler (a mapping needs named optimizers)"
            )
        for name, sched in scheduler.items():
            if name not in optimizers:
                raise ConfigError.invalid(
                    "scheduler", name,
                    "names of the optimizers: " + ", ".join(map(repr, optimizers)),
                )  # fmt: skip
            _stepper(f"scheduler[{name!r}]", sched)
            target = getattr(sched, "optimizer", None)
            if target is not None and target is not optimizers[name]:
                other = next((n for n, o in optimizers.items() if o is target), None)
                drives = f"optimizer {other!r}" if other else "another one"
                raise ConfigError.invalid(
                    f"scheduler[{name!r}]", type(sched).__name__,
                    f"a scheduler of optimizer {name!r} (it drives {drives})",
                )  # fmt: skip
        return SchedulerSet(scheduler), dict(scheduler)
    _stepper("scheduler", scheduler)
    target = getattr(scheduler, "optimizer", None)
    if len(optimizers) > 1:
        belongs = next((n for n, o in optimizers.items() if o is target), None)
        where = (
            f"it belongs to optimizer {belongs!r}: pass scheduler={{{belongs!r}: scheduler}}"
            if belongs is not None
            else "pass a mapping of optimizer names to schedulers"
        )
        raise ConfigError.invalid(
            "scheduler", type(scheduler).__name__,
            f"one scheduler per optimizer with several optimizers ({sorted(optimizers)}); "
            + where,
        )  # fmt: skip
    ((name, only),) = optimizers.items()
    if target is not None and target is not only:
        raise ConfigError.invalid(
            "scheduler", type(scheduler).__name__,
            f"a scheduler of the Trainer's optimizer ({type(only).__name__} at "
            f"{id(only):#x}); this one drives another {type(target).__name__} (at "
            f"{id(target):#x}), so the run's learning rate would never change: build "
            "it on the optimizer you pass to the Trainer",
        )  # fmt: skip
    return scheduler, {name: scheduler}

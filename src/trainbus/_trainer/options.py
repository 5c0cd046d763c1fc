"""The Trainer's options: the groups of related ones, each option's check, and the loop's
:class:`~trainbus._loop.Settings` built from them.

The options are declared once, in ``Trainer.__init__``'s keyword-only signature and docstring;
:data:`CHECKS` holds each one's check in the signature's order, :func:`check_options` runs
them on ``__init__``'s ``locals()``. A group of related options is a frozen dataclass checked
when built; where one value is the common case (``accumulate=4``) the option takes it too.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, ParamSpec, TypeVar

import torch

from .. import events as ev
from .._bus import EventBus
from .._exceptions import ConfigError
from .._loop import Settings
from .._signals import check_on_signal
from .._tensors import bf16_supported, resolve_device
from .._validate import check_int, explains_unknown_keywords, unknown_keyword_message
from ..checkpoint import check_checkpoint_dir
from . import checks
from .hf_options import fit_hint, hf_hint, lightning_hint, removed_hint

__all__ = [
    "CHECKS",
    "Accumulate",
    "CheckpointDir",
    "EvalSchedule",
    "PerEpoch",
    "build_settings",
    "check_options",
    "explains_fit_keywords",
    "explains_unknown_options",
]

P = ParamSpec("P")
R = TypeVar("R")

AccumulateBy = Literal["batches", "items"] | Callable[[Any], int]


@dataclass(frozen=True, slots=True, kw_only=True)
class EvalSchedule:
    """When a run evaluates ``eval_data``: ``Trainer(eval_schedule=EvalSchedule(...))``.

    Args:
        every_steps: Also evaluate every N optimizer steps (None: not by steps).
        epoch_end: Evaluate after each epoch.
        at_end: When the run completes (``max_steps`` or ``max_epochs`` reached) and its last
            step was not evaluated, evaluate the final weights once more (``trigger="end"``,
            before the final checkpoint), as Hugging Face does; only when ``every_steps`` or
            ``epoch_end`` evaluates during the run. False: never.

    Raises:
        ConfigError: naming the field (``EvalSchedule.every_steps``...), the value and what
            is allowed.
    """

    every_steps: int | None = None
    epoch_end: bool = True
    at_end: bool = True

    def __post_init__(self) -> None:
        check_int("EvalSchedule.every_steps", self.every_steps, 1, optional=True)
        checks.boolean("EvalSchedule.epoch_end", self.epoch_end)
        checks.boolean("EvalSchedule.at_end", self.at_end)


def _accumulate_keyword(name: str, value: Any, known: list[str]) -> str:
    return unknown_keyword_message(
        "Accumulate", name, ["micro_batches", "by"],
        f"the micro-batches per step are micro_batches: Accumulate({value!r}) or "
        f"Accumulate(micro_batches={value!r})" if isinstance(value, int) else None,
    )  # fmt: skip


@dataclass(frozen=True, slots=True, init=False)
class Accumulate:
    """Gradient accumulation with a weighing of its own: ``accumulate=Accumulate(4,
    by="items")`` (``accumulate=4`` is ``Accumulate(4)``).

    Args:
        micro_batches: Micro-batches per optimizer step.
        by: How the step's micro-batches weigh: ``"batches"``, each its loss divided by
            their number; ``"items"``, each by its items over the step's (the labels
            ``!= -100`` of a mapping batch's ``"labels"`` or of the targets of
            ``(inputs, targets)``; Hugging Face's ``num_items_in_batch``), so that a
            token-level mean loss accumulates the gradient of one batch of the step's items;
            or ``fn(batch) -> items`` counting them your way. By items, a step's batches are
            fetched before its first forward (docs/trainer.md, "Gradient accumulation").

    Raises:
        ConfigError: naming the field (``Accumulate.micro_batches``, ``Accumulate.by``).
        TypeError: another keyword (``Accumulate(n=4)``), naming ``micro_batches``.
    """

    micro_batches: int
    by: AccumulateBy

    @explains_unknown_keywords(_accumulate_keyword)
    def __init__(self, micro_batches: int, by: AccumulateBy = "batches") -> None:
        check_int("Accumulate.micro_batches", micro_batches, 1)
        checks.accumulate_by("Accumulate.by", by)
        object.__setattr__(self, "micro_batches", micro_batches)
        object.__setattr__(self, "by", by)


@dataclass(frozen=True, slots=True)
class CheckpointDir:
    """A checkpoint folder with a final-checkpoint policy of its own:
    ``checkpoint_dir=CheckpointDir("runs/x", skip_final={"pruned"})`` (``checkpoint_dir=
    "runs/x"`` is ``CheckpointDir("runs/x")``).

    Args:
        path: The folder; checked now (creatable, writable, not under a file), nothing
            created.
        skip_final: Stopped runs that write no final checkpoint: any of ``"stopped"``,
            ``"pruned"`` (a pruner's stop: a sweep's pruned trials keep their disk and time),
            ``"signal"`` (:class:`~trainbus.events.Ending`). Default: none skipped.

    Raises:
        ConfigError: naming the field (``CheckpointDir.path``, ``CheckpointDir.skip_final``).
    """

    path: str | os.PathLike[str]
    skip_final: Iterable[ev.Ending | str] = ()

    @property
    def endings(self) -> frozenset[ev.Ending]:
        """``skip_final`` as checked: the endings whose final checkpoint is skipped."""
        return checks.skip_final("CheckpointDir.skip_final", self.skip_final)

    def __post_init__(self) -> None:
        if not isinstance(self.path, str | os.PathLike):
            raise ConfigError.invalid("CheckpointDir.path", self.path, "a folder (str or Path)")
        # Creatable and writable, not under a file: found now, not at the first save.
        object.__setattr__(self, "path", check_checkpoint_dir(self.path))
        object.__setattr__(
            self, "skip_final", checks.skip_final("CheckpointDir.skip_final", self.skip_final)
        )


@dataclass(frozen=True, slots=True)
class PerEpoch:
    """An LR scheduler stepped once per epoch instead of once per optimizer step:
    ``scheduler=PerEpoch(scheduler)``.

    Args:
        scheduler: The scheduler, or with several optimizers a mapping of optimizer names to
            schedulers (checked with the optimizers, as ``scheduler=`` is).
    """

    scheduler: Any


def _scheduler(name: str, value: Any) -> tuple[Any, Literal["step", "epoch"]]:
    """``(the scheduler, its interval)``; the scheduler itself is checked with the optimizers
    (:func:`~trainbus._trainer.checks.check_schedulers`)."""
    if isinstance(value, PerEpoch):
        return value.scheduler, "epoch"
    return value, "step"


def _group(cls: type, *, plain: Callable[[Any], Any] | None = None) -> checks.Check:
    """An instance of the group ``cls``, or (with ``plain``) the value ``plain`` turns into one."""

    def check(name: str, value: Any) -> Any:
        if isinstance(value, cls):
            return value
        if plain is not None:
            return plain(value)
        raise ConfigError.invalid(name, value, f"a trainbus.{cls.__name__}")

    return check


def _plain_accumulate(value: Any) -> Accumulate:
    try:
        return Accumulate(value)
    except ConfigError:
        raise ConfigError.invalid(
            "accumulate", value,
            "an int >= 1 (micro-batches per step) or trainbus.Accumulate(micro_batches, by=...)",
        ) from None  # fmt: skip


def _plain_checkpoint_dir(value: Any) -> CheckpointDir | None:
    if value is None:
        return None
    if not isinstance(value, str | os.PathLike):
        raise ConfigError.invalid(
            "checkpoint_dir", value,
            "None, a folder (str or Path) or trainbus.CheckpointDir(path, skip_final=...)",
        )  # fmt: skip
    return CheckpointDir(value)


CHECKS: dict[str, checks.Check] = {
    "train_step": checks.train_step,
    "loss_fn": checks.loss_fn,
    "eval_data": checks.eval_data,
    "max_epochs": checks.int_at_least(1, optional=True),
    "max_steps": checks.int_at_least(1, optional=True),
    "scheduler": _scheduler,
    "accumulate": _group(Accumulate, plain=_plain_accumulate),
    "clip_grad_norm": checks.clip_grad_norm,
    "precision": checks.precision,
    "device": lambda _, value: resolve_device(value),  # resolved once, for every thread
    "seed": checks.int_at_least(0, optional=True),
    "metrics": checks.metrics,
    "set_metrics": checks.set_metrics,
    "eval_schedule": _group(EvalSchedule),
    "log_every": checks.int_at_least(1),
    "checkpoint_dir": _group(CheckpointDir, plain=_plain_checkpoint_dir),
    "callbacks": checks.callbacks,
    "progress": checks.progress,
    "on_nonfinite": checks.on_nonfinite,
    "on_signal": lambda _, value: check_on_signal(value),
    "bus": checks.bus,
    "ddp": checks.ddp,
    "attach": checks.attach,
    "trace": checks.trace,
}
"""The check of each keyword option of ``Trainer.__init__``, in its signature's order:
``check(name, value) -> the value the run uses``, raising ``ConfigError``."""


def check_options(given: Mapping[str, Any]) -> dict[str, Any]:
    """``{name: the value the run uses}`` of every keyword option of ``given``
    (``Trainer.__init__``'s ``locals()``), checked in the signature's order."""
    return {name: check(name, given[name]) for name, check in CHECKS.items()}


def bus_hint(name: str, value: Any) -> str | None:
    """``bus=EventBus(<name>=<value>)`` when ``name`` is an option of the bus, else None."""
    if name not in inspect.signature(EventBus).parameters:
        return None
    return f"bus=EventBus({name}={value!r}) (an option of the bus)"


def unknown_option_message(name: str, value: Any, options: Iterable[str]) -> str:
    """Python's message for an unexpected keyword, with what replaces ``name`` in trainbus."""
    hint = (
        hf_hint(name) or lightning_hint(name) or removed_hint(name, value) or bus_hint(name, value)
    )
    return unknown_keyword_message("Trainer", name, options, hint)


explains_unknown_options = explains_unknown_keywords(unknown_option_message)
"""``Trainer.__init__`` with a keyword that is no option refused as Python refuses it, and
what replaces it named (a Hugging Face, Lightning or removed trainbus name; else the nearest)."""


def explains_fit_keywords(owner: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """``Trainer.fit`` / ``fit_sync`` refusing another framework's keyword (``ckpt_path``,
    ``resume_from_checkpoint``) by naming ``fit(resume=...)``."""
    return explains_unknown_keywords(
        lambda name, value, known: unknown_keyword_message(owner, name, known,
                                                           fit_hint(name, value))
    )  # fmt: skip


def build_settings(model: Any, optimizer: Any, train_data: Any, options: Mapping[str, Any],
                   bus: EventBus) -> Settings:  # fmt: skip
    """The loop's :class:`Settings` from the positional arguments, the checked ``options``
    and the bus' ``barriers``, after the checks of the positional arguments and of two options
    at once."""
    if not isinstance(model, torch.nn.Module):
        raise ConfigError.invalid("model", type(model).__name__, "a torch.nn.Module")
    optimizer, optimizers = checks.check_optimizers(model, optimizer)
    train_len = checks.check_loader("train_data", train_data)
    if options["max_epochs"] is None and options["max_steps"] is None:
        raise ConfigError.invalid("max_epochs", None, "set max_epochs or max_steps (or both)")
    given_scheduler, interval = options["scheduler"]
    scheduler, schedulers = checks.check_schedulers(given_scheduler, optimizers)
    precision, device = options["precision"], options["device"]
    if precision == "bf16" and not bf16_supported(device):
        props = torch.cuda.get_device_properties(device)
        raise ConfigError.invalid(
            "precision", precision, f"'32' or 'fp16' on {device} ({props.name}, compute "
            f"capability {props.major}.{props.minor}): bf16 needs compute capability 8.0 or "
            "later (torch would only emulate it, slower than fp32)",
        )  # fmt: skip
    if precision == "fp16" and device.type != "cuda":
        raise ConfigError.invalid(
            "precision", precision,
            f"'32' or 'bf16' on {device.type}; fp16 with a grad scaler needs CUDA",
        )  # fmt: skip
    schedule: EvalSchedule = options["eval_schedule"]
    if schedule.every_steps is not None and options["eval_data"] is None:
        raise ConfigError.invalid("eval_schedule.every_steps", schedule.every_steps,
                                  "None unless eval_data is given")  # fmt: skip
    sets, named = checks.eval_sets(options["eval_data"])
    for name in options["set_metrics"]:
        if name == "loss" or name in options["metrics"]:
            raise ConfigError.invalid(
                f"set_metrics[{name!r}]", options["set_metrics"][name],
                f"a name that is neither 'loss' nor one of metrics= ({sorted(options['metrics'])}):"
                " both would be the same key in EvaluationEnded.metrics",
            )  # fmt: skip
    checks.check_passes(train_data, sets, named, options["max_epochs"])
    accumulate: Accumulate = options["accumulate"]
    folder: CheckpointDir | None = options["checkpoint_dir"]
    return Settings(
        model=model, optimizer=optimizer, train_data=train_data, train_len=train_len,
        loss_fn=options["loss_fn"], eval_data=options["eval_data"],
        max_epochs=options["max_epochs"], max_steps=options["max_steps"],
        scheduler=scheduler, scheduler_interval=interval,
        accumulate=accumulate.micro_batches, accumulate_by=accumulate.by,
        clip_grad_norm=options["clip_grad_norm"], precision=precision, device=device,
        seed=options["seed"], metrics=options["metrics"], set_metrics=options["set_metrics"],
        eval_every=schedule.every_steps, eval_at_epoch_end=schedule.epoch_end,
        eval_at_end=schedule.at_end, log_every=options["log_every"],
        checkpoint_dir=None if folder is None else Path(folder.path),
        skip_final_checkpoint=frozenset() if folder is None else folder.endings,
        barriers=bus.barriers, on_nonfinite=options["on_nonfinite"],
        scaler=torch.amp.GradScaler("cuda") if precision == "fp16" else None,
        eval_sets=sets, eval_named=named, optimizers=optimizers, schedulers=schedulers,
        train_step=options["train_step"], trace=options["trace"],
    )  # fmt: skip

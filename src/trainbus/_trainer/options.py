"""The Trainer's options, declared once: :class:`TrainerOptions`.

Each keyword option of ``Trainer(model, optimizer, train_data, **options)`` is one entry of the
``TrainerOptions`` TypedDict: its type (what mypy and an IDE check a call against, through
``Unpack[TrainerOptions]``) annotated with an :class:`Option` holding its default, its check
(:mod:`~trainbus._trainer.checks`) and its meaning. From that one entry come:

- the Trainer's signature as ``help(Trainer)`` and ``inspect.signature`` show it
  (:func:`signature`), and the options part of its docstring (:func:`options_doc`);
- the checks, in declaration order (:func:`check_options`), then those of two options at once
  and the loop's :class:`~trainbus._loop.Settings` (:func:`build_settings`: each option that
  is a ``Settings`` field goes there by its name);
- the option table of docs/trainer.md, which ``tests/trainer/test_options.py`` holds to it.

A new option is one entry here (plus a ``Settings`` field when the loop reads it, or a line in
:data:`TRAINER_ONLY` when the Trainer does).
"""

# Not ``from __future__ import annotations``: the annotations are read at import (the
# ``Option`` in each one is the declaration).

import dataclasses
import difflib
import inspect
import os
import re
import textwrap
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Literal, TypedDict, get_args, get_type_hints

import torch

from .. import events as ev
from .._bus import EventBus
from .._exceptions import ConfigError
from .._loop import DEFAULT_BARRIERS, NonFinitePolicy, Precision, Settings, TrainContext
from .._loop.optimizers import check_optimizers, check_schedulers
from .._loop.set_metrics import SetMetric
from .._loop.settings import check_loader, check_reiterable, eval_sets
from .._tensors import bf16_supported
from ..callbacks._base import Callback
from . import checks
from .endings import OnSignal
from .hf_options import hf_hint

__all__ = [
    "OPTIONS",
    "TRAINER_ONLY",
    "BusDefault",
    "Option",
    "TrainerOptions",
    "build_settings",
    "check_options",
    "new_bus",
    "options_doc",
    "signature",
]


class BusDefault(Enum):
    """Default of a Trainer option that belongs to the bus: the bus' own default."""

    DEFAULT = "the bus' default"


@dataclass(frozen=True, slots=True)
class Option:
    """One option's default, check and meaning (the metadata of its ``TrainerOptions`` entry).

    Args:
        default: The value when the option is left out.
        check: ``check(name, value) -> the value the run uses``; raises ``ConfigError``.
        doc: What it means (the Trainer's docstring shows it).
        shown: The default as docs/trainer.md's table shows it, where ``repr`` does not say it.
    """

    default: Any
    check: checks.Check
    doc: str
    shown: str | None = None

    @property
    def default_text(self) -> str:
        """The default as docs/trainer.md's option table writes it."""
        if self.shown is not None:
            return self.shown
        if isinstance(self.default, str):
            return f'`"{self.default}"`'
        return f"`{self.default!r}`"


class TrainerOptions(TypedDict, total=False):
    """The keyword options of :class:`~trainbus.Trainer`, each with its :class:`Option`.

    Also a type for options kept apart from the call, checked by mypy:
    ``options: TrainerOptions = {"max_steps": 100}; Trainer(model, opt, data, **options)``.
    """

    train_step: Annotated[
        Callable[[TrainContext], Any] | None,
        Option(
            None,
            checks.train_step,
            "Your own step, ``fn(ctx: TrainContext) -> loss`` called per micro-batch: any "
            "forwards, ``ctx.backward(loss)``, ``ctx.optimizer_step(name)``; trainbus keeps the "
            "events, hooks, accumulation, clipping, precision, non-finite checks and "
            "checkpoints (docs/recipes.md). None: the default step.",
        ),
    ]
    loss_fn: Annotated[
        Callable[[Any, Any], torch.Tensor] | None,
        Option(
            None,
            checks.loss_fn,
            "``loss_fn(model(inputs), targets)`` for ``(inputs, targets)`` batches. Without it, "
            "``model(batch)`` (``model(**batch)`` for a mapping) returns the loss, a mapping "
            'with ``"loss"`` or an object with ``.loss`` (the Hugging Face convention).',
        ),
    ]
    eval_data: Annotated[
        Iterable[Any] | Mapping[str, Iterable[Any]] | None,
        Option(
            None,
            checks.eval_data,
            "Iterable of evaluation batches, or a mapping of set names to iterables "
            '(``{"val": val_loader, "test": test_loader}``), scored one after the other in '
            "one evaluation round. Metrics of a single loader are ``val_loss``/``val_<name>``; "
            'of named sets ``<set>/loss``/``<set>/<name>`` (``"test/acc"``).',
        ),
    ]
    max_epochs: Annotated[
        int | None,
        Option(
            None,
            checks.int_at_least(1, optional=True),
            "Epochs to train; with ``max_steps`` the first limit reached ends the run.",
        ),
    ]
    max_steps: Annotated[
        int | None,
        Option(
            None,
            checks.int_at_least(1, optional=True),
            "Optimizer steps to train.",
        ),
    ]
    scheduler: Annotated[
        Any | None,
        Option(
            None,
            checks.as_given,
            "An LR scheduler, stepped every step or every epoch (``scheduler_interval``); with "
            "several optimizers a mapping of optimizer names to schedulers.",
        ),
    ]
    scheduler_interval: Annotated[
        Literal["step", "epoch"],
        Option(
            "step",
            checks.scheduler_interval,
            '``"step"`` or ``"epoch"``.',
        ),
    ]
    accumulate: Annotated[
        int,
        Option(
            1,
            checks.int_at_least(1),
            "Micro-batches per optimizer step (gradient accumulation).",
        ),
    ]
    accumulate_by: Annotated[
        Literal["batches", "items"] | Callable[[Any], int],
        Option(
            "batches",
            checks.accumulate_by,
            'How the micro-batches of a window weigh: ``"batches"``, each its loss divided by '
            "the window's length; ``\"items\"``, each by its items over the window's (the "
            'labels ``!= -100`` of a mapping batch\'s ``"labels"`` or of the targets of '
            "``(inputs, targets)``; Hugging Face's ``num_items_in_batch``), so that a token-level "
            "mean loss accumulates the gradient of one batch of the window's items; or "
            "``fn(batch) -> items`` counting them your way. By items, a window's batches are "
            'fetched before its first forward (docs/trainer.md, "Gradient accumulation").',
        ),
    ]
    clip_grad_norm: Annotated[
        float | None,
        Option(
            None,
            checks.clip_grad_norm,
            "Clip the total gradient norm to this value; the pre-clip norm is reported as "
            "``grad_norm`` on the events.",
        ),
    ]
    precision: Annotated[
        Precision,
        Option(
            "32",
            checks.precision,
            '``"32"``, ``"bf16"`` (autocast, any device; on CUDA compute capability 8.0 or '
            'later) or ``"fp16"`` (autocast with a grad scaler, CUDA only); Lightning\'s '
            '``"32-true"``, ``"bf16-mixed"`` and ``"16-mixed"`` are the same three.',
        ),
    ]
    device: Annotated[
        str | torch.device,
        Option(
            "auto",
            checks.device,
            '``"auto"`` (CUDA, then MPS, then CPU), a device string or ``torch.device``. '
            '``"auto"`` and ``"cuda"`` resolve now to ``cuda:N`` (the current CUDA device); '
            "the loop, evaluate and predict make it current on their own threads "
            '(docs/trainer.md, "On a GPU").',
        ),
    ]
    seed: Annotated[
        int | None,
        Option(
            None,
            checks.int_at_least(0, optional=True),
            "At the start of ``fit()``, seeds Python's, NumPy's and torch's process-wide "
            "generators (:func:`~trainbus.seed_everything`; call that one before building the "
            "model for equal initial weights), and gives a ``DataLoader(shuffle=True)`` without "
            "a ``generator`` a data order of ``(seed, epoch)`` that no other thread's draws "
            'change (docs/trainer.md, "Seeds").',
        ),
    ]
    metrics: Annotated[
        Mapping[str, Callable[[Any, Any], Any]] | None,
        Option(
            None,
            checks.metrics,
            '``{"acc": fn(outputs, targets)}``, averaged over samples as ``val_acc``; '
            "``targets`` is the second element of ``(inputs, targets)`` batches, a mapping "
            'batch\'s ``"labels"``, else the batch (docs/trainer.md, "Metric functions").',
        ),
    ]
    set_metrics: Annotated[
        Mapping[str, SetMetric] | None,
        Option(
            None,
            checks.set_metrics,
            'Metrics of the whole evaluation set, ``{"ppl": Perplexity()}`` as ``val_ppl``: '
            "each sums ``update(outputs, targets)``'s values over the set (and the ranks) and "
            "``compute(totals)`` gives the value (:class:`~trainbus.SetMetric`; "
            ":class:`~trainbus.Perplexity`, :class:`~trainbus.TokenAccuracy`). One that raises "
            "is counted in ``FitResult.metric_failures`` and left out; the run goes on "
            '(docs/trainer.md, "Metrics of the whole set").',
        ),
    ]
    eval_every: Annotated[
        int | None,
        Option(
            None,
            checks.int_at_least(1, optional=True),
            "Also evaluate every N optimizer steps.",
        ),
    ]
    eval_at_epoch_end: Annotated[
        bool,
        Option(
            True,
            checks.boolean(),
            "Evaluate after each epoch (when ``eval_data`` is given).",
        ),
    ]
    eval_at_end: Annotated[
        bool,
        Option(
            True,
            checks.boolean(),
            "When the run completes (``max_steps`` or ``max_epochs`` reached) and its last step "
            'was not evaluated, evaluate the final weights once more (``trigger="end"``, '
            "before the final checkpoint), as Hugging Face does. Only when ``eval_every`` or "
            "``eval_at_epoch_end`` evaluates during the run; False: never.",
        ),
    ]
    log_every: Annotated[
        int,
        Option(
            50,
            checks.int_at_least(1),
            "Steps per ``MetricsLogged`` (one device read of the window's losses).",
        ),
    ]
    checkpoint_dir: Annotated[
        str | Path | None,
        Option(
            None,
            checks.checkpoint_dir,
            "Where ``SaveCheckpoint`` writes; a final checkpoint is written when a run "
            "completes or stops. Checked now (creatable, writable, not under a file), created "
            "at the first save (or when ``fit()`` starts, with ``attach`` listening there; "
            "removed at the end if still empty). Resume with ``fit(resume=...)``.",
        ),
    ]
    skip_final_checkpoint: Annotated[
        Iterable[ev.Ending | str],
        Option(
            (),
            checks.skip_final_checkpoint,
            'Stopped runs that write no final checkpoint: any of ``"stopped"``, '
            "``\"pruned\"`` (a pruner's stop: a sweep's pruned trials keep their disk and "
            'time), ``"signal"`` (:class:`~trainbus.events.Ending`). Default: none skipped.',
        ),
    ]
    callbacks: Annotated[
        Iterable[Callback | type[Callback]],
        Option(
            (),
            checks.callbacks,
            "Callback classes or instances (user tier). Stateful ones (overriding "
            "``state_dict``) need distinct ``state_key``s.",
        ),
    ]
    progress: Annotated[
        bool | None,
        Option(
            None,
            checks.progress,
            "Show a :class:`~trainbus.callbacks.Progress` bar: ``None`` (default) when stderr "
            "is a terminal on rank 0 (the ``RANK`` variable torchrun sets, default 0), ``True`` "
            "always, ``False`` never. A ``Progress`` in ``callbacks`` replaces it.",
        ),
    ]
    barriers: Annotated[
        Iterable[type[ev.BaseEvent]],
        Option(
            DEFAULT_BARRIERS,
            checks.barriers,
            "Event types at which the loop waits for subscribers before going on.",
            shown="`(EvaluationEnded, EpochEnded)`",
        ),
    ]
    barrier_timeout: Annotated[
        float,
        Option(
            60.0,
            checks.barrier_timeout,
            "Seconds the loop waits at a barrier.",
        ),
    ]
    on_nonfinite: Annotated[
        NonFinitePolicy,
        Option(
            "raise",
            checks.on_nonfinite,
            'A NaN/inf loss ``"raise"``s ``NonFiniteLossError`` (the run fails), '
            '``"stop"``s the run (no checkpoint of the bad state), ``"skip"``s that batch\'s '
            'update (counted in ``FitResult.skipped_nonfinite``), or is ``"ignore"``d. '
            "Checked every step (docs/trainer.md); a checkpoint never holds non-finite weights.",
        ),
    ]
    handle_signals: Annotated[
        bool,
        Option(
            True,
            checks.boolean(),
            "Turn SIGINT/SIGTERM into ``StopTraining`` during ``fit()`` / ``fit_sync()`` called on "
            "the main thread (a ``signal.signal`` handler, restored after; a signal the process "
            "ignores stays ignored).",
        ),
    ]
    on_signal: Annotated[
        OnSignal,
        Option(
            "raise",
            checks.on_signal,
            "After such a graceful stop (final checkpoint written, events delivered): "
            '``"raise"`` (default) lets the interrupt reach the caller, ``KeyboardInterrupt`` '
            "for SIGINT, ``SystemExit(143)`` for SIGTERM (``trainer.result`` holds the result, "
            '``ending == Ending.SIGNAL``); ``"return"`` returns the result instead.',
        ),
    ]
    bus: Annotated[
        EventBus | None,
        Option(
            None,
            checks.bus,
            "A preconfigured :class:`EventBus` (default: a new one).",
            shown="new",
        ),
    ]
    ddp: Annotated[
        bool | None,
        Option(
            None,
            checks.ddp,
            "Under ``torchrun`` with more than one rank, wrap the model in "
            "``DistributedDataParallel`` (a model already wrapped is left as it is). ``False`` "
            "for a model you parallelise yourself (a custom wrapper): trainbus then neither "
            "wraps it nor all-reduces its gradients (docs/distributed.md). None (the default): "
            "DDP, except for a model sharded with FSDP2 (``fully_shard``), which reduces its "
            "own gradients and is never wrapped; ``True`` for such a model is a "
            "``ConfigError``.",
        ),
    ]
    watchdog_s: Annotated[
        float | BusDefault | None,
        Option(
            BusDefault.DEFAULT,
            checks.as_given,
            "Seconds one call of a sync subscriber may block the event-loop thread before a "
            "warning names it, with its stack, while it blocks (default 5; None: no watchdog). "
            "The new bus' option (:class:`EventBus`); with ``bus=`` set it there.",
            shown="the bus': `5.0`",
        ),
    ]
    close_timeout: Annotated[
        float | BusDefault | None,
        Option(
            BusDefault.DEFAULT,
            checks.as_given,
            "Seconds the end of ``fit()`` waits for async subscribers' pending work before "
            "cancelling it (counted in ``FitResult.lost_work``; ``on_lost='raise'`` fails the "
            "run). "
            "Default 300: long enough for a real upload, short enough that a hung one cannot "
            "hold the job for hours. A ``bus_close_waiting`` warning names what is pending "
            "after 1 s and again every 30 s (every tenth of a shorter timeout). None: wait as "
            "long as it takes. The new bus' option (:class:`EventBus`); with ``bus=`` set it "
            "there.",
            shown="the bus': `300.0`",
        ),
    ]
    on_lost: Annotated[
        Literal["warn", "raise"],
        Option(
            "warn",
            checks.on_lost,
            "What lost work does to the run (items dropped by an overflow policy, cancelled at "
            'close, or failed; ``FitResult.lost_work``): ``"warn"`` (default) logs '
            '``bus_closed_with_lost_work`` naming them; ``"raise"`` also raises '
            ":class:`~trainbus.LostWorkError` from ``fit()`` once everything was delivered "
            "(``trainer.result`` holds the result).",
        ),
    ]
    attach: Annotated[
        bool | str | os.PathLike[str],
        Option(
            True,
            checks.attach,
            "Let other processes of your user attach to ``fit()`` (``trainbus attach "
            "RUN_DIR``, :func:`trainbus.attach`): rank 0 listens on ``attach.sock`` in the run "
            "folder, with ``attach.token`` beside it, both removed at the end. True (default): "
            "in ``checkpoint_dir`` when set (on platforms with Unix domain sockets); a folder: "
            "there; False: never. Free while nobody is attached (docs/attach.md).",
        ),
    ]


def _declared() -> tuple[dict[str, Option], dict[str, Any]]:
    hints = get_type_hints(TrainerOptions, include_extras=True)
    options: dict[str, Option] = {}
    types: dict[str, Any] = {}
    for name, hint in hints.items():
        bare, *meta = get_args(hint)
        (option,) = (m for m in meta if isinstance(m, Option))
        options[name], types[name] = option, bare
    return options, types


OPTIONS, _TYPES = _declared()
"""Every option's :class:`Option`, in declaration order (the signature's and the checks')."""

TRAINER_ONLY = frozenset({"callbacks", "progress", "handle_signals", "on_signal", "bus", "ddp",
                          "watchdog_s", "close_timeout", "on_lost", "attach"})  # fmt: skip
"""Options the Trainer itself reads; every other option is a :class:`Settings` field."""

_SETTINGS_FIELDS = frozenset(f.name for f in dataclasses.fields(Settings))


def check_options(given: Mapping[str, Any]) -> dict[str, Any]:
    """Every option checked, in declaration order, the defaults filled in.

    Args:
        given: The keyword options of the call.

    Returns:
        ``{name: the value the run uses}`` for every option.

    Raises:
        TypeError: a keyword that is no option (as Python says it, with the trainbus
            equivalent of a Hugging Face name, else the nearest option).
        ConfigError: the first option (in declaration order) whose value its check refuses.
    """
    for name in given:
        if name not in OPTIONS:
            hf = hf_hint(name)  # a Hugging Face habit: name what replaces it
            near = difflib.get_close_matches(name, OPTIONS, n=1)
            hint = f": {hf}" if hf else f" (did you mean {near[0]!r}?)" if near else ""
            raise TypeError(f"Trainer() got an unexpected keyword argument {name!r}{hint}")
    return {name: option.check(name, given.get(name, option.default))
            for name, option in OPTIONS.items()}  # fmt: skip


def build_settings(model: Any, optimizer: Any, train_data: Any, options: Mapping[str, Any]
                   ) -> Settings:  # fmt: skip
    """The loop's :class:`Settings`: the positional arguments checked, the checks of two
    options at once, and each checked option that is a ``Settings`` field, by its name.

    Args:
        model: The Trainer's ``model``.
        optimizer: Its ``optimizer`` (one, or a mapping of names to optimizers).
        train_data: Its ``train_data``.
        options: The options from :func:`check_options`.

    Raises:
        ConfigError: naming the first bad argument, its value and what is allowed.
    """
    if not isinstance(model, torch.nn.Module):
        raise ConfigError.invalid("model", type(model).__name__, "a torch.nn.Module")
    optimizer, optimizers = check_optimizers(model, optimizer)
    train_len = check_loader("train_data", train_data, optional=False)
    if options["max_epochs"] is None and options["max_steps"] is None:
        raise ConfigError.invalid("max_epochs", None, "set max_epochs or max_steps (or both)")
    scheduler, schedulers = check_schedulers(options["scheduler"], optimizers)
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
    if options["eval_every"] is not None and options["eval_data"] is None:
        raise ConfigError.invalid("eval_every", options["eval_every"],
                                  "None unless eval_data is given")  # fmt: skip
    sets, named = eval_sets(options["eval_data"])
    for name in options["set_metrics"]:
        if name == "loss" or name in options["metrics"]:
            raise ConfigError.invalid(
                f"set_metrics[{name!r}]", options["set_metrics"][name],
                f"a name that is neither 'loss' nor one of metrics= ({sorted(options['metrics'])}):"
                " both would be the same key in EvaluationEnded.metrics",
            )  # fmt: skip
    _check_passes(train_data, sets, named, options)
    loop_options = {k: v for k, v in options.items() if k in _SETTINGS_FIELDS}
    loop_options["scheduler"] = scheduler
    return Settings(
        **loop_options, model=model, optimizer=optimizer, train_data=train_data,
        train_len=train_len, eval_sets=sets, eval_named=named, optimizers=optimizers,
        schedulers=schedulers,
        scaler=torch.amp.GradScaler("cuda") if precision == "fp16" else None,
    )  # fmt: skip


def _check_passes(train_data: Any, sets: Iterable[tuple[str, Any]], named: bool,
                  options: Mapping[str, Any]) -> None:  # fmt: skip
    """Refuse a one-shot iterator where the run would iterate it twice: as ``eval_data`` (every
    evaluation is a new pass: the second would score nothing) or as ``train_data`` for more
    than one epoch. A generator training for one epoch, or for ``max_steps`` alone (a stream),
    is fine; spent before ``max_steps``, the run fails saying so (docs/trainer.md).

    Raises:
        ConfigError: naming the option and what to pass instead.
    """
    epochs = options["max_epochs"]
    if epochs is not None and epochs > 1:
        check_reiterable("train_data", train_data, f"max_epochs={epochs} makes a new pass "
                         "per epoch", alternative="; or keep it, leave max_epochs out and set "
                         "a max_steps within its one pass")  # fmt: skip
    for name, data in sets:
        check_reiterable(f"eval_data[{name!r}]" if named else "eval_data", data,
                         "each evaluation makes a new pass")  # fmt: skip


def new_bus(options: Mapping[str, Any]) -> EventBus:
    """The Trainer's bus: ``bus``, or a new one with the bus options the Trainer was given.

    Raises:
        ConfigError: a bus option is given with ``bus=`` (it belongs on that bus), or is out of
            range (the bus' own check).
    """
    bus_options = {name: options[name] for name in ("watchdog_s", "close_timeout")
                   if options[name] is not BusDefault.DEFAULT}  # fmt: skip
    bus: EventBus | None = options["bus"]
    if bus is None:
        return EventBus(**bus_options)
    for name, value in bus_options.items():
        raise ConfigError.invalid(name, value, f"left out when bus= is given (set it on the "
                                  f"bus: EventBus({name}=...))")  # fmt: skip
    return bus


def signature(init: Callable[..., Any]) -> inspect.Signature:
    """``init``'s signature with ``**options`` spelt out: one keyword-only parameter per option,
    with its default and type (what ``help(Trainer)`` and ``inspect.signature`` show)."""
    params = [p for p in inspect.signature(init).parameters.values()
              if p.kind is not inspect.Parameter.VAR_KEYWORD]  # fmt: skip
    params += [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option.default,
                                 annotation=_shown_type(_TYPES[name]))
               for name, option in OPTIONS.items()]  # fmt: skip
    return inspect.Signature(params, return_annotation=None)


def _shown_type(annotation: Any) -> str:
    """``annotation`` as written in the declaration (no ``collections.abc.``, ``typing.`` or
    ``trainbus.`` module paths)."""
    text = inspect.formatannotation(annotation)
    return re.sub(r"\b(?:collections\.abc|typing|trainbus(?:\.\w+)*)\.(?=\w)", "", text)


def options_doc(indent: int) -> str:
    """The options as a docstring's ``Args`` entries (``name: meaning``), indented."""
    pad = " " * indent
    return "\n".join(
        textwrap.fill(f"{name}: {option.doc}", 96 - indent, initial_indent=pad,
                      subsequent_indent=pad + "    ", break_on_hyphens=False)
        for name, option in OPTIONS.items()
    )  # fmt: skip

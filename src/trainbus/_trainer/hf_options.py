"""Other frameworks' option names, and trainbus' former ones, with what replaces each, for the
``TypeError`` of an unknown keyword (and docs/migration.md)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "HF_OPTIONS",
    "LIGHTNING_OPTIONS",
    "REMOVED_OPTIONS",
    "HfOption",
    "fit_hint",
    "option_hint",
]

Source = Literal["TrainingArguments", "Trainer", "EarlyStoppingCallback"]


@dataclass(frozen=True, slots=True)
class HfOption:
    """A Hugging Face option ``name`` (of ``source``; ``current``: still spelt so), what to
    write in trainbus instead (``use``, Markdown) and the ``option`` that replaces it, if any."""

    name: str
    use: str
    option: str | None = None
    source: Source = "TrainingArguments"
    current: bool = True

    @property
    def plain_use(self) -> str:
        """:attr:`use` without Markdown (for an error message)."""
        return self.use.replace("`", "")


_OPT = "the optimizer you build: "
_EVAL_STRATEGY = (
    '`eval_schedule=EvalSchedule(every_steps=N, epoch_end=False)` for `"steps"`, '
    '`EvalSchedule(epoch_end=True)` (the default, with `eval_data`) for `"epoch"`; no '
    '`eval_data` for `"no"`'
)


def _ckpt(args: str) -> str:
    return f"`callbacks=[Checkpointing({args})]`"


# fmt: off
HF_OPTIONS: tuple[HfOption, ...] = (
    HfOption("output_dir", "`checkpoint_dir=...`", "checkpoint_dir"),
    HfOption("overwrite_output_dir", "not needed: a run writes its own step-numbered files in "
             "`checkpoint_dir`", current=False),
    HfOption("num_train_epochs", "`max_epochs=N` (a whole number)", "max_epochs"),
    HfOption("max_steps", "`max_steps=N` (the same name)", "max_steps"),
    HfOption("per_device_train_batch_size", "pass a `DataLoader(dataset, batch_size=N, "
             "shuffle=True)` as `train_data` (under torchrun, N per rank)"),
    HfOption("per_device_eval_batch_size",
             "pass a `DataLoader(dataset, batch_size=N)` as `eval_data`"),
    HfOption("gradient_accumulation_steps", "`accumulate=N`; `accumulate=Accumulate(N, "
             "by=\"items\")` weighs the micro-batches by their labels as Hugging Face's "
             "`num_items_in_batch` does "
             "(a causal LM, whose loss shifts its labels: count `labels[..., 1:]`, "
             "docs/trainer.md#gradient-accumulation)",
             "accumulate"),
    HfOption("max_grad_norm", "`clip_grad_norm=...`", "clip_grad_norm"),
    HfOption("learning_rate", _OPT + "`torch.optim.AdamW(model.parameters(), lr=...)`"),
    HfOption("weight_decay", _OPT + "`torch.optim.AdamW(..., weight_decay=...)`"),
    HfOption("adam_beta1", _OPT + "`torch.optim.AdamW(..., betas=(b1, b2))`"),
    HfOption("adam_beta2", _OPT + "`torch.optim.AdamW(..., betas=(b1, b2))`"),
    HfOption("adam_epsilon", _OPT + "`torch.optim.AdamW(..., eps=...)`"),
    HfOption("optim", _OPT + "pass any `torch.optim.Optimizer` as `optimizer`"),
    HfOption("lr_scheduler_type", "`scheduler=...`, e.g. `transformers."
             "get_cosine_schedule_with_warmup(optimizer, warmup, total)` (stepped every "
             "optimizer step)", "scheduler"),
    HfOption("warmup_steps", "a scheduler with warmup as `scheduler=...`, e.g. `transformers."
             "get_linear_schedule_with_warmup(optimizer, warmup_steps, total_steps)`",
             "scheduler"),
    HfOption("warmup_ratio", "a scheduler with warmup as `scheduler=...` (warmup steps = "
             "ratio x total steps)", "scheduler", current=False),
    HfOption("fp16", '`precision="fp16"` (CUDA)', "precision"),
    HfOption("bf16", '`precision="bf16"`', "precision"),
    HfOption("use_cpu", '`device="cpu"`', "device"),
    HfOption("no_cuda", '`device="cpu"`', "device", current=False),
    HfOption("seed", "`seed=N` (the same name)", "seed"),
    HfOption("data_seed", "`seed=N` (also gives a shuffled DataLoader its data order)", "seed"),
    HfOption("logging_steps", "`log_every=N`", "log_every"),
    HfOption("logging_strategy", "`log_every=N` (steps); `MetricsLogged` every N steps",
             "log_every"),
    HfOption("logging_first_step", "subscribe to `StepEnded` (every step's loss, no device "
             "read) or `MetricsLogged`"),
    HfOption("logging_dir", "`callbacks=[TensorBoardLogger(log_dir)]`", current=False),
    HfOption("report_to", "`callbacks=[TensorBoardLogger(...)]`, `MLflowLogger(...)`, "
             "`WandbLogger(...)` or `JsonlEventLog(...)`", "callbacks"),
    HfOption("disable_tqdm", "`progress=False`", "progress"),
    HfOption("eval_strategy", _EVAL_STRATEGY, "eval_schedule"),
    HfOption("evaluation_strategy", _EVAL_STRATEGY, "eval_schedule", current=False),
    HfOption("eval_steps", "`eval_schedule=EvalSchedule(every_steps=N, epoch_end=False)` "
             "(`epoch_end=True`, the default, also evaluates at each epoch's end)",
             "eval_schedule"),
    HfOption("eval_on_start", "call `trainer.evaluate_sync()` before `fit_sync()`"),
    HfOption("eval_accumulation_steps", "not needed: `predict()` copies each batch's outputs "
             "to the host as it comes"),
    HfOption("save_steps", _ckpt("every_steps=N"), "callbacks"),
    HfOption("save_strategy", _ckpt("every_steps=N") + ' for `"steps"`, '
             '`Checkpointing(every_epochs=1)` for `"epoch"`', "callbacks"),
    HfOption("save_total_limit", _ckpt("keep_last=N") + "; with `monitor`, the `-best` files "
             "count apart: `keep_best=1` keeps one", "callbacks"),
    HfOption("load_best_model_at_end", _ckpt('monitor="val_loss", load_best_at_end=True'),
             "callbacks"),
    HfOption("metric_for_best_model", _ckpt('monitor="val_<metric>"') + ", "
             '`EarlyStopping(monitor="val_<metric>")`', "callbacks"),
    HfOption("greater_is_better", '`mode="max"` of `Checkpointing` / `EarlyStopping` in '
             "`callbacks=[...]`", "callbacks"),
    HfOption("early_stopping_patience", "`callbacks=[EarlyStopping(monitor, patience=N)]`",
             "callbacks", source="EarlyStoppingCallback"),
    HfOption("resume_from_checkpoint", '`trainer.fit(resume="latest")` or `fit(resume=path)`'),
    HfOption("dataloader_num_workers", "pass a `DataLoader(..., num_workers=N)`"),
    HfOption("dataloader_drop_last", "pass a `DataLoader(..., drop_last=True)`"),
    HfOption("dataloader_pin_memory", "pass a `DataLoader(..., pin_memory=True)`"),
    HfOption("gradient_checkpointing", "`model.gradient_checkpointing_enable()` before "
             "building the Trainer"),
    HfOption("torch_compile", "`model = torch.compile(model)` before building the Trainer"),
    HfOption("label_smoothing_factor", "`loss_fn=lambda out, y: F.cross_entropy(out, y, "
             "label_smoothing=...)`", "loss_fn"),
    HfOption("do_train", "call `trainer.fit_sync()`"),
    HfOption("do_eval", "call `trainer.evaluate_sync()`, or give `eval_data`", "eval_data"),
    HfOption("do_predict", "call `trainer.predict_sync(data)`"),
    HfOption("local_rank", "run under `torchrun`: trainbus reads the rank from its variables"),
    HfOption("args", "keyword options of `Trainer` itself, one per `TrainingArguments` field "
             "you set (docs/migration.md)", source="Trainer"),
    HfOption("train_dataset", "pass a `DataLoader` over it as `train_data` (the third "
             "positional argument)", source="Trainer"),
    HfOption("eval_dataset", "`eval_data=DataLoader(...)` (or a mapping of set names to "
             "loaders)", "eval_data", source="Trainer"),
    HfOption("data_collator", "pass a `DataLoader(..., collate_fn=...)`", source="Trainer"),
    HfOption("compute_metrics", '`metrics={"acc": fn(outputs, targets)}` (averaged over '
             'samples), or `set_metrics={"ppl": Perplexity()}` for a metric of the whole set',
             "metrics", source="Trainer"),
    HfOption("optimizers", "pass the optimizer as `optimizer` (second positional argument) and "
             "`scheduler=...`", "scheduler", source="Trainer"),
    HfOption("model_init", "build the model and pass it as `model`", source="Trainer"),
    HfOption("processing_class", "not needed: tokenize in your dataset or collate_fn",
             source="Trainer"),
)
# fmt: on
"""Every Hugging Face name trainbus knows, with its trainbus equivalent."""

_BY_NAME = {o.name: o for o in HF_OPTIONS}


def _signals(value: Any) -> str:
    if value is False:
        return "on_signal=None (no signal handler)"
    return "on_signal='raise' (the default) or 'return'; on_signal=None for no signal handler"


def _interval(value: Any) -> str:
    if value == "epoch":
        return "scheduler=PerEpoch(scheduler) (stepped once per epoch)"
    return "scheduler=scheduler (stepped every optimizer step, the default)"


REMOVED_OPTIONS: dict[str, tuple[str, Callable[[Any], str]]] = {
    "eval_every": ("eval_schedule", lambda v: f"eval_schedule=EvalSchedule(every_steps={v!r})"),
    "eval_at_epoch_end": (
        "eval_schedule",
        lambda v: f"eval_schedule=EvalSchedule(epoch_end={v!r})",
    ),
    "eval_at_end": ("eval_schedule", lambda v: f"eval_schedule=EvalSchedule(at_end={v!r})"),
    "handle_signals": ("on_signal", _signals),
    "scheduler_interval": ("scheduler", _interval),
    "accumulate_by": ("accumulate", lambda v: f"accumulate=Accumulate(micro_batches, by={v!r})"),
    "skip_final_checkpoint": (
        "checkpoint_dir",
        lambda v: f"checkpoint_dir=CheckpointDir(path, skip_final={v!r})",
    ),
}
"""Former Trainer options (the bus' own are named by ``options.unknown_option_message``):
``{name: (the option that replaces it, value -> what to write instead)}``."""


LIGHTNING_OPTIONS: dict[str, tuple[str, str]] = {
    "accumulate_grad_batches": ("accumulate", "accumulate=N"),
    "gradient_clip_val": ("clip_grad_norm", "clip_grad_norm=..."),
    "val_check_interval": ("eval_schedule", "eval_schedule=EvalSchedule(every_steps=N)"),
    "check_val_every_n_epoch": (
        "eval_schedule",
        "eval_schedule=EvalSchedule(epoch_end=True) evaluates at every epoch's end; for every "
        "N epochs, send commands.Evaluate() from a subscriber of EpochEnded",
    ),
    "default_root_dir": ("checkpoint_dir", "checkpoint_dir=..."),
    "enable_checkpointing": ("callbacks", "callbacks=[Checkpointing(...)] with checkpoint_dir="),
    "enable_progress_bar": ("progress", "progress=True or False"),
    "log_every_n_steps": ("log_every", "log_every=N"),
    "accelerator": ("device", "device='cuda', 'mps', 'cpu' or 'auto'"),
    "devices": ("device", "device=...; several GPUs: run under torchrun (docs/distributed.md)"),
    "strategy": ("ddp", "ddp=None (DDP under torchrun, FSDP2 models left as they are)"),
    "max_time": (
        "callbacks",
        "callbacks=[TimeLimit(seconds)] (trainbus.callbacks.TimeLimit: a checkpoint, then a "
        "stop before the limit)",
    ),
}
"""Lightning's ``Trainer`` options trainbus spells otherwise: ``{name: (option, use)}``."""


def option_hint(name: str, value: Any) -> str | None:
    """What replaces ``name=value`` (a Hugging Face, Lightning or former option), or None."""
    if name in _BY_NAME:
        hf = _BY_NAME[name]
        return f"that is Hugging Face's {hf.source}.{name}; in trainbus: {hf.plain_use}"
    if name in LIGHTNING_OPTIONS:
        return f"that is Lightning's Trainer.{name}; in trainbus: {LIGHTNING_OPTIONS[name][1]}"
    if name in REMOVED_OPTIONS:
        return f"{name} is no Trainer option now; in trainbus: {REMOVED_OPTIONS[name][1](value)}"
    return None


FIT_OPTIONS = {
    "ckpt_path": "Lightning's Trainer.fit(ckpt_path=...)",
    "resume_from_checkpoint": "Hugging Face's Trainer.train(resume_from_checkpoint=...)",
}
"""Other frameworks' keywords of their ``fit`` that ``fit(resume=...)`` replaces."""


def fit_hint(name: str, value: Any) -> str | None:
    """What replaces the keyword ``name=value`` of another framework's ``fit``, or None."""
    source = FIT_OPTIONS.get(name)
    if source is None:
        return None
    latest = value is True or value == "last"
    resume = "'latest'" if latest else repr(value) if isinstance(value, str) else "<path>"
    return f"that is {source}; in trainbus: fit(resume={resume}) (a path or 'latest')"

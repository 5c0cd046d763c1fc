"""The Trainer's options are declared once (``trainbus._trainer.options.TrainerOptions``): the
signature users see, the checks, the loop's ``Settings`` and docs/trainer.md's option table all
come from, or are held to, that one declaration, so none of them can drift from it.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import re
from pathlib import Path
from typing import Any, Unpack, get_type_hints

import pytest
import torch

from trainbus import ConfigError, EventBus, Trainer
from trainbus import events as ev
from trainbus._loop import Settings
from trainbus._trainer import checks
from trainbus._trainer.hf_options import HF_OPTIONS, HfOption
from trainbus._trainer.options import OPTIONS, TRAINER_ONLY, BusDefault, check_options
from trainbus._trainer.trainer import TrainerOptions
from trainbus.testing import tiny_loader, tiny_model

DOCS = Path(__file__).resolve().parents[2] / "docs" / "trainer.md"
POSITIONAL = ["model", "optimizer", "train_data"]
DERIVED = {"model", "optimizer", "train_data", "train_len", "scaler", "eval_sets", "eval_named",
           "optimizers", "schedulers"}  # fmt: skip
"""Settings fields built from the positional arguments or from several options."""


def table_rows(text: str) -> list[tuple[str, str]]:
    """``(option, default)`` of each keyword row of the Options table (positional rows left
    out), in order."""
    section = text.split("## Options", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(\w+)`( \(positional\))? \| (.*?) \| .* \|$", section, re.M)
    return [(name, default) for name, positional, default in rows if not positional]


def _trainer(**options: Any) -> Trainer:
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    options.setdefault("max_steps", 1)
    return Trainer(model, opt, tiny_loader(batches=2), progress=False, **options)


def test_the_signature_is_the_declaration() -> None:
    params = inspect.signature(Trainer).parameters
    assert list(params)[:3] == POSITIONAL
    keywords = {n: p for n, p in params.items() if n not in POSITIONAL}
    assert list(keywords) == list(OPTIONS), "help(Trainer) lists the declared options, in order"
    for name, p in keywords.items():
        assert p.kind is inspect.Parameter.KEYWORD_ONLY, name
        assert p.default is OPTIONS[name].default or p.default == OPTIONS[name].default, name
    # The real __init__ takes **options typed by the declaration: mypy and IDEs check a call's
    # keywords against TrainerOptions (one spelling of each option, nowhere else).
    code = Trainer.__init__.__code__
    assert code.co_varnames[: code.co_argcount] == ("self", *POSITIONAL)
    assert code.co_flags & inspect.CO_VARKEYWORDS
    hints = get_type_hints(Trainer.__init__)
    assert hints["options"] == Unpack[TrainerOptions]
    assert list(get_type_hints(TrainerOptions)) == list(OPTIONS)


def test_help_shows_every_option_and_its_meaning() -> None:
    doc = inspect.getdoc(Trainer) or ""
    options_part = doc.split("\nOptions:\n", 1)[1]
    listed = re.findall(r"^    (\w+): ", options_part, re.M)
    assert listed == list(OPTIONS)
    flat = " ".join(options_part.split())
    for name, option in OPTIONS.items():
        assert f"{name}: {' '.join(option.doc.split())}" in flat, name


def test_the_docs_table_is_the_declaration() -> None:
    rows = table_rows(DOCS.read_text())
    assert [name for name, _ in rows] == list(OPTIONS), "docs/trainer.md's table: one row per "
    "option, in the declaration's order"
    for name, default in rows:
        assert default == OPTIONS[name].default_text, (name, default)


def test_the_table_check_bites() -> None:
    text = DOCS.read_text()
    assert len(table_rows(text)) == len(OPTIONS)  # the parser sees the rows
    dropped = text.replace("| `log_every` | `50` |", "| `log_every` | `100` |")
    assert dropped != text
    assert dict(table_rows(dropped))["log_every"] != OPTIONS["log_every"].default_text


def test_the_bus_options_show_the_bus_defaults() -> None:
    bus_params = inspect.signature(EventBus).parameters
    for name in ("watchdog_s", "close_timeout"):
        assert OPTIONS[name].default is BusDefault.DEFAULT
        assert f"`{bus_params[name].default!r}`" in OPTIONS[name].default_text, name


def test_every_option_is_a_settings_field_or_the_trainers_own() -> None:
    fields = {f.name for f in dataclasses.fields(Settings)}
    assert set(OPTIONS) - fields == TRAINER_ONLY
    assert fields == (set(OPTIONS) - TRAINER_ONLY) | DERIVED


def test_settings_come_from_the_checked_options() -> None:
    given = dict(accumulate=2, log_every=3, clip_grad_norm=1, seed=4, eval_every=2,
                 eval_data=tiny_loader(batches=1), eval_at_end=False, barrier_timeout=5,
                 on_nonfinite="skip", scheduler_interval="epoch", precision="32-true",
                 skip_final_checkpoint={"pruned"}, barriers=[ev.EpochEnded])  # fmt: skip
    s = _trainer(**given).settings
    checked = check_options({"max_steps": 1, "progress": False, **given})
    for name in set(OPTIONS) - TRAINER_ONLY - {"device"}:
        assert getattr(s, name) == checked[name], name
    assert s.precision == "32" and s.clip_grad_norm == 1.0 and isinstance(s.clip_grad_norm, float)
    assert s.skip_final_checkpoint == frozenset({ev.Ending.PRUNED})
    assert s.barriers == frozenset({ev.EpochEnded}) and s.barrier_timeout == 5.0


def test_every_default_passes_its_own_check() -> None:
    checked = check_options({})
    assert list(checked) == list(OPTIONS)


def test_a_misspelt_option_is_a_type_error_naming_the_nearest() -> None:
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'max_step' \(did you mean "
                       r"'max_steps'\?\)"):  # fmt: skip
        _trainer(max_step=3)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'zzz'$"):
        _trainer(zzz=3)


HF_UNKNOWN = [o for o in HF_OPTIONS if o.name not in OPTIONS]


@pytest.mark.parametrize("hf", HF_UNKNOWN, ids=[o.name for o in HF_UNKNOWN])
def test_a_hugging_face_option_name_is_a_type_error_naming_the_trainbus_one(hf: HfOption
                                                                           ) -> None:  # fmt: skip
    with pytest.raises(TypeError) as info:
        _trainer(**{hf.name: 1})
    message = str(info.value)
    assert message.startswith(
        f"Trainer() got an unexpected keyword argument {hf.name!r}: "
        f"that is Hugging Face's {hf.source}.{hf.name}; in trainbus: "
    )
    assert message.endswith(hf.plain_use) and "`" not in message
    if hf.option is not None:
        assert hf.option in message


def test_the_hugging_face_table_names_real_options() -> None:
    names = [o.name for o in HF_OPTIONS]
    assert len(names) == len(set(names))
    for hf in HF_OPTIONS:
        assert hf.option is None or hf.option in OPTIONS, hf
        # A name trainbus shares (max_steps, seed) means the same there.
        assert hf.name not in OPTIONS or hf.option == hf.name, hf
    for name in ("gradient_accumulation_steps", "max_grad_norm", "num_train_epochs",
                 "per_device_train_batch_size", "learning_rate", "logging_steps", "eval_steps",
                 "save_steps", "warmup_steps", "fp16", "bf16", "output_dir", "eval_strategy",
                 "evaluation_strategy", "save_total_limit", "load_best_model_at_end",
                 "metric_for_best_model", "greater_is_better", "seed", "report_to",
                 "dataloader_num_workers", "early_stopping_patience"):  # fmt: skip
        assert name in names, name


@pytest.mark.slow
@pytest.mark.timeout(600)  # importing transformers takes over a minute on a loaded machine
def test_the_hugging_face_names_are_its_own() -> None:
    transformers = pytest.importorskip("transformers")
    fields = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    trainer_args = set(inspect.signature(transformers.Trainer).parameters)
    patience = set(inspect.signature(transformers.EarlyStoppingCallback).parameters)
    for hf in HF_OPTIONS:
        if hf.source == "TrainingArguments":
            assert (hf.name in fields) == hf.current, hf.name  # an older spelling: gone
        else:
            assert hf.name in (trainer_args if hf.source == "Trainer" else patience), hf.name


# One refused value per option: every declared check refuses something, naming its option.
REFUSED: dict[str, Any] = {
    "train_step": 3, "loss_fn": "mse", "eval_data": "val", "max_epochs": 0, "max_steps": 0,
    "scheduler_interval": "batch", "accumulate": 0, "accumulate_by": "tokens",
    "clip_grad_norm": math.nan,
    "precision": "16", "device": "gpu", "seed": -1, "metrics": [1], "set_metrics": [1],
    "eval_every": 0,
    "eval_at_epoch_end": 1, "eval_at_end": "yes", "log_every": 0,
    "checkpoint_dir": Path(__file__), "skip_final_checkpoint": "pruned", "callbacks": [3],
    "progress": "auto", "barriers": [ev.FitEnded], "barrier_timeout": 0,
    "on_nonfinite": "warn", "handle_signals": None, "on_signal": "exit", "bus": object(),
    "ddp": "yes", "on_lost": "ignore", "attach": 3,
}  # fmt: skip
CHECKED_ELSEWHERE = {"scheduler": "check_schedulers, with the optimizers",
                     "watchdog_s": "EventBus", "close_timeout": "EventBus"}  # fmt: skip


def test_every_option_has_a_check_or_says_who_checks_it() -> None:
    unchecked = {n for n, o in OPTIONS.items() if o.check is checks.as_given}
    assert unchecked == set(CHECKED_ELSEWHERE)
    assert set(REFUSED) == set(OPTIONS) - unchecked


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_each_check_refuses_naming_its_option(name: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{re.escape(name)}\b"):
        check_options({name: REFUSED[name]})


@pytest.mark.parametrize(("name", "value"), [("scheduler", 3), ("watchdog_s", -1.0),
                                             ("close_timeout", "x")])  # fmt: skip
def test_the_options_checked_elsewhere_are_checked(name: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=name):
        _trainer(**{name: value})

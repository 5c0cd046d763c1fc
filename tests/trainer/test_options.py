"""The Trainer's options are declared once, in ``Trainer.__init__``'s keyword-only signature (its
type and default) and docstring (its meaning): ``inspect.signature``, ``help()``, mypy and an
IDE read it as written. Each option's check (``trainbus._trainer.options.CHECKS``), the loop's
``Settings``, docs/trainer.md's option table and the ``TypeError`` for a removed or Hugging Face
name are held to it here; the groups of related options (``EvalSchedule``, ``Accumulate``,
``CheckpointDir``, ``PerEpoch``) and ``Callback``'s ``SubscribeOptions`` validate themselves.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, ClassVar

import anyio
import pytest
import torch

from trainbus import (
    Accumulate,
    Callback,
    CheckpointDir,
    ConfigError,
    EvalSchedule,
    EventBus,
    PerEpoch,
    Trainer,
)
from trainbus import events as ev
from trainbus._loop import Settings
from trainbus._trainer import options as options_module
from trainbus._trainer.hf_options import HF_OPTIONS, LIGHTNING_OPTIONS, REMOVED_OPTIONS, HfOption
from trainbus._trainer.options import CHECKS, check_options
from trainbus.callbacks import SubscribeOptions
from trainbus.testing import tiny_loader, tiny_model

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "trainer.md"
POSITIONAL = ["model", "optimizer", "train_data"]
PARAMS = inspect.signature(Trainer).parameters
OPTIONS = {n: p for n, p in PARAMS.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
"""The keyword options as the signature declares them, in order."""


def shown(default: Any) -> str:
    """A default as docs/trainer.md's option table writes it."""
    if isinstance(default, str):
        return f'`"{default}"`'
    if dataclasses.is_dataclass(default) and default == type(default)():
        return f"`{type(default).__name__}()`"
    return f"`{default!r}`"


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


def test_the_signature_is_written_out() -> None:
    assert list(PARAMS)[:3] == POSITIONAL
    assert list(PARAMS) == POSITIONAL + list(OPTIONS)
    assert all(p.default is not inspect.Parameter.empty for p in OPTIONS.values())
    assert 20 <= len(OPTIONS) <= 24, "about 22 options: group related ones, not more"
    # Declared in the source, not generated: the function Python runs has every option as a
    # keyword-only parameter and no **kwargs; nothing sets a __signature__ or the docstring.
    init = inspect.unwrap(Trainer.__init__)
    code = init.__code__
    assert code.co_varnames[: code.co_argcount] == ("self", *POSITIONAL)
    assert code.co_varnames[code.co_argcount : code.co_argcount + code.co_kwonlyargcount] == (
        tuple(OPTIONS)
    )
    assert not code.co_flags & inspect.CO_VARKEYWORDS
    assert "__signature__" not in vars(Trainer) and "__signature__" not in vars(init)
    assert not hasattr(Trainer.__init__, "__signature__")
    source = inspect.getsource(options_module) + inspect.getsource(sys.modules[Trainer.__module__])
    assert "__signature__" not in source and "Unpack[" not in source and "TypedDict" not in source


def test_help_shows_every_option_and_its_meaning() -> None:
    doc = inspect.getdoc(Trainer) or ""
    args = doc.split("\nArgs:\n", 1)[1].split("\nRaises:\n", 1)[0]
    assert re.findall(r"^    (\w+): ", args, re.M) == list(PARAMS)
    assert Trainer.__doc__ is vars(Trainer)["__doc__"]  # the class' own, as written


def test_every_option_has_its_check_in_the_signatures_order() -> None:
    assert list(CHECKS) == list(OPTIONS)


def test_every_default_passes_its_own_check() -> None:
    checked = check_options({n: p.default for n, p in OPTIONS.items()})
    assert list(checked) == list(OPTIONS)
    assert checked["accumulate"] == Accumulate(1) and checked["checkpoint_dir"] is None
    assert checked["eval_schedule"] == EvalSchedule() and checked["on_signal"] == "raise"


def test_settings_declare_no_default_of_their_own() -> None:
    for f in dataclasses.fields(Settings):
        assert f.default is dataclasses.MISSING, f.name
        assert f.default_factory is dataclasses.MISSING, f.name


def test_the_docs_table_is_the_signature() -> None:
    rows = table_rows(DOCS.read_text())
    assert [name for name, _ in rows] == list(OPTIONS), "docs/trainer.md's table: one row per "
    "option, in the signature's order"
    for name, default in rows:
        assert default == shown(OPTIONS[name].default), (name, default)


def test_the_table_check_bites() -> None:
    text = DOCS.read_text()
    assert len(table_rows(text)) == len(OPTIONS)  # the parser sees the rows
    dropped = text.replace("| `log_every` | `50` |", "| `log_every` | `100` |")
    assert dropped != text
    assert dict(table_rows(dropped))["log_every"] != shown(OPTIONS["log_every"].default)


def test_settings_come_from_the_options_and_their_groups(tmp_path: Path) -> None:
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    bus = EventBus(barriers=[ev.EpochEnded], barrier_timeout=5)
    trainer = Trainer(model, opt, tiny_loader(batches=2), max_steps=1, progress=False,
                      eval_data=tiny_loader(batches=1), log_every=3, clip_grad_norm=1, seed=4,
                      eval_schedule=EvalSchedule(every_steps=2, epoch_end=False, at_end=False),
                      accumulate=Accumulate(2, by="items"), scheduler=PerEpoch(sched),
                      checkpoint_dir=CheckpointDir(tmp_path / "run", skip_final={"pruned"}),
                      on_nonfinite="skip", precision="32-true", bus=bus)  # fmt: skip
    s = trainer.settings
    assert (s.eval_every, s.eval_at_epoch_end, s.eval_at_end) == (2, False, False)
    assert (s.accumulate, s.accumulate_by) == (2, "items")
    assert s.scheduler is sched and s.scheduler_interval == "epoch"
    assert s.checkpoint_dir == tmp_path / "run"
    assert s.skip_final_checkpoint == frozenset({ev.Ending.PRUNED})
    assert s.barriers == frozenset({ev.EpochEnded}) and trainer.bus.barrier_timeout == 5.0
    assert s.precision == "32" and s.clip_grad_norm == 1.0 and s.log_every == 3 and s.seed == 4
    assert s.on_nonfinite == "skip"
    plain = _trainer(accumulate=3, checkpoint_dir=tmp_path / "plain", scheduler=None).settings
    assert (plain.accumulate, plain.accumulate_by) == (3, "batches")
    assert plain.checkpoint_dir == tmp_path / "plain" and plain.skip_final_checkpoint == set()
    assert plain.scheduler_interval == "step" and plain.barriers == {ev.EvaluationEnded,
                                                                      ev.EpochEnded}  # fmt: skip


def test_a_misspelt_option_is_a_type_error_naming_the_nearest() -> None:
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'max_step' \(did you mean "
                       r"'max_steps'\?\)"):  # fmt: skip
        _trainer(max_step=3)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'zzz'$"):
        _trainer(zzz=3)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_mypy_catches_a_misspelt_option(tmp_path: Path) -> None:
    mypy = shutil.which("mypy", path=str(Path(sys.executable).parent))
    if mypy is None:
        pytest.skip("mypy is not installed")
    snippet = tmp_path / "typed_call.py"
    snippet.write_text(textwrap.dedent("""\
        import torch
        from trainbus import EvalSchedule, Trainer

        model = torch.nn.Linear(2, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        Trainer(model, opt, [], max_steps=3, eval_schedule=EvalSchedule(every_steps=2))
        Trainer(model, opt, [], max_step=3)
        Trainer(model, opt, [], max_steps="3")
        Trainer(model, opt, [], eval_every=2)
    """))  # fmt: skip
    run = subprocess.run(
        [mypy, "--strict", "--no-error-summary", "--follow-imports=silent",
         "--cache-dir", str(ROOT / ".mypy_cache"), str(snippet)],
        capture_output=True, text=True, cwd=ROOT, timeout=540,
    )  # fmt: skip
    errors = [line for line in run.stdout.splitlines() if ": error:" in line]
    lines = {int(line.split(":")[1]) for line in errors}
    assert lines == {7, 8, 9}, run.stdout + run.stderr
    assert 'Unexpected keyword argument "max_step"' in run.stdout
    assert 'Unexpected keyword argument "eval_every"' in run.stdout


@pytest.mark.parametrize("name", sorted(REMOVED_OPTIONS))
def test_a_removed_option_name_is_a_type_error_naming_its_replacement(name: str) -> None:
    assert name not in PARAMS
    replacement, _ = REMOVED_OPTIONS[name]
    assert replacement in OPTIONS, name
    value = {"handle_signals": False, "scheduler_interval": "epoch"}.get(name, 5)
    with pytest.raises(TypeError) as info:
        _trainer(**{name: value})
    message = str(info.value)
    assert message.startswith(
        f"Trainer() got an unexpected keyword argument {name!r}: "
        f"{name} is no Trainer option now; in trainbus: "
    ), message
    assert f"{replacement}=" in message, message


@pytest.mark.parametrize(
    ("given", "says"),
    [
        ({"eval_every": 100}, "eval_schedule=EvalSchedule(every_steps=100)"),
        ({"eval_at_epoch_end": False}, "eval_schedule=EvalSchedule(epoch_end=False)"),
        ({"eval_at_end": False}, "eval_schedule=EvalSchedule(at_end=False)"),
        ({"handle_signals": False}, "on_signal=None"),
        ({"scheduler_interval": "epoch"}, "scheduler=PerEpoch(scheduler)"),
        ({"accumulate_by": "items"}, "accumulate=Accumulate(micro_batches, by='items')"),
        ({"skip_final_checkpoint": {"pruned"}},
         "checkpoint_dir=CheckpointDir(path, skip_final={'pruned'})"),
    ],
)  # fmt: skip
def test_a_removed_option_says_the_spelling_that_replaces_it(given: dict[str, Any],
                                                             says: str) -> None:  # fmt: skip
    with pytest.raises(TypeError) as info:
        _trainer(**given)
    assert f"in trainbus: {says}" in str(info.value)


HF_UNKNOWN = [o for o in HF_OPTIONS if o.name not in PARAMS]


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
    assert not set(names) & set(REMOVED_OPTIONS)
    for hf in HF_OPTIONS:
        assert hf.option is None or hf.option in OPTIONS, hf
        # A name trainbus shares (max_steps, seed) means the same there.
        assert hf.name not in PARAMS or hf.option == hf.name, hf
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


# One refused value per option: every check refuses something, naming its option.
REFUSED: dict[str, Any] = {
    "train_step": 3, "loss_fn": "mse", "eval_data": "val", "max_epochs": 0, "max_steps": 0,
    "accumulate": 0, "clip_grad_norm": math.nan, "precision": "16", "device": "gpu",
    "seed": -1, "metrics": [1], "set_metrics": [1], "eval_schedule": {"every_steps": 2},
    "log_every": 0, "checkpoint_dir": Path(__file__), "callbacks": [3], "progress": "auto",
    "on_nonfinite": "warn", "on_signal": "exit", "bus": object(), "ddp": "yes", "attach": 3,
    "trace": {"forward", "loss"},
}  # fmt: skip
CHECKED_ELSEWHERE = {
    "scheduler": "check_schedulers, with the optimizers",
    "eval_data": "build_settings, with the model",
    "ddp": "check_ddp, with the model",
    "attach": "attach_folder, with checkpoint_dir",
}


def test_every_option_has_a_refused_value_or_says_who_checks_it() -> None:
    assert set(REFUSED) | set(CHECKED_ELSEWHERE) == set(OPTIONS)


@pytest.mark.parametrize("name", sorted(set(REFUSED) - set(CHECKED_ELSEWHERE)))
def test_each_check_refuses_naming_its_option(name: str) -> None:
    given = {n: p.default for n, p in OPTIONS.items()} | {name: REFUSED[name]}
    with pytest.raises(ConfigError, match=rf"^{re.escape(name)}\b"):
        check_options(given)


@pytest.mark.parametrize("name", sorted(set(REFUSED) & set(CHECKED_ELSEWHERE)))
def test_an_option_checked_elsewhere_is_refused_by_the_trainer(name: str) -> None:
    assert check_options({n: p.default for n, p in OPTIONS.items()} | {name: REFUSED[name]})
    with pytest.raises(ConfigError, match=rf"^{re.escape(name)}\b"):
        _trainer(**{name: REFUSED[name]})


def test_the_scheduler_is_checked_with_the_optimizers() -> None:
    with pytest.raises(ConfigError, match=r"^scheduler="):
        _trainer(scheduler=3)
    with pytest.raises(ConfigError, match=r"^scheduler="):
        _trainer(scheduler=PerEpoch(3))


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda p: EvalSchedule(every_steps=0), "EvalSchedule.every_steps"),
        (lambda p: EvalSchedule(every_steps=True), "EvalSchedule.every_steps"),
        (lambda p: EvalSchedule(epoch_end=1), "EvalSchedule.epoch_end"),
        (lambda p: EvalSchedule(at_end="yes"), "EvalSchedule.at_end"),
        (lambda p: Accumulate(0), "Accumulate.micro_batches"),
        (lambda p: Accumulate(2.5), "Accumulate.micro_batches"),
        (lambda p: Accumulate(2, by="tokens"), "Accumulate.by"),
        (lambda p: CheckpointDir(5), "CheckpointDir.path"),
        (lambda p: CheckpointDir(Path(__file__)), "checkpoint_dir"),  # a file, not a folder
        (lambda p: CheckpointDir(p, skip_final="pruned"), "CheckpointDir.skip_final"),
        (lambda p: CheckpointDir(p, skip_final=["completed"]), "CheckpointDir.skip_final"),
        (lambda p: SubscribeOptions(overflow="drop"), "SubscribeOptions.overflow"),
        (lambda p: SubscribeOptions(concurrency=0), "SubscribeOptions.concurrency"),
        (lambda p: SubscribeOptions(buffer=0), "SubscribeOptions.buffer"),
        (lambda p: SubscribeOptions(on_error="ignore"), "SubscribeOptions.on_error"),
        (lambda p: SubscribeOptions(decides=1), "SubscribeOptions.decides"),
        (lambda p: EventBus(barriers=[ev.FitStarted]), "barriers"),
        (lambda p: EventBus(barriers=5), "barriers"),
        (lambda p: EventBus(barrier_timeout=0), "barrier_timeout"),
        (lambda p: EventBus(barrier_timeout=math.nan), "barrier_timeout"),
        (lambda p: EventBus(on_lost="ignore"), "on_lost"),
    ],
)  # fmt: skip
def test_a_group_refuses_a_bad_field_naming_it(build: Any, field: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=rf"^{re.escape(field)}="):
        build(tmp_path)


def test_the_groups_are_frozen_values() -> None:
    schedule = EvalSchedule(every_steps=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        schedule.every_steps = 3  # type: ignore[misc]
    assert schedule == EvalSchedule(every_steps=2) and hash(schedule) == hash(
        EvalSchedule(every_steps=2)
    )


def test_callback_subscribe_options_have_subscribe_asyncs_names_and_defaults() -> None:
    subscribe = inspect.signature(EventBus.subscribe_async).parameters
    options = SubscribeOptions()
    for f in dataclasses.fields(SubscribeOptions):
        assert f.name in subscribe, f.name
        assert getattr(options, f.name) == subscribe[f.name].default, f.name
    assert Callback.subscribe_options == options
    for old in ("error_policy", "overflow", "buffer", "concurrency", "decides"):
        assert not hasattr(Callback, old), old


def test_a_callbacks_subscribe_options_reach_its_subscriptions(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Slow(Callback):
        subscribe_options = SubscribeOptions(overflow="latest", buffer=1, decides=True,
                                             on_error="raise", concurrency=2)  # fmt: skip

        async def on_step_ended(self, event: ev.StepEnded) -> None:
            return None

        def on_epoch_ended(self, event: ev.EpochEnded) -> None:
            return None

    bus = EventBus()
    made: dict[str, dict[str, Any]] = {}
    for method in ("subscribe", "subscribe_async"):
        real = getattr(bus, method)

        def spy(*args: Any, _real: Any = real, **kwargs: Any) -> Any:
            made[kwargs["name"]] = kwargs
            return _real(*args, **kwargs)

        monkeypatch.setattr(bus, method, spy)
    Slow().subscribe_to(bus)
    assert made["Slow.on_step_ended"] == {"concurrency": 2, "buffer": 1, "overflow": "latest",
                                          "on_error": "raise", "decides": True,
                                          "name": "Slow.on_step_ended"}  # fmt: skip
    assert made["Slow.on_epoch_ended"] == {"on_error": "raise", "name": "Slow.on_epoch_ended"}


def test_a_callback_with_subscribe_options_of_another_type_is_refused() -> None:
    class Wrong(Callback):
        subscribe_options: ClassVar[Any] = {"overflow": "block"}

    with pytest.raises(ConfigError, match=r"^Wrong\.subscribe_options="):
        Wrong().subscribe_to(EventBus())


@pytest.mark.parametrize("name", sorted(LIGHTNING_OPTIONS))
def test_a_lightning_option_name_is_a_type_error_naming_the_trainbus_one(name: str) -> None:
    option, use = LIGHTNING_OPTIONS[name]
    assert name not in PARAMS and option in PARAMS
    with pytest.raises(TypeError) as info:
        _trainer(**{name: 1})
    assert str(info.value) == (f"Trainer() got an unexpected keyword argument {name!r}: that is "
                               f"Lightning's Trainer.{name}; in trainbus: {use}")  # fmt: skip
    assert f"{option}=" in use


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("on_error", "log"),
        ("max_queue", 5),
        ("rank", 0),
        ("watchdog_s", 5),
        ("close_timeout", None),
        ("on_lost", "raise"),
        ("barrier_timeout", 1.5),
    ],
)
def test_an_option_of_the_bus_given_to_the_trainer_names_the_bus(name: str, value: Any) -> None:
    with pytest.raises(TypeError, match=rf"bus=EventBus\({name}={value!r}\)"):
        _trainer(**{name: value})


@pytest.mark.parametrize("keyword", ["n", "steps"])
def test_accumulate_with_another_name_for_its_micro_batches_names_micro_batches(
    keyword: str,
) -> None:
    with pytest.raises(TypeError) as info:
        Accumulate(**{keyword: 4})  # type: ignore[call-arg]
    assert str(info.value) == (
        f"Accumulate() got an unexpected keyword argument {keyword!r}: the micro-batches per "
        "step are micro_batches: Accumulate(4) or Accumulate(micro_batches=4)"
    )
    assert Accumulate(micro_batches=4) == Accumulate(4)


def test_accumulate_with_a_misspelt_by_names_by() -> None:
    with pytest.raises(TypeError, match=r"'byy' \(did you mean 'by'\?\)$"):
        Accumulate(2, byy="items")  # type: ignore[call-arg]


@pytest.mark.parametrize(
    ("given", "says"),
    [
        ({"ckpt_path": "last"}, "that is Lightning's Trainer.fit(ckpt_path=...); in trainbus: "
                                "fit(resume='latest')"),
        ({"ckpt_path": "runs/x/step-3.pt"}, "fit(resume='runs/x/step-3.pt')"),
        ({"resume_from_checkpoint": True}, "that is Hugging Face's Trainer.train("
                                           "resume_from_checkpoint=...); in trainbus: "
                                           "fit(resume='latest')"),
    ],
)  # fmt: skip
def test_fit_with_another_frameworks_resume_keyword_names_resume(
    given: dict[str, Any], says: str
) -> None:
    trainer = _trainer()
    with pytest.raises(TypeError) as info:
        trainer.fit_sync(**given)
    name = next(iter(given))
    assert str(info.value).startswith(f"fit_sync() got an unexpected keyword argument {name!r}: ")
    assert says in str(info.value)
    assert trainer.result is None  # refused before anything ran

    async def fit() -> None:
        await trainer.fit(**given)

    with pytest.raises(TypeError, match=r"^fit\(\) got an unexpected keyword argument"):
        anyio.run(fit)


def test_fit_stays_a_coroutine_function_with_its_own_signature() -> None:
    assert inspect.iscoroutinefunction(inspect.unwrap(Trainer.fit))
    if sys.version_info >= (3, 12):  # inspect.markcoroutinefunction: the wrapper says so too
        assert inspect.iscoroutinefunction(Trainer.fit)
    assert list(inspect.signature(Trainer.fit).parameters) == ["self", "resume",
                                                               "require_checkpoint"]  # fmt: skip

"""Peer parity: Hugging Face's and Composer's own hook tests, replayed against trainbus.

Each peer pins its hooks in a test of its own, and this file computes the same expectation the
same way, for the configurations those tests use and a few more:

- Hugging Face, ``tests/trainer/test_trainer_callback.py`` (huggingface/transformers, read at
  020a37d2264e60dc7beb9634c3e87ad870073e2c): ``TrainerCallbackTest._get_expected_events`` builds
  the exact sequence of ``TrainerCallback`` calls of a run; ``test_event_flow`` runs it for the
  default arguments, ``logging_steps=5``, ``save_steps=5``, ``eval_steps=5`` (steps),
  evaluation per epoch, and ``logging_steps=3, save_steps=10, eval_steps=5``.
  :func:`hugging_face_expected` is that function; the parts its configurations never reach
  (accumulation, ``max_steps``, named evaluation sets) follow ``Trainer._inner_training_loop``
  and ``Trainer.evaluate`` of transformers 5.24 and are marked.
- Composer, ``tests/test_events.py`` (mosaicml/composer, read at
  6405188805a0054b4551ec49e4919c54c971d0e8): ``TestEventCalls._assert_expected_event_calls``
  counts the calls of each ``Event`` for one epoch of one batch of 4 in micro-batches of 2, two
  evaluators of one batch, evaluation and saving every epoch or every batch.
  :func:`composer_expected` is that count; the parts its configurations never reach (several
  batches, ``max_duration`` in batches, data without a length, the evaluation at ``FIT_END``)
  follow ``Trainer._train_loop`` / ``_iter_dataloader`` and ``create_interval_scheduler``.

trainbus' events (and the inline hooks of rows that name only a hook) are turned into the
peer's hook names through src/trainbus/migration.toml, the table a porter reads. Where trainbus
differs from the peer, the row says so in its ``differs`` list, each with a ``kind`` that the
expectation functions below know: the comparison uses the peer's expectation with exactly the
stated differences applied, and each stated difference must change that expectation in some
configuration (a difference that went away must leave the table).
"""

from __future__ import annotations

import math
import tomllib
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from trainbus import Callback, EvalSchedule, Trainer
from trainbus import events as ev
from trainbus.callbacks import Checkpointing
from trainbus.testing import EventRecorder, tiny_loader, tiny_model

TABLE = Path(__file__).resolve().parent.parent / "src" / "trainbus" / "migration.toml"


def rows(framework: str) -> list[dict[str, Any]]:
    """The migration table's rows of ``framework``."""
    with TABLE.open("rb") as f:
        return [e for e in tomllib.load(f)["entries"] if e["framework"] == framework]


def stated(framework: str) -> dict[str, set[str]]:
    """Each ``differs`` kind the table states for ``framework``, with the hooks stating it."""
    out: dict[str, set[str]] = {}
    for row in rows(framework):
        for d in row.get("differs", []):
            out.setdefault(d["kind"], set()).add(row["name"])
    return out


def row_events(row: dict[str, Any]) -> list[str]:
    event = row.get("event", [])
    return [event] if isinstance(event, str) else list(event)


def matches(row: dict[str, Any], event: ev.BaseEvent) -> bool:
    """The row maps ``event``: its class is one of the row's, its fields match ``match``."""
    if type(event).__name__ not in row_events(row):
        return False
    for field, want in row.get("match", {}).items():
        value = getattr(event, field)
        if value not in (want if isinstance(want, list) else [want]):
            return False
    return True


# ====================================================================== running trainbus
class _Unsized:
    """Batches without ``__len__``: an iterable data set, as a stream."""

    def __init__(self, batches: Sequence[Any]) -> None:
        self._batches = list(batches)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._batches)


def _batches(sizes: Iterable[int], *, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One ``(inputs, targets)`` batch per size, from the tiny generated data set."""
    sizes = list(sizes)
    pool = tiny_loader(len(sizes), batch_size=max(sizes), seed=seed)
    return [(x[:n], y[:n]) for (x, y), n in zip(pool, sizes, strict=True)]


@dataclass
class Run:
    """What a trainbus run published, and how often each inline hook ran."""

    events: list[ev.BaseEvent]
    hooks: Counter[str]


def run_trainbus(tmp: Path, train: Sequence[Any], *, sized: bool, hook_points: Iterable[str],
                 save: Callback, **kwargs: Any) -> Run:  # fmt: skip
    """Train the tiny model on ``train`` and record every event and hook call."""
    model = tiny_model()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05),
                      train if sized else _Unsized(train), loss_fn=F.cross_entropy,
                      checkpoint_dir=tmp, callbacks=[save], device="cpu", progress=False,
                      on_signal=None, trace=True, **kwargs)  # fmt: skip
    hooks: Counter[str] = Counter()

    def counter(point: str) -> Callable[[Any], None]:
        return lambda ctx: hooks.update([point])

    for point in hook_points:
        trainer.add_hook(point, counter(point))  # type: ignore[arg-type]
    recorder = EventRecorder(trainer.bus)
    result = trainer.fit_sync()
    trainer.close()
    assert result.reason == "completed" and recorder.completed
    return Run(list(recorder.items), hooks)


# ====================================================================== Hugging Face
@dataclass(frozen=True)
class HF:
    """A ``TrainingArguments`` configuration of the Hugging Face test (its defaults: 3 epochs
    of ``RegressionDataset(length=64)`` in batches of 8, the same evaluation set)."""

    epochs: int = 3
    batches: int = 8
    logging_steps: int = 500
    save_steps: int = 500
    eval_strategy: str = "no"
    eval_steps: int | None = None
    accumulate: int = 1
    max_steps: int | None = None
    eval_sets: tuple[int, ...] = (8,)
    sized: bool = True


HF_CONFIGS = {
    # test_event_flow's own configurations
    "default": HF(),
    "logging_steps=5": HF(logging_steps=5),
    "save_steps=5": HF(save_steps=5),
    "eval_steps=5": HF(eval_steps=5, eval_strategy="steps"),
    "eval_strategy=epoch": HF(eval_strategy="epoch"),
    "logging_steps=3,save_steps=10,eval_steps=5": HF(
        logging_steps=3, save_steps=10, eval_steps=5, eval_strategy="steps"
    ),
    # a few more than Hugging Face's own tests run, on the same data
    "accumulation with a partial last group": HF(
        epochs=2,
        batches=7,
        accumulate=2,
        logging_steps=3,
        save_steps=4,
        eval_steps=5,
        eval_strategy="steps",
    ),
    "max_steps mid-epoch": HF(max_steps=11, save_steps=4, eval_strategy="epoch"),
    "one step": HF(max_steps=1, eval_steps=5, eval_strategy="steps"),
    "two named evaluation sets": HF(epochs=2, eval_strategy="epoch", eval_sets=(8, 3)),
    "data without a length": HF(
        max_steps=10, logging_steps=3, eval_steps=4, eval_strategy="steps", sized=False
    ),
}

HF_KINDS = frozenset({
    "substep-last-micro-batch", "log-evaluation", "log-train-summary", "log-partial-window",
    "final-save-after-epoch-end", "epoch-eval-before-epoch-end",
})  # fmt: skip
"""The differences :func:`hugging_face_expected` knows how to apply."""


def hugging_face_expected(c: HF, differs: frozenset[str] = frozenset()) -> list[str]:
    """``TrainerCallbackTest._get_expected_events`` for ``c``, with ``differs`` applied.

    Without ``differs`` this is Hugging Face's sequence; each kind in ``differs`` changes it the
    way the migration table says trainbus differs.
    """
    assert differs <= HF_KINDS
    per_epoch = math.ceil(c.batches / c.accumulate)  # num_update_steps_per_epoch
    max_steps = c.max_steps if c.max_steps is not None else c.epochs * per_epoch
    epochs = math.ceil(max_steps / per_epoch)  # state.num_train_epochs
    eval_steps = c.eval_steps if c.eval_steps is not None else c.logging_steps
    steps_strategy = c.eval_strategy == "steps"
    evaluation: list[str] = []
    for batches in c.eval_sets:  # Trainer.evaluate: one evaluate() per set of a dict
        evaluation += ["on_prediction_step"] * batches
        evaluation += [] if "log-evaluation" in differs else ["on_log"]
        evaluation.append("on_evaluate")
    expected = ["on_init_end", "on_train_begin"]
    step = 0
    final_save_later = False
    for _ in range(epochs):
        expected.append("on_epoch_begin")
        # _inner_training_loop: groups of gradient_accumulation_steps batches, the last one
        # of the epoch shorter; on_substep_end after each micro-batch but the group's last.
        groups = [min(c.accumulate, c.batches - i) for i in range(0, c.batches, c.accumulate)]
        evaluated_epoch = False
        for index, group in enumerate(groups):
            step += 1
            substeps = group if "substep-last-micro-batch" in differs else group - 1
            expected += ["on_step_begin", *["on_substep_end"] * substeps,
                         "on_pre_optimizer_step", "on_optimizer_step", "on_step_end"]  # fmt: skip
            if step % c.logging_steps == 0:
                expected.append("on_log")
            interval_save = step % c.save_steps == 0
            last = step == max_steps
            # trainbus evaluates an epoch at its last step, before the step's save, when that
            # step is known to end it: the data has a length, or max_steps ends the run there.
            ends_epoch = (c.sized and index == len(groups) - 1) or last
            if "epoch-eval-before-epoch-end" in differs and ends_epoch:
                expected += evaluation if c.eval_strategy == "epoch" else []
                evaluated_epoch = True
            if steps_strategy and step % eval_steps == 0:
                expected += evaluation
            # End-of-training evaluation: triggers if step-based eval strategy and final step
            # isn't already an eval step (to avoid duplicate evaluation)
            if last and steps_strategy and step % eval_steps != 0:
                expected += evaluation
            if interval_save or last:
                if last and not interval_save and "final-save-after-epoch-end" in differs:
                    final_save_later = True
                else:
                    expected.append("on_save")
            if last:  # DefaultFlowCallback: should_training_stop at max_steps
                break
        at_epoch_end = evaluation if c.eval_strategy == "epoch" and not evaluated_epoch else []
        if "epoch-eval-before-epoch-end" in differs:
            expected += [*at_epoch_end, "on_epoch_end"]
        else:
            expected += ["on_epoch_end", *at_epoch_end]
    if "log-partial-window" in differs and step % c.logging_steps:
        expected.append("on_log")
    if final_save_later:
        expected.append("on_save")
    expected += [] if "log-train-summary" in differs else ["on_log"]
    expected.append("on_train_end")
    return expected


def hugging_face_of(run: Run) -> list[str]:
    """trainbus' events as Hugging Face hook names, through the migration table."""
    table = [r for r in rows("huggingface") if row_events(r)]
    out: list[str] = []
    for event in run.events:
        names = [r["name"] for r in table if matches(r, event)]
        assert len(names) <= 1, f"{type(event).__name__} maps to several hooks: {names}"
        out += names
    return out


def run_hf(c: HF, tmp: Path) -> Run:
    eval_data: Any = None
    if c.eval_strategy != "no":
        sets = [tiny_loader(n, batch_size=8, seed=1 + i) for i, n in enumerate(c.eval_sets)]
        eval_data = sets[0] if len(sets) == 1 else {f"set{i}": s for i, s in enumerate(sets)}
    eval_steps = c.eval_steps if c.eval_steps is not None else c.logging_steps
    return run_trainbus(
        tmp,
        tiny_loader(c.batches, batch_size=8),
        sized=c.sized,
        hook_points=(),
        save=Checkpointing(every_steps=c.save_steps, every_epochs=None),
        max_epochs=c.epochs if c.max_steps is None else None,
        max_steps=c.max_steps,
        accumulate=c.accumulate,
        log_every=c.logging_steps,
        eval_data=eval_data,
        eval_schedule=EvalSchedule(
            every_steps=eval_steps if c.eval_strategy == "steps" else None,
            epoch_end=c.eval_strategy == "epoch",
        ),
    )


def first_difference(got: Sequence[str], want: Sequence[str]) -> str:
    for i, (a, b) in enumerate(zip(got, want, strict=False)):
        if a != b:
            return (
                f"at {i}: trainbus {a!r}, expected {b!r}; before: {list(want[max(0, i - 6) : i])}"
            )
    return f"lengths: trainbus {len(got)}, expected {len(want)}"


@pytest.mark.parametrize("config", list(HF_CONFIGS), ids=list(HF_CONFIGS))
def test_hugging_face_event_flow(config: str, tmp_path: Path) -> None:
    """trainbus' events, as Hugging Face hooks, are test_event_flow's expected sequence with the
    differences the table states, and nothing else."""
    c = HF_CONFIGS[config]
    got = hugging_face_of(run_hf(c, tmp_path))
    want = hugging_face_expected(c, frozenset(stated("huggingface")))
    assert got == want, first_difference(got, want)


# ====================================================================== Composer
@dataclass(frozen=True)
class Composer:
    """A configuration of Composer's ``TestEventCalls.get_trainer``: batches of 4 samples
    (``train_subset_num_batches=1``: one per epoch) in micro-batches of 2, two evaluators of one
    batch each (``eval_subset_num_batches=1``), one epoch."""

    batches: tuple[int, ...] = (4,)
    microbatch: int = 2
    epochs: int = 1
    max_batches: int | None = None  # max_duration in batches ("3ba"), else in epochs
    eval_every: int = 1
    eval_unit: str = "ep"  # eval_interval "1ep" / "1ba" (save_interval the same)
    eval_sets: tuple[int, ...] = (1, 1)
    sized: bool = True


COMPOSER_CONFIGS = {
    # test_event_calls' own (world size 1, CPU): save_interval = eval_interval = 1ep or 1ba
    "1ep": Composer(),
    "1ba": Composer(eval_unit="ba"),
    # a few more than Composer's own tests run
    "accumulation with a partial last group": Composer(
        batches=(4, 4, 2), epochs=2, eval_every=4, eval_unit="ba"
    ),
    "max_duration mid-epoch": Composer(batches=(4, 4), max_batches=3),
    "one step": Composer(batches=(4, 4), max_batches=1, eval_unit="ba"),
    "data without a length": Composer(batches=(4, 4, 2), epochs=2, sized=False),
}

COMPOSER_KINDS = frozenset(
    {"load-only-on-resume", "per-micro-batch", "no-end-probe", "epoch-end-when-cut"}
)
"""The differences :func:`composer_expected` knows how to apply."""


def composer_expected(c: Composer, differs: frozenset[str] = frozenset()) -> Counter[str]:
    """``TestEventCalls._assert_expected_event_calls``'s counts for ``c``, with ``differs``."""
    assert differs <= COMPOSER_KINDS
    per_epoch = len(c.batches)
    total_steps = c.max_batches if c.max_batches is not None else c.epochs * per_epoch
    num_epochs = math.ceil(total_steps / per_epoch)  # epochs started
    # EPOCH_END: only for epochs whose data ran out (or max_duration on its last batch)
    run_out = total_steps // per_epoch
    ended = num_epochs if "epoch-end-when-cut" in differs else run_out
    # _iter_dataloader's probe: BEFORE_DATALOADER before the StopIteration of each epoch that
    # was not cut by max_duration in batches (which breaks right after its last batch).
    probes = run_out if c.max_batches is None else (total_steps - 1) // per_epoch
    if "no-end-probe" in differs and c.sized:
        probes = 0
    sizes = [c.batches[i % per_epoch] for i in range(total_steps)]
    total_microbatches = sum(math.ceil(n / c.microbatch) for n in sizes)
    fetches = total_microbatches if "per-micro-batch" in differs else total_steps
    # create_interval_scheduler: every eval_every units, and at FIT_END unless the last batch
    # was evaluated already
    if c.eval_unit == "ba":
        evaluated = {b for b in range(1, total_steps + 1) if b % c.eval_every == 0}
    else:
        evaluated = {e * per_epoch for e in range(1, run_out + 1) if e % c.eval_every == 0}
    total_evals = len(evaluated) + (total_steps not in evaluated)
    total_evals_start = total_evals * len(c.eval_sets)
    total_eval_steps = total_evals * sum(c.eval_sets)
    loads = 0 if "load-only-on-resume" in differs else 1
    return Counter({
        "INIT": 1, "BEFORE_LOAD": loads, "AFTER_LOAD": loads, "ITERATION_START": 1,
        "EPOCH_START": num_epochs,
        "BATCH_START": total_steps,
        "BEFORE_DATALOADER": fetches + probes,  # extra call per epoch when dataloader is exhausted
        "AFTER_DATALOADER": fetches,
        "BEFORE_FORWARD": total_microbatches, "AFTER_FORWARD": total_microbatches,
        "BEFORE_LOSS": total_microbatches, "AFTER_LOSS": total_microbatches,
        "BEFORE_BACKWARD": total_microbatches, "AFTER_BACKWARD": total_microbatches,
        "BEFORE_TRAIN_BATCH": fetches, "AFTER_TRAIN_BATCH": fetches,
        "BATCH_END": total_steps, "BATCH_CHECKPOINT": total_steps,
        "EPOCH_END": ended, "EPOCH_CHECKPOINT": ended,
        "ITERATION_END": 0, "ITERATION_CHECKPOINT": 0,
        "EVAL_BEFORE_ALL": total_evals, "EVAL_START": total_evals_start,
        "EVAL_BATCH_START": total_eval_steps, "EVAL_BEFORE_FORWARD": total_eval_steps,
        "EVAL_AFTER_FORWARD": total_eval_steps, "EVAL_BATCH_END": total_eval_steps,
        "EVAL_END": total_evals_start, "EVAL_AFTER_ALL": total_evals,
    })  # fmt: skip


def composer_of(run: Run, hooks: Iterable[str]) -> Counter[str]:
    """How often trainbus did what each Composer event's row names: its events (narrowed by
    ``match``), or for a row that names only a hook point, that hook's calls."""
    out: Counter[str] = Counter()
    table = {r["name"]: r for r in rows("composer")}
    for name in hooks:
        r = table[name]
        if row_events(r):
            out[name] = sum(matches(r, e) for e in run.events)
        else:
            out[name] = run.hooks[r["hook"]]
    return out


def without_equivalent(framework: str) -> set[str]:
    return {r["name"] for r in rows(framework) if not {"event", "hook", "command"} & set(r)}


def run_composer(c: Composer, tmp: Path) -> Run:
    microbatches = [min(c.microbatch, n - i) for n in c.batches for i in range(0, n, c.microbatch)]
    accumulate = math.ceil(max(c.batches) / c.microbatch)
    sets = {f"evaluator{i + 1}": tiny_loader(n, batch_size=4, seed=1 + i)
            for i, n in enumerate(c.eval_sets)}  # fmt: skip
    hook_points = {r["hook"] for r in rows("composer") if "hook" in r and not row_events(r)}
    by_steps = c.eval_unit == "ba"
    return run_trainbus(
        tmp,
        _batches(microbatches, seed=0),
        sized=c.sized,
        hook_points=hook_points,
        save=Checkpointing(
            every_steps=c.eval_every if by_steps else None,
            every_epochs=None if by_steps else c.eval_every,
        ),
        max_epochs=c.epochs if c.max_batches is None else None,
        max_steps=c.max_batches,
        accumulate=accumulate,
        eval_data=sets,
        eval_schedule=EvalSchedule(
            every_steps=c.eval_every if by_steps else None, epoch_end=not by_steps
        ),
    )


@pytest.mark.parametrize("config", list(COMPOSER_CONFIGS), ids=list(COMPOSER_CONFIGS))
def test_composer_event_calls(config: str, tmp_path: Path) -> None:
    """trainbus' counts, as Composer events, are test_event_calls' expected counts with the
    differences the table states; an event with no trainbus equivalent is left out."""
    c = COMPOSER_CONFIGS[config]
    want = composer_expected(c, frozenset(stated("composer")))
    compared = set(want) - without_equivalent("composer")
    got = composer_of(run_composer(c, tmp_path), compared)
    assert {k: got[k] for k in sorted(compared)} == {k: want[k] for k in sorted(compared)}


# ====================================================================== the stated differences
EXPECTATIONS: dict[str, tuple[frozenset[str], Callable[[Any, frozenset[str]], Any], dict[str, Any]]]
EXPECTATIONS = {
    "huggingface": (HF_KINDS, hugging_face_expected, HF_CONFIGS),
    "composer": (COMPOSER_KINDS, composer_expected, COMPOSER_CONFIGS),
}


@pytest.mark.parametrize("framework", list(EXPECTATIONS))
def test_every_stated_difference_is_known_and_real(framework: str) -> None:
    """The table states exactly the differences the expectations know, and each one changes the
    peer's expectation in at least one configuration: a difference that trainbus removed must
    leave the table (and this file), one it has must be in the table."""
    known, expected, configs = EXPECTATIONS[framework]
    kinds = stated(framework)
    assert set(kinds) == known
    for kind in known:
        rest = frozenset(known - {kind})
        assert any(expected(c, rest) != expected(c, known) for c in configs.values()), kind


def test_composer_differences_are_stated_on_the_rows_they_change() -> None:
    """A count difference changes exactly the counts of the rows that state it."""
    known = COMPOSER_KINDS
    for kind, hooks in stated("composer").items():
        changed: set[str] = set()
        for c in COMPOSER_CONFIGS.values():
            a, b = composer_expected(c, known), composer_expected(c, known - {kind})
            changed |= {h for h in a.keys() | b.keys() if a[h] != b[h]}
        assert changed == hooks, (kind, changed, hooks)


def test_hugging_face_sequence_without_differences_is_the_peers_own() -> None:
    """The port reproduces the peer's test for its default configuration exactly (3 epochs of 8
    steps, no logging, evaluation or interval save: one save at the last step)."""
    seq = hugging_face_expected(HF_CONFIGS["default"])
    step = ["on_step_begin", "on_pre_optimizer_step", "on_optimizer_step", "on_step_end"]
    epoch = ["on_epoch_begin", *step * 8, "on_epoch_end"]
    last = ["on_epoch_begin", *step * 8, "on_save", "on_epoch_end"]
    assert seq == ["on_init_end", "on_train_begin", *epoch, *epoch, *last, "on_log",
                   "on_train_end"]  # fmt: skip

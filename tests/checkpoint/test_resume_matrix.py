"""The resume matrix: resumed from every checkpoint it wrote, a run ends where it would have.

Each cell is a small configuration drawn from a pairwise grid of the options that touch resume
(evaluation cadence coinciding with the saves or not, dropout, the kind of evaluation data, the
kind of training data, accumulation, the scheduler's interval, early stopping with best-keeping
checkpoints, bf16 autocast). The cell runs once uninterrupted, keeping a copy of every
checkpoint as it lands (retention deletes some before the run ends), then resumes a new Trainer
from each copy and compares it with the uninterrupted run: the final parameters, optimizer,
scheduler, callback and RNG states (``torch.equal``), and every event that counts for a resume
that the uninterrupted run published after that checkpoint (evaluations with their metrics,
saves with their tags, early stopping's stop, the end).

The slow tests SIGKILL real training processes at random moments and resume them in new ones.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import trainbus
from trainbus import commands as cmd
from trainbus import events as ev
from trainbus.checkpoint import read_checkpoint
from trainbus.testing import EventRecorder

from ._matrix_run import AXES, PACE_S, Cell, build

CHILD = Path(__file__).with_name("_matrix_run.py")
SRC = str(Path(trainbus.__file__).resolve().parents[1])

# ------------------------------------------------------------------------------------ the grid


def pairwise(axes: Mapping[str, Sequence[Any]]) -> list[dict[str, Any]]:
    """A deterministic covering array: every value pair of every two axes in some row.

    Greedy (AETG style, without randomness): each row is the one of the full product that covers
    the most pairs not yet covered, the first such in product order.
    """
    names = list(axes)
    rows = [dict(zip(names, values, strict=True)) for values in itertools.product(*axes.values())]

    def pairs(row: Mapping[str, Any]) -> set[tuple[str, Any, str, Any]]:
        return {(a, row[a], b, row[b]) for a, b in itertools.combinations(names, 2)}

    uncovered = set().union(*(pairs(r) for r in rows))
    chosen: list[dict[str, Any]] = []
    while uncovered:
        best = max(rows, key=lambda r: len(pairs(r) & uncovered))
        chosen.append(best)
        uncovered -= pairs(best)
    return chosen


CELLS = [Cell(**row) for row in pairwise(AXES)]


def test_the_grid_covers_every_pair_of_values() -> None:
    # The control of the grid itself: every two values of every two axes meet in some cell.
    for (a, values_a), (b, values_b) in itertools.combinations(AXES.items(), 2):
        for va, vb in itertools.product(values_a, values_b):
            assert any(getattr(c, a) == va and getattr(c, b) == vb for c in CELLS), (a, va, b, vb)
    assert len(CELLS) <= 12


# ------------------------------------------------------------------------------------ comparing


def _key(event: ev.BaseEvent) -> tuple[Any, ...] | None:
    """What of ``event`` a resume must reproduce exactly; None for events it does not compare."""
    match event:
        case ev.EvaluationEnded():
            return ("EvaluationEnded", event.step, event.dataset, dict(event.metrics))
        case ev.CheckpointSaved():
            return ("CheckpointSaved", event.step, event.tag, Path(event.path).name,
                    dict(event.metrics))  # fmt: skip
        case ev.CommandApplied(command=cmd.StopTraining()):
            return ("StopTraining", event.step, event.command, event.error is None)
        case ev.StepEnded():
            return ("StepEnded", event.step, event.loss, event.lr)
        case ev.EpochEnded():
            return ("EpochEnded", event.step, event.epoch)
        case ev.FitEnded():
            return ("FitEnded", event.step, event.reason, event.stop_reason)
    return None


def _keys(events: Sequence[Any]) -> list[tuple[Any, ...]]:
    return [k for k in map(_key, events) if k is not None]


def _equal(a: Any, b: Any) -> bool:
    """Deep equality; tensors by ``torch.equal`` (dtype and shape included)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.dtype == b.dtype and torch.equal(a, b))  # fmt: skip
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        return math.isnan(b)
    return bool(a == b)


def _differences(want: Path, got: Path) -> list[str]:
    """The parts of two final checkpoints that differ."""
    a, b = read_checkpoint(want), read_checkpoint(got)
    parts = {
        "model": (a.model, b.model), "optimizer": (a.optimizer, b.optimizer),
        "scheduler": (a.scheduler, b.scheduler), "callbacks": (a.callbacks, b.callbacks),
        "rng": (a.rng, b.rng), "train state": (a.state, b.state), "metrics": (a.metrics, b.metrics),
    }  # fmt: skip
    return [name for name, (x, y) in parts.items() if not _equal(x, y)]


@dataclass
class Reference:
    """The uninterrupted run: its events, a copy of every checkpoint, its final checkpoint."""

    events: list[Any]
    copies: list[tuple[int, Path]]
    """(index of its CheckpointSaved in ``events``, the copy), in the order written."""
    final: Path
    params: list[torch.Tensor]


def run_uninterrupted(cell: Cell, tmp: Path) -> Reference:
    trainer = build(cell, tmp / "ref")
    recorder = EventRecorder(trainer.bus)
    copies: list[tuple[int, Path]] = []
    kept = tmp / "copies"
    kept.mkdir()

    def keep(event: ev.CheckpointSaved) -> None:
        # Delivered before the CheckpointSaved that makes retention delete the file.
        copy = kept / f"{len(copies):02d}-{Path(event.path).name}"
        shutil.copyfile(event.path, copy)
        copies.append((len(recorder.items) - 1, copy))

    trainer.bus.subscribe(trainer.bus.stream(ev.CheckpointSaved), keep, name="keep")
    result = trainer.fit_sync()
    assert result.checkpoint is not None
    params = [p.detach().clone() for p in trainer.settings.model.parameters()]
    return Reference(recorder.items, copies, Path(result.checkpoint), params)


def resume_from(cell: Cell, ref: Reference, at: int, copy: Path, tmp: Path) -> list[str]:
    """Resume ``cell`` from ``copy``; return what differs from ``ref`` (empty: nothing)."""
    trainer = build(cell, tmp / f"resume-{copy.stem}")
    recorder = EventRecorder(trainer.bus)
    result = trainer.fit_sync(resume=copy)
    problems: list[str] = []
    end: ev.FitEnded = ref.events[-1]
    if read_checkpoint(copy).state.step == end.step:
        # Nothing left to train: the resumed run only ends (writing a final checkpoint into
        # its own, empty folder, where the uninterrupted run had just saved that step).
        want, got = _keys([end]), _keys(recorder.of_type(ev.FitEnded))
        parts = ["model", "optimizer", "scheduler", "callbacks"]
    else:
        want, got = _keys(ref.events[at + 1 :]), _keys(recorder.items)
        parts = ["model", "optimizer", "scheduler", "callbacks", "rng", "train state", "metrics"]
    if want != got:
        first = next((i for i, (w, g) in enumerate(zip(want, got, strict=False)) if w != g),
                     min(len(want), len(got)))  # fmt: skip
        problems.append(
            f"events differ from #{first}: uninterrupted {want[first : first + 3]} "
            f"resumed {got[first : first + 3]} ({len(want)} vs {len(got)} events)"
        )
    params = [p.detach() for p in trainer.settings.model.parameters()]
    if not all(torch.equal(a, b) for a, b in zip(ref.params, params, strict=True)):
        diff = max((a - b).abs().max().item() for a, b in zip(ref.params, params, strict=True))
        problems.append(f"parameters differ (max |diff| {diff:.3g})")
    if result.checkpoint is None:
        problems.append("no final checkpoint")
    else:
        differ = [p for p in _differences(ref.final, Path(result.checkpoint)) if p in parts]
        if differ:
            problems.append(f"final checkpoints differ in {', '.join(differ)}")
    return problems


def _resumable(ref: Reference) -> list[tuple[int, Path]]:
    """The copies to resume from: all but those written after a stop was applied.

    A stop is a decision, not state: a run resumed from a checkpoint saved after it (the
    stopped run's final one) trains on, as after a preemption's ``StopTraining``.
    """
    stops = [
        i
        for i, e in enumerate(ref.events)
        if isinstance(e, ev.CommandApplied) and isinstance(e.command, cmd.StopTraining)
    ]
    return [(at, copy) for at, copy in ref.copies if not stops or at < stops[0]]


@pytest.mark.parametrize("cell", CELLS, ids=[c.id for c in CELLS])
def test_resume_from_every_checkpoint_is_exact(cell: Cell, tmp_path: Path) -> None:
    ref = run_uninterrupted(cell, tmp_path)
    copies = _resumable(ref)
    assert len(copies) >= 4, [c.name for _, c in ref.copies]
    failures = {}
    for at, copy in copies:
        problems = resume_from(cell, ref, at, copy, tmp_path)
        if problems:
            failures[copy.name] = problems
    assert not failures, "\n".join(f"{name}: {'; '.join(p)}" for name, p in failures.items())


# ------------------------------------------------------------------------------------ SIGKILL

# A few cells, each killed at random moments: the issue's own setup (saves at evaluation steps,
# dropout, a DataLoader to evaluate on), a streaming one, and one that stops early.
KILLED = [
    Cell("coincide", True, "loader", "map", 2, "step", False, "32"),
    Cell("staggered", True, "shuffled-loader", "iterable", 1, "epoch", False, "bf16"),
    Cell("coincide", True, "factory", "map", 1, "step", True, "32"),
]
KILLS = 3


@pytest.mark.slow
@pytest.mark.parametrize("cell", KILLED, ids=[c.id for c in KILLED])
def test_sigkill_at_random_moments_then_resume_latest_ends_as_uninterrupted(
    cell: Cell, tmp_path: Path
) -> None:
    reference = build(cell, tmp_path / "ref")
    reference.fit_sync()
    want = [p.detach().clone() for p in reference.settings.model.parameters()]
    span = PACE_S * reference.result.steps if reference.result else 0.0  # the children's pace
    rng = random.Random(f"{cell.id}-kills")  # fixed: the same moments each run, as far as
    folder, out = tmp_path / "ck", tmp_path / "final.pt"  # the machine's speed allows
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    argv = [sys.executable, str(CHILD), json.dumps(dataclasses.asdict(cell)), str(folder),
            str(out)]  # fmt: skip
    inside = 0  # kills that landed after a checkpoint and before the end
    kills: list[str | None] = []  # the newest checkpoint at each kill, for the messages
    for attempt in range(KILLS + 1):
        child = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env)
        assert child.stdout is not None
        try:
            assert child.stdout.readline().strip() == "training"  # FitStarted: it trains
            if attempt < KILLS:
                time.sleep(rng.uniform(0.0, span))
                child.send_signal(signal.SIGKILL)
            status = child.wait(timeout=60)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
            child.stdout.close()
        if out.exists():  # it finished (a kill that came later ended only its exit)
            break
        assert status == -signal.SIGKILL, status
        left = sorted(p.name for p in folder.glob("step-*.pt"))
        inside += bool(left)
        kills.append(left[-1] if left else None)
    assert out.exists() and inside >= 1, kills
    got = torch.load(out, weights_only=True)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b), (kills, (a - b).abs().max().item())

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
import torch.nn.functional as F

import trainbus
from trainbus import EvalSchedule, PerEpoch, Trainer
from trainbus import commands as cmd
from trainbus import events as ev
from trainbus.callbacks import Checkpointing
from trainbus.checkpoint import read_checkpoint
from trainbus.testing import EventRecorder, tiny_loader, tiny_model

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


def _without_files(callbacks: dict[str, Any]) -> dict[str, Any]:
    """Callback states without ``Checkpointing``'s retention books, which name the file being
    written and those kept before it: two different last files (the run's ``-best``, the
    resumed run's ``final``) of one point book differently."""
    return {key: {k: v for k, v in state.items() if k != "files"} if key == "Checkpointing"
            else state for key, state in callbacks.items()}  # fmt: skip


def _differences(want: Path, got: Path, *, same_point: bool = False) -> list[str]:
    """The parts of two final checkpoints that differ (``same_point``: two files written at
    the same step, where only the retention books may differ)."""
    a, b = read_checkpoint(want), read_checkpoint(got)
    ca, cb = a.callbacks, b.callbacks
    if same_point:
        ca, cb = _without_files(ca), _without_files(cb)
    parts = {
        "model": (a.model, b.model), "optimizer": (a.optimizer, b.optimizer),
        "scheduler": (a.scheduler, b.scheduler), "callbacks": (ca, cb),
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
        copy = kept / f"{len(copies):02d}" / Path(event.path).name  # its name kept: a resume
        copy.parent.mkdir()  # reads its step and tag from it
        shutil.copyfile(event.path, copy)
        copies.append((len(recorder.items) - 1, copy))

    trainer.bus.subscribe(trainer.bus.stream(ev.CheckpointSaved), keep, name="keep")
    result = trainer.fit_sync()
    assert result.last_checkpoint is not None
    params = [p.detach().clone() for p in trainer.settings.model.parameters()]
    return Reference(recorder.items, copies, Path(result.last_checkpoint), params)


def resume_from(cell: Cell, ref: Reference, at: int, copy: Path, tmp: Path) -> list[str]:
    """Resume ``cell`` from ``copy``; return what differs from ``ref`` (empty: nothing).

    The resumed run writes into a folder of its own holding the checkpoint, as a run resumed in
    its own folder does: ``Checkpointing`` takes over the retention list of a checkpoint of its
    own ``checkpoint_dir`` only (a checkpoint from elsewhere starts a list of its own), and that
    list is part of the callback state compared at the end.
    """
    folder = tmp / f"resume-{copy.parent.name}"
    folder.mkdir()
    # The folder as the run left it at that checkpoint's step: every file of a step up to
    # it (the other saves of its poll too, such as the step's "-best"), the file itself last.
    k = read_checkpoint(copy).state.step
    for _, other in ref.copies:
        if other != copy and int(other.name.split("-")[1].removesuffix(".pt")) <= k:
            shutil.copyfile(other, folder / other.name)
    start = folder / copy.name
    shutil.copyfile(copy, start)
    trainer = build(cell, folder)
    recorder = EventRecorder(trainer.bus)
    result = trainer.fit_sync(resume=start)
    problems: list[str] = []
    end = ref.events[-1]
    # The uninterrupted run's events after that checkpoint, but for the other saves of the
    # same poll (a "best" copy of the same weights): the resumed run starts after them. An
    # EpochEnded of step k is published by either run or both (its epoch's end work is in
    # the checkpoint when the epoch's length is known, and runs after it otherwise).
    want = _keys(ref.events[at + 1 :])
    while want and want[0][0] == "CheckpointSaved" and want[0][1] == k:
        want.pop(0)
    got = _keys(recorder.items)
    stop = next((e.command for e in ref.events[:at] if isinstance(e, ev.CommandApplied)
                 and isinstance(e.command, cmd.StopTraining)), None)  # fmt: skip
    if stop is not None and got and got[0][:2] == ("StopTraining", k):
        # Saved after the stop (the stopped run's final checkpoint): the resumed run applies
        # the stop its EarlyStopping state holds, with the same reason, at its first poll.
        again = got.pop(0)[2]
        if again.reason != stop.reason:
            problems.append(f"stopped again for {again.reason!r}, not {stop.reason!r}")
    want, got = ([key for key in keys if not (key[0] == "EpochEnded" and key[1] <= k)]
                 for keys in (want, got))  # fmt: skip
    if want != got:
        first = next((i for i, (w, g) in enumerate(zip(want, got, strict=False)) if w != g),
                     min(len(want), len(got)))  # fmt: skip
        problems.append(
            f"events differ from #{first}: uninterrupted {want[first : first + 3]} "
            f"resumed {got[first : first + 3]} ({len(want)} vs {len(got)} events)"
        )
    parts = ["model", "optimizer", "scheduler", "callbacks", "rng", "train state", "metrics"]
    if k == end.step:  # the same point, reached in another order: compare what trains
        parts = ["model", "optimizer", "scheduler", "callbacks"]
    params = [p.detach() for p in trainer.settings.model.parameters()]
    if not all(torch.equal(a, b) for a, b in zip(ref.params, params, strict=True)):
        diff = max((a - b).abs().max().item() for a, b in zip(ref.params, params, strict=True))
        problems.append(f"parameters differ (max |diff| {diff:.3g})")
    if result.last_checkpoint is None:
        problems.append("no final checkpoint")
    else:
        differ = [
            p
            for p in _differences(ref.final, Path(result.last_checkpoint), same_point=k == end.step)
            if p in parts
        ]
        if differ:
            problems.append(f"final checkpoints differ in {', '.join(differ)}")

    return problems


def _failures(cell: Cell, ref: Reference, copies: list[tuple[int, Path]], tmp: Path) -> str:
    """What differs after resuming from each of ``copies``, one line per checkpoint."""
    failures = {}
    for at, copy in copies:
        problems = resume_from(cell, ref, at, copy, tmp)
        if problems:
            failures[f"{copy.parent.name}/{copy.name}"] = problems
    return "\n".join(f"{name}: {'; '.join(p)}" for name, p in failures.items())


@pytest.mark.parametrize("cell", CELLS, ids=[c.id for c in CELLS])
def test_resume_from_every_checkpoint_is_exact(cell: Cell, tmp_path: Path) -> None:
    ref = run_uninterrupted(cell, tmp_path)
    assert len(ref.copies) >= 4, [c.name for _, c in ref.copies]
    failures = _failures(cell, ref, ref.copies, tmp_path)
    assert not failures, failures


# ------------------------------------------------------------------------------------ SIGKILL

# A few cells, each killed at random moments: one that saves at evaluation steps (with dropout and
# a DataLoader to evaluate on), a streaming one with an epoch scheduler, and one that
# stops early and keeps its best checkpoint.
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


# ------------------------------------------------------------------------------------ found here
# What the matrix found beyond the evaluation step's order, each pinned on its own.


class _Numbers(torch.utils.data.IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    """Four batches of a stream without a length."""

    def __iter__(self) -> Any:
        g = torch.Generator().manual_seed(0)
        for _ in range(4):
            yield torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)


def _streamed(folder: Path, **checkpointing: Any) -> Trainer:
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return Trainer(model, opt, _Numbers(), loss_fn=F.cross_entropy, max_epochs=3,
                   eval_data=[next(iter(_Numbers()))], scheduler=PerEpoch(sched),
                   device="cpu", checkpoint_dir=folder,
                   callbacks=[Checkpointing(**checkpointing)], on_signal=None,
                   attach=False)  # fmt: skip


def test_a_save_at_the_end_of_a_streamed_epoch_resumes_at_the_next_epoch(tmp_path: Path) -> None:
    # Saved at EpochEnded, after the epoch scheduler's step: the resumed run starts the next
    # epoch (it used to replay the stream to its end and step the scheduler again).
    straight = _streamed(tmp_path / "a", every_epochs=1)
    straight.fit_sync()
    resumed = _streamed(tmp_path / "b", every_epochs=1)
    rec = EventRecorder(resumed.bus)
    resumed.fit_sync(resume=tmp_path / "a" / "step-00000004.pt")
    assert [e.step for e in rec.of_type(ev.EpochEnded)] == [8, 12]
    assert [e.step for e in rec.of_type(ev.SchedulerStepped)] == [8, 12]
    for a, b in zip(straight.settings.model.parameters(), resumed.settings.model.parameters(),
                    strict=True):  # fmt: skip
        assert torch.equal(a, b)
    assert resumed.settings.optimizer.param_groups[0]["lr"] == 0.1 * 0.5**3


def _evaluated(folder: Path) -> Trainer:
    model = tiny_model(seed=0)
    return Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        tiny_loader(10, 4),
        loss_fn=F.cross_entropy,
        eval_data=tiny_loader(2, 4),
        eval_schedule=EvalSchedule(every_steps=4, epoch_end=False, at_end=False),
        max_steps=8,
        device="cpu",
        checkpoint_dir=folder,
        on_signal=None,
        attach=False,
        callbacks=[Checkpointing(every_steps=2, every_epochs=None)],
    )


def test_a_resumed_run_carries_the_last_evaluation_metrics(tmp_path: Path) -> None:
    # Evaluated every 4 steps, saved every 2: step 6's save carries step 4's metrics, and so
    # does the result, resumed or not (a resumed run's used to be empty until it evaluated).
    straight = _evaluated(tmp_path / "a")
    rec = EventRecorder(straight.bus)
    straight.fit_sync()
    resumed = _evaluated(tmp_path / "b")
    again = EventRecorder(resumed.bus)
    result = resumed.fit_sync(resume=tmp_path / "a" / "step-00000004.pt")
    want = {e.step: dict(e.metrics) for e in rec.of_type(ev.CheckpointSaved) if e.step > 4}
    got = {e.step: dict(e.metrics) for e in again.of_type(ev.CheckpointSaved)}
    assert got == want and got[6] == dict(rec.of_type(ev.EvaluationEnded)[0].metrics)
    assert straight.result is not None and result.eval_metrics == straight.result.eval_metrics


def test_a_streamed_epochs_end_save_is_written_again_and_resumed_after(tmp_path: Path) -> None:
    # Step 4 ends the streamed epoch: its cadence save comes before the end is found, and the
    # epoch's save at the same step writes the file again (the epoch's end work changed the
    # state). A run resumed from the second file starts at the next epoch and saves what the
    # uninterrupted run saved after it.
    straight = _streamed(tmp_path / "a", every_steps=4, every_epochs=1)
    rec = EventRecorder(straight.bus)
    straight.fit_sync()
    saved = [e.step for e in rec.of_type(ev.CheckpointSaved)]
    assert saved == [4, 4, 8, 8, 12, 12]
    resumed = _streamed(tmp_path / "b", every_steps=4, every_epochs=1)
    again = EventRecorder(resumed.bus)
    resumed.fit_sync(resume=tmp_path / "a" / "step-00000004.pt")
    assert [e.step for e in again.of_type(ev.CheckpointSaved)] == saved[2:]


def test_resuming_before_a_first_epoch_scheduler_step_does_not_warn(tmp_path: Path) -> None:
    _streamed(tmp_path / "a", every_steps=4, every_epochs=None).fit_sync()
    resumed = _streamed(tmp_path / "b", every_steps=4, every_epochs=None)
    assert resumed.fit_sync(resume=tmp_path / "a" / "step-00000004.pt").steps == 12

"""The resume matrix's runs, and the child process of its SIGKILL test.

:func:`build` makes the run of one :class:`Cell` of the matrix (tests/checkpoint/
test_resume_matrix.py), identically in every process that trains it.

Usage as a script: ``python _matrix_run.py CELL_JSON DIRECTORY OUT``: prints ``training`` once the
run started (``FitStarted``), trains the cell from DIRECTORY's latest checkpoint
(``resume="latest"``, checkpoints written there) to its end, sleeping
:data:`PACE_S` after each optimizer step, then writes the final parameters
to OUT. The parent SIGKILLs it at random moments and starts it again.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from trainbus import EvalSchedule, PerEpoch, Trainer
from trainbus import events as ev
from trainbus.callbacks import Checkpointing, EarlyStopping

SAMPLES, BATCH, FEATURES, CLASSES = 20, 4, 6, 3
"""5 training batches per epoch: steps of 2, 2 and 1 batches under ``accumulate=2``."""
EPOCHS = 3
PACE_S = 0.03
"""The SIGKILL test's children sleep this long after each optimizer step."""

AXES: Mapping[str, Sequence[Any]] = {
    # (eval_every, every_steps): saves at evaluation steps, or at steps between them.
    "cadence": ("coincide", "staggered"),
    "dropout": (True, False),
    "eval_data": ("loader", "shuffled-loader", "list", "factory"),
    "train_data": ("map", "iterable"),
    "accumulate": (1, 2),
    "scheduler": ("step", "epoch"),
    "stopping": (True, False),
    "precision": ("32", "bf16"),
}
CADENCES = {"coincide": (2, 2), "staggered": (3, 2)}


@dataclass(frozen=True)
class Cell:
    """One configuration of the matrix."""

    cadence: str
    dropout: bool
    eval_data: str
    train_data: str
    accumulate: int
    scheduler: str
    stopping: bool
    precision: str

    @property
    def id(self) -> str:
        return "-".join([
            self.cadence, "dropout" if self.dropout else "plain", self.eval_data,
            self.train_data, f"acc{self.accumulate}", f"{self.scheduler}-sched",
            "stopping" if self.stopping else "no-stopping", f"p{self.precision}",
        ])  # fmt: skip


class _Stream(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    """A streaming training set (no length, no sampler): samples in a fixed order."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return zip(self.x, self.y, strict=True)


class _Factory:
    """Evaluation data made anew by a zero-argument function at each evaluation."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def make(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for i in range(0, len(self.x), BATCH):
            yield self.x[i : i + BATCH], self.y[i : i + BATCH]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self.make()


def _data(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, FEATURES, generator=g), torch.randint(0, CLASSES, (n,), generator=g)


def build(cell: Cell, checkpoint_dir: Path) -> Trainer:
    """The cell's run, built identically for the uninterrupted run and every resume."""
    x, y = _data(1, SAMPLES)
    train: Any
    if cell.train_data == "map":
        own = torch.Generator().manual_seed(2)
        train = DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=True, generator=own)
    else:
        train = DataLoader(_Stream(x, y), batch_size=BATCH)
    vx, vy = _data(3, 12)
    evaluation: Any
    if cell.eval_data == "loader":
        evaluation = DataLoader(TensorDataset(vx, vy), batch_size=BATCH)
    elif cell.eval_data == "shuffled-loader":
        evaluation = DataLoader(TensorDataset(vx, vy), batch_size=BATCH, shuffle=True)
    elif cell.eval_data == "list":
        evaluation = [(vx[i : i + BATCH], vy[i : i + BATCH]) for i in range(0, 12, BATCH)]
    else:
        evaluation = _Factory(vx, vy)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 16), torch.nn.ReLU(),
        torch.nn.Dropout(0.3) if cell.dropout else torch.nn.Identity(),
        torch.nn.Linear(16, CLASSES),
    )  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
    eval_every, every_steps = CADENCES[cell.cadence]
    callbacks: list[Any]
    if cell.stopping:
        callbacks = [
            Checkpointing(
                every_steps=every_steps, every_epochs=None, monitor="val_loss", keep_best=1
            ),
            EarlyStopping("val_loss", patience=2, min_delta=0.002),
        ]
    else:
        callbacks = [Checkpointing(every_steps=every_steps, every_epochs=1)]
    return Trainer(
        model,
        opt,
        train,
        loss_fn=F.cross_entropy,
        eval_data=evaluation,
        eval_schedule=EvalSchedule(every_steps=eval_every),
        max_epochs=EPOCHS,
        scheduler=PerEpoch(sched) if cell.scheduler == "epoch" else sched,
        accumulate=cell.accumulate,
        precision=cell.precision,
        seed=5,
        device="cpu",
        log_every=4,
        checkpoint_dir=checkpoint_dir,
        callbacks=callbacks,
        on_signal=None,
        attach=False,
    )


def main() -> None:
    cell = Cell(**json.loads(sys.argv[1]))
    directory, out = Path(sys.argv[2]), Path(sys.argv[3])
    torch.set_num_threads(1)
    trainer = build(cell, directory)
    # Paced, so that the parent's random moments fall inside the training: a sleep draws no
    # random number, so the run stays the one under test.
    trainer.add_hook("after_optimizer_step", lambda ctx: time.sleep(PACE_S))
    # stdout carries the one line the parent waits for; log lines go to stderr.
    trainer.bus.subscribe(trainer.bus.stream(ev.FitStarted),
                          lambda _: print("training", flush=True), name="started")  # fmt: skip
    trainer.fit_sync(resume="latest")
    # Written whole or not at all: a kill during the write leaves no OUT, so the parent starts
    # the run again (resumed from its final checkpoint) instead of reading half a file.
    partial = out.with_name(out.name + ".partial")
    torch.save([p.detach().clone() for p in trainer.settings.model.parameters()], partial)
    os.replace(partial, out)


if __name__ == "__main__":
    main()

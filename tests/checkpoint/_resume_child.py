"""A run that must resume exactly, and the child process of the SIGKILL resume test.

:func:`build` makes the run: a shuffled ``DataLoader`` (with or without its own generator), a
model with dropout, gradient accumulation over an epoch whose length is not a multiple of it, a
step scheduler, and ``Checkpointing(every_steps=...)``.

Usage as a script: ``python _resume_child.py DIRECTORY OUT``. Imports torch once, then for each
``go [STEP WHERE]`` line on stdin forks a child that resumes the run from DIRECTORY
(``resume="latest"``) and trains to the end, saving a checkpoint every step; a child that
completes writes the final parameters to OUT. With ``STEP WHERE`` the child SIGKILLs itself in
optimizer step STEP (counted from 1), at one of :data:`KILL_POINTS`: a chosen moment, not a
timer's. This process prints ``child <pid>`` and, once the child is gone (killed or done),
``reaped <pid> <status>``. EOF on stdin ends it.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import structlog
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from trainbus import StepContext, Trainer
from trainbus.callbacks import Checkpointing

SAMPLES, BATCH, ACCUMULATE = 38, 4, 3  # 10 batches per epoch: steps of 3, 3, 3 and 1
KILLED_EPOCHS = 5
"""Epochs of the run the SIGKILL test kills: 20 steps."""
KILL_POINTS = ("mid-step", "after-step", "mid-write")
"""Where a child kills itself in its step: after the step's second micro-batch's backward
(gradients half accumulated), after the optimizer step (before that step's checkpoint), or
inside that step's checkpoint write (the temp file written, not yet fsynced nor renamed)."""


def build(
    checkpoint_dir: Path | None,
    *,
    generator: bool,
    max_epochs: int = 3,
    every_steps: int | None = None,
    **kwargs: Any,
) -> Trainer:
    """The run under test, built identically by every process that trains it."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(SAMPLES, 6, generator=g)
    y = torch.randint(0, 3, (SAMPLES,), generator=g)
    own = torch.Generator().manual_seed(11) if generator else None
    loader = DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=True, generator=own)
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                                torch.nn.Linear(16, 3))  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.9)
    callbacks = []
    if every_steps is not None:
        callbacks.append(Checkpointing(every_steps=every_steps, every_epochs=None))
    trainer = Trainer(model, opt, loader, loss_fn=F.cross_entropy, max_epochs=max_epochs,
                      scheduler=sched, accumulate=ACCUMULATE, seed=5, device="cpu",
                      checkpoint_dir=checkpoint_dir, callbacks=callbacks, on_signal=None,
                      **kwargs)  # fmt: skip
    return trainer


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def kill_in_step(trainer: Trainer, step: int, where: str) -> None:
    """Make this process SIGKILL itself in optimizer step ``step`` at ``where`` (one of
    :data:`KILL_POINTS`). Hooks draw no random number: the run stays the one under test."""
    if where == "mid-step":

        def mid_window(ctx: StepContext) -> None:
            if ctx.step == step - 1 and ctx.micro_batch == 1:
                _die()

        trainer.add_hook("after_backward", mid_window)
    elif where in ("after-step", "mid-write"):

        def after_step(ctx: StepContext) -> None:
            if ctx.step == step:
                if where == "after-step":
                    _die()
                # The next fsync is the one of this step's checkpoint file, before its rename.
                os.fsync = lambda fd: _die()

        trainer.add_hook("after_optimizer_step", after_step)
    else:
        raise ValueError(f"where: {where!r} is not one of {KILL_POINTS}")


def main() -> None:
    directory, out = Path(sys.argv[1]), Path(sys.argv[2])
    # stdout carries the protocol; log lines go to stderr.
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    torch.set_num_threads(1)  # no intra-op thread pool to inherit across fork
    build(None, generator=True)  # imports and warms everything here, once
    for line in sys.stdin:
        words = line.split()
        pid = os.fork()
        if pid == 0:
            try:
                trainer = build(directory, generator=True, max_epochs=KILLED_EPOCHS,
                                every_steps=1)  # fmt: skip
                if len(words) == 3:
                    kill_in_step(trainer, int(words[1]), words[2])
                trainer.fit_sync(resume="latest")
                torch.save([p.detach().clone() for p in trainer.settings.model.parameters()], out)
                os._exit(0)
            finally:
                os._exit(1)
        print("child", pid, flush=True)
        _, status = os.waitpid(pid, 0)
        print("reaped", pid, status, flush=True)


if __name__ == "__main__":
    main()

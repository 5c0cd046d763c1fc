"""Child process of the SIGKILL test: forks writers that save checkpoints until killed.

Usage: ``python _writer.py DIRECTORY``. Imports torch once, then for each
``go <first_step> [POINT]`` line on stdin forks a writer process and prints ``child <pid>``; the
writer prints ``ready`` once its first checkpoint is complete and saves on until it is killed
(with POINT, one of :data:`KILL_POINTS`, it SIGKILLs itself there in its second save); this
process reaps it and prints ``reaped <pid> <status>``. EOF on stdin ends it. Forking from an
imported parent makes each round cost one save, not one torch import.

A writer keeps the 3 newest files, deleting an old one only after its successor is complete
(the retention rule), so the folder stays small.
"""

from __future__ import annotations

import io
import os
import signal
import sys
from pathlib import Path
from typing import Any

import structlog

# The forked writers save CPU tensors only. On a GPU host the zygote's capture_rng() would start
# CUDA, which a forked child cannot use (its RNG read then fails): hide the GPU before torch.
os.environ["CUDA_VISIBLE_DEVICES"] = ""

import torch

from trainbus.checkpoint import TrainState, capture_rng, save_checkpoint

KILL_POINTS = ("mid-bytes", "before-rename", "after-rename")
"""Where a writer kills itself in a save: with half the file's bytes written to the temp file;
with the temp file complete and fsynced, at the rename; right after the rename (the folder not
yet fsynced)."""


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def arm(point: str) -> None:
    """Make this process SIGKILL itself at ``point`` of its next save."""
    if point == "mid-bytes":
        real_save = torch.save

        def half_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
            whole = io.BytesIO()
            real_save(obj, whole, *args, **kwargs)
            data = whole.getvalue()
            f.write(data[: len(data) // 2])
            f.flush()
            _die()

        torch.save = half_save
    elif point in ("before-rename", "after-rename"):
        real_replace = os.replace

        def replace(src: Any, dst: Any) -> None:
            if point == "after-rename":
                real_replace(src, dst)
            _die()

        os.replace = replace
    else:
        raise ValueError(f"point: {point!r} is not one of {KILL_POINTS}")


def write_forever(directory: Path, step: int, point: str | None) -> None:
    torch.manual_seed(step)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 256))  # ~1 MB
    opt = torch.optim.Adam(model.parameters())
    model(torch.zeros(1, 256)).sum().backward()
    opt.step()  # Adam state: the file holds optimizer tensors too
    ready = False
    while True:
        save_checkpoint(directory, tag=None, state=TrainState(step=step), model=model,
                        optimizer=opt, scheduler=None, scaler=None,
                        metrics={"loss": float(step)})  # fmt: skip
        if not ready:
            print("ready", flush=True)
            ready = True
            if point is not None:
                arm(point)
        for old in sorted(directory.glob("step-*.pt"))[:-3]:
            old.unlink(missing_ok=True)
        step += 1


def main() -> None:
    directory = Path(sys.argv[1])
    # stdout carries the protocol; the store's log lines go to stderr.
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    capture_rng()  # imports NumPy and warms torch here, once, not in every forked writer
    torch.optim.Adam(torch.nn.Linear(2, 2).parameters()).step()
    for line in sys.stdin:
        words = line.split()
        step, point = int(words[1]), (words[2] if len(words) > 2 else None)
        pid = os.fork()
        if pid == 0:
            try:
                write_forever(directory, step, point)
            finally:
                os._exit(1)
        print("child", pid, flush=True)
        _, status = os.waitpid(pid, 0)
        print("reaped", pid, status, flush=True)


if __name__ == "__main__":
    main()

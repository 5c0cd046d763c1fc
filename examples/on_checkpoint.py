"""React to checkpoints, and ask for them from a pipeline.

Two directions on the same bus:

- events -> you: ``bus.events.pipe(ops.filter(is_save))`` sees every ``CheckpointSaved`` (and
  ``tbops.of_type`` does the same with the item type narrowed for type checkers);
- you -> the loop: ``bus.stream(ev.StepEnded).pipe(tbops.every(20), ops.map(... SaveCheckpoint))``
  turns every 20th step into a ``SaveCheckpoint`` command, sent on the back-channel
  ``bus.commands``; the loop applies it at its next poll point and publishes ``CheckpointSaved``.

Run: ``python examples/on_checkpoint.py``
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import structlog
import torch
import torch.nn.functional as F
from reactivex import operators as ops

from trainbus import Trainer
from trainbus import commands as cmd
from trainbus import events as ev
from trainbus import operators as tbops
from trainbus.testing import tiny_loader, tiny_model

structlog.configure(
    processors=[
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="%H:%M:%S"),
        structlog.dev.ConsoleRenderer(colors=False),
    ]
)
log = structlog.get_logger("on_checkpoint")

SAVE_EVERY = 20


def is_save(e: ev.BaseEvent) -> bool:
    return isinstance(e, ev.CheckpointSaved)


def main() -> None:
    torch.set_num_threads(1)  # tiny model: extra intra-op threads only compete for 2 cores
    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_model()
        trainer = Trainer(
            model,
            torch.optim.SGD(model.parameters(), lr=0.05),
            tiny_loader(batches=25),
            loss_fn=F.cross_entropy,
            max_steps=90,
            # Nothing is written until the first save; a run that completes also writes a
            # "final" checkpoint unless the last step was just saved.
            checkpoint_dir=Path(tmp) / "ckpt",
        )
        bus = trainer.bus
        seen: list[ev.CheckpointSaved] = []
        narrowed: list[str] = []

        # The canonical form. `bus.events` is every event, so subscribing to it makes the loop
        # build every event type (even per-micro-batch ones); in a hot run prefer
        # `bus.stream(ev.CheckpointSaved)`, which registers demand for that type only.
        def on_saved(e: ev.CheckpointSaved) -> None:
            seen.append(e)
            log.info("checkpoint_saved", step=e.step, tag=e.tag, path=Path(e.path).name)

        bus.events.pipe(ops.filter(is_save)).subscribe(on_saved)

        # The same selection with `of_type`: downstream operators see `CheckpointSaved`, so
        # `e.path` type-checks without a cast.
        bus.events.pipe(
            tbops.of_type(ev.CheckpointSaved),
            ops.map(lambda e: e.path),
        ).subscribe(narrowed.append)

        # A decision pipeline: every 20th step becomes a SaveCheckpoint command (the tag records
        # the step that asked). StepEnded is not a barrier, so the loop never waits for this
        # pipeline: the bus delivers events every ~20 ms, and the command lands at the loop's
        # first poll point after that, a few steps later (here often at the epoch-end barrier).
        # Decisions that must land at an exact step belong on barrier events (EvaluationEnded,
        # EpochEnded), where the loop waits for subscribers before going on.
        bus.stream(ev.StepEnded).pipe(
            tbops.every(SAVE_EVERY),
            ops.map(lambda e: cmd.SaveCheckpoint(tag=f"asked-at-{e.step}")),
        ).subscribe(bus.commands)

        result = trainer.fit_sync()

        # Every save was reported to both subscribers before run() returned, and each path is a
        # complete checkpoint (written atomically) that torch can load.
        assert seen and [e.path for e in seen] == narrowed, (seen, narrowed)
        for e in seen:
            state = torch.load(e.path, map_location="cpu", weights_only=False)
            assert state["state"]["step"] == e.step
        assert result.last_checkpoint == seen[-1].path
        saved = ", ".join(f"{e.tag}->step {e.step}" for e in seen)
        print(
            f"on_checkpoint: {len(seen)} checkpoints saved in {result.steps} steps ({saved}), "
            "each seen by filter(is_save) and of_type and loadable"
        )


if __name__ == "__main__":
    main()

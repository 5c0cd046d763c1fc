"""Child process of the disk-error test: a run whose checkpoint writes the kernel refuses.

Usage: ``python _file_size_limit.py DIRECTORY``. Trains a tiny model with
``Checkpointing(every_steps=1)``; after step 1's checkpoint the training thread lowers
``RLIMIT_FSIZE`` below a checkpoint's size, so every later write fails in the kernel with
``EFBIG`` (what a full disk does with ``ENOSPC``, without root or a tiny file system). Prints one
JSON line: the result, the run's error, the ``checkpoint_save_failed`` log lines and the folder.
"""

from __future__ import annotations

import json
import resource
import signal
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from structlog.testing import capture_logs

from trainbus import StepContext, Trainer
from trainbus import events as ev
from trainbus.callbacks import Checkpointing
from trainbus.testing import EventRecorder, tiny_loader, tiny_model


def main(directory: Path) -> None:
    # Past the limit the kernel sends SIGXFSZ (default: kill); ignored, write() fails with EFBIG.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    model = tiny_model()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_loader(16, 8),
                      loss_fn=F.cross_entropy, max_steps=15, checkpoint_dir=directory,
                      callbacks=[Checkpointing(every_steps=1, every_epochs=None)],
                      on_signal=None, progress=False)  # fmt: skip

    def fill_disk(ctx: StepContext) -> None:
        if ctx.step == 2:  # after step 1's save was applied, before step 2's
            resource.setrlimit(resource.RLIMIT_FSIZE, (2048, resource.RLIM_INFINITY))

    trainer.add_hook("after_optimizer_step", fill_disk)
    rec = EventRecorder(trainer.bus)
    error: BaseException | None = None
    with capture_logs() as logs:
        try:
            trainer.fit_sync()
        except BaseException as exc:
            error = exc
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    result = trainer.result
    assert result is not None
    acks = [a for a in rec.of_type(ev.CommandApplied)]
    print(json.dumps({
        "reason": result.reason,
        "failed_saves": result.failed_saves,
        "checkpoint": result.last_checkpoint,
        "error_type": type(error).__name__,
        "error": str(error),
        "error_errno": getattr(error, "errno", None),
        "error_path": getattr(error, "path", None),
        "is_os_error": isinstance(error, OSError),
        "refused_acks": [str(a.error) for a in acks if a.error is not None],
        "saved": [s.path for s in rec.of_type(ev.CheckpointSaved)],
        "warnings": [{k: v for k, v in e.items() if isinstance(v, str | int | None)}
                     for e in logs if e["event"] == "checkpoint_save_failed"],
        "files": sorted(p.name for p in directory.iterdir()),
    }))  # fmt: skip


if __name__ == "__main__":
    main(Path(sys.argv[1]))

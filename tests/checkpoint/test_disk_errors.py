"""Disk errors speak: each refused save is logged naming the file and the OS error (bounded),
``FitResult.failed_saves`` counts them, the final save's error names the file, and the earlier
checkpoint stays valid with no partial file left."""

from __future__ import annotations

import errno
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from structlog.testing import capture_logs

import trainbus
from trainbus import CheckpointError, StepContext, Trainer
from trainbus import events as ev
from trainbus.callbacks import Checkpointing
from trainbus.checkpoint import CheckpointStore, CheckpointWriteError, read_checkpoint
from trainbus.checkpoint import _store as store_module
from trainbus.checkpoint._store import TEMP_SUFFIX
from trainbus.testing import EventRecorder, tiny_loader, tiny_model

from .conftest import write

CHILD = Path(__file__).with_name("_file_size_limit.py")
SRC = str(Path(trainbus.__file__).resolve().parents[1])


def _trainer(folder: Path, **kwargs: Any) -> Trainer:
    model = tiny_model()
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_loader(8, 8),
                   loss_fn=F.cross_entropy, checkpoint_dir=folder, on_signal=None,
                   progress=False, **kwargs)  # fmt: skip


class _Disk:
    """Makes the store's writes fail with ``error`` while ``full`` (the lowest write call the
    store makes: each chunk ``torch.save`` hands to the file)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, code: int = errno.ENOSPC) -> None:
        self.full = False
        real = store_module._Sink.write
        disk = self

        def write(sink: Any, data: Any) -> int:
            if disk.full:
                # What the file object does: fail, and the sink records it as the real one.
                try:
                    raise OSError(code, os.strerror(code))
                except OSError as exc:
                    sink.error = exc
                    raise
            return real(sink, data)

        monkeypatch.setattr(store_module._Sink, "write", write)


def _failures(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == "checkpoint_save_failed"]


def test_refused_periodic_saves_are_logged_counted_and_the_run_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    disk = _Disk(monkeypatch)
    trainer = _trainer(tmp_path, max_steps=6,
                       callbacks=[Checkpointing(every_steps=1, every_epochs=None)])  # fmt: skip

    def fill(ctx: StepContext) -> None:
        disk.full = ctx.step in (3, 4)  # the saves of steps 3 and 4 are refused

    trainer.add_hook("after_optimizer_step", fill)
    rec = EventRecorder(trainer.bus)
    with capture_logs() as logs:
        result = trainer.fit_sync()
    assert result.reason == "completed" and result.failed_saves == 2
    warned = _failures(logs)
    assert [(w["path"], w["step"], w["log_level"]) for w in warned] == [
        (str(tmp_path / "step-00000003.pt"), 3, "warning"),
        (str(tmp_path / "step-00000004.pt"), 4, "warning"),
    ]
    assert all(w["error"] == "[Errno 28] No space left on device" for w in warned)
    assert warned[0]["last_checkpoint"] == str(tmp_path / "step-00000002.pt")
    errors = [a.error for a in rec.of_type(ev.CommandApplied) if a.error is not None]
    assert len(errors) == 2 and all(isinstance(e, CheckpointWriteError) for e in errors)
    assert [e.errno for e in errors] == [errno.ENOSPC, errno.ENOSPC]  # type: ignore[union-attr]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step-00000001.pt", "step-00000002.pt", "step-00000005.pt", "step-00000006.pt",
    ]  # fmt: skip


def test_a_refused_final_save_fails_the_run_naming_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    disk = _Disk(monkeypatch)
    trainer = _trainer(tmp_path, max_steps=4,
                       callbacks=[Checkpointing(every_steps=2, every_epochs=None)])  # fmt: skip
    trainer.add_hook("after_optimizer_step", lambda ctx: setattr(disk, "full", ctx.step > 2))
    rec = EventRecorder(trainer.bus)
    with capture_logs() as logs, pytest.raises(CheckpointWriteError) as info:
        trainer.fit_sync()
    final = str(tmp_path / "step-00000004-final.pt")
    # The periodic save of step 4 and then the final one: both refused, both named.
    assert [w["path"] for w in _failures(logs)] == [str(tmp_path / "step-00000004.pt"), final]
    err = info.value
    assert isinstance(err, OSError) and isinstance(err, CheckpointError)
    assert err.errno == errno.ENOSPC and err.path == err.filename == final
    assert str(err) == f"checkpoint {final}: could not be written: [Errno 28] " + os.strerror(28)
    assert isinstance(err.__cause__, OSError) and err.__cause__.errno == errno.ENOSPC
    result = trainer.result
    assert result is not None and result.reason == "failed" and result.failed_saves == 2
    assert result.last_checkpoint == str(tmp_path / "step-00000002.pt")
    assert rec.of_type(ev.FitEnded)[0].error is err
    # The earlier checkpoint is intact and nothing partial is left.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000002.pt"]
    assert read_checkpoint(tmp_path / "step-00000002.pt").state.step == 2


def test_refusals_are_logged_bounded_and_all_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    disk = _Disk(monkeypatch)
    disk.full = True
    trainer = _trainer(tmp_path, max_steps=24,
                       callbacks=[Checkpointing(every_steps=1, every_epochs=None)])  # fmt: skip
    with capture_logs() as logs, pytest.raises(CheckpointWriteError):
        trainer.fit_sync()
    assert trainer.result is not None and trainer.result.failed_saves == 25  # 24 + the final
    assert [w["failed_saves"] for w in _failures(logs)] == [1, 2, 3, 10]  # not 20
    assert "from now on logged at 10, 100, 1000" in _failures(logs)[2]["note"]
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_the_kernel_refusing_writes_in_a_real_process(tmp_path: Path) -> None:
    """RLIMIT_FSIZE makes the kernel refuse every write past a size (EFBIG), as a full disk
    refuses with ENOSPC: no patching, the store meets a real failing write(2)."""
    folder = tmp_path / "ck"
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, str(CHILD), str(folder)], capture_output=True,
                          text=True, env=env, timeout=100, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    final = str(folder / "step-00000015-final.pt")
    assert (out["reason"], out["error_type"], out["is_os_error"]) == (
        "failed", "CheckpointWriteError", True,
    )  # fmt: skip
    assert out["error_errno"] == errno.EFBIG and out["error_path"] == final
    assert out["error"].startswith(f"checkpoint {final}: could not be written: [Errno 27]")
    assert out["failed_saves"] == 15  # steps 2..15 and the final save
    assert len(out["refused_acks"]) == 14
    steps = zip(range(2, 16), out["refused_acks"], strict=True)
    assert all(f"step-{k:08d}.pt" in ack for k, ack in steps)
    assert [w["failed_saves"] for w in out["warnings"]] == [1, 2, 3, 10]
    assert out["warnings"][0]["path"] == str(folder / "step-00000002.pt")
    assert out["warnings"][0]["error"].startswith("[Errno 27]")
    assert out["saved"] == [str(folder / "step-00000001.pt")] == [out["checkpoint"]]
    assert out["files"] == ["step-00000001.pt"]  # no temp file, no partial file
    assert read_checkpoint(folder / "step-00000001.pt").state.step == 1


def test_a_folder_that_refuses_writes_names_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EACCES at the temp file's creation (a folder made read-only under the run; root writes
    anywhere, so the refusal is made at the store's ``os.open``)."""
    good = CheckpointStore(tmp_path).save({"x": torch.zeros(1)}, step=1)
    real_open = os.open

    def refuse(path: Any, flags: int, *args: Any) -> int:
        if str(path).endswith(TEMP_SUFFIX):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(store_module.os, "open", refuse)
    with pytest.raises(CheckpointWriteError) as info:
        CheckpointStore(tmp_path).save({"x": torch.zeros(1)}, step=2, tag="final")
    assert info.value.errno == errno.EACCES
    assert info.value.path == str(tmp_path / "step-00000002-final.pt")
    assert "Permission denied" in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == [good.name]


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes anywhere")
def test_a_read_only_folder_refuses_and_names_the_file(tmp_path: Path) -> None:
    folder = tmp_path / "ck"
    write(folder, step=1)
    folder.chmod(0o500)
    try:
        with pytest.raises(CheckpointWriteError) as info:
            CheckpointStore(folder).save({"x": torch.zeros(1)}, step=2)
    finally:
        folder.chmod(0o700)
    assert info.value.errno == errno.EACCES
    assert info.value.path == str(folder / "step-00000002.pt")


def test_the_write_error_pickles_with_its_path_and_errno() -> None:
    # A Ray worker's error crosses processes pickled.
    err = CheckpointWriteError("/runs/x/step-00000002.pt", OSError(errno.ENOSPC, "No space"))
    back = pickle.loads(pickle.dumps(err))
    assert isinstance(back, CheckpointWriteError) and str(back) == str(err)
    assert (back.errno, back.filename, back.path) == (errno.ENOSPC, err.path, err.path)

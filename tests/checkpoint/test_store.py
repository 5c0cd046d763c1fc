"""The checkpoint folder: safe loads, damaged files, the newest valid file, stale temps,
and the up-front check of ``checkpoint_dir``."""

from __future__ import annotations

import io
import os
import random
import zipfile
from pathlib import Path

import pytest
import structlog
import torch

from trainbus import CheckpointError, ConfigError
from trainbus.checkpoint import (
    CheckpointStore,
    TrainState,
    check_checkpoint_dir,
    latest_checkpoint,
    read_checkpoint,
)
from trainbus.checkpoint._store import TEMP_SUFFIX

from .conftest import trained, write


class _Payload:
    """Unpickling this runs ``exec``: it writes ``marker``. A crafted checkpoint would."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return exec, (f"with open({str(self.marker)!r}, 'w') as f: f.write('pwned')",)


def _crafted(path: Path, marker: Path) -> Path:
    torch.save({"magic": "trainbus-checkpoint", "model": _Payload(marker)}, path)
    return path


# ---------------------------------------------------------------------------- safe loading


def test_a_crafted_pickle_is_refused_and_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    evil = _crafted(tmp_path / "step-99999999.pt", marker)
    with pytest.raises(CheckpointError, match=r"step-99999999\.pt: refused by safe loading"):
        read_checkpoint(evil)
    assert not marker.exists()
    # Resuming "latest" used to pick this file by its name and run it; now it is skipped.
    good = write(tmp_path, step=3)
    assert latest_checkpoint(tmp_path) == good
    assert not marker.exists()
    # The payload is real: an unsafe load runs it (so the assertions above can fail).
    torch.load(evil, weights_only=False)
    assert marker.read_text() == "pwned"


def test_a_valid_file_round_trips(valid: Path) -> None:
    ck = read_checkpoint(valid)
    assert ck.path == valid and ck.state == TrainState(step=3)


def _damaged(valid: Path, how: str) -> bytes:
    data = valid.read_bytes()
    match how:
        case "truncated":
            return data[: len(data) // 2]
        case "truncated-tail":
            return data[:-10]
        case "random":
            return random.Random(0).randbytes(len(data))
        case "empty":
            return b""
        case "flipped-tensor-byte":
            tensor = next(iter(read_checkpoint(valid).model.values()))
            raw = tensor.numpy().tobytes()[:16]
            i = data.index(raw)
            return data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1 :]
        case "wrong-zip":
            buf = io.BytesIO()
            with zipfile.ZipFile(buf, "w") as z:
                z.writestr("archive/data.pkl", b"not a pickle")
                z.writestr("readme.txt", b"hello")
            return buf.getvalue()
        case "other-torch-file":
            buf = io.BytesIO()
            torch.save({"weights": torch.ones(3)}, buf)
            return buf.getvalue()
        case "older-format":
            buf = io.BytesIO()
            torch.save({"format": 1, "model": {}}, buf)
            return buf.getvalue()
        case "missing-key":
            payload = torch.load(valid, weights_only=True)
            del payload["optimizer"]
            buf = io.BytesIO()
            torch.save(payload, buf)
            return buf.getvalue()
        case "wrong-version":
            payload = torch.load(valid, weights_only=True)
            payload["format"] = 99
            buf = io.BytesIO()
            torch.save(payload, buf)
            return buf.getvalue()
    raise AssertionError(how)


DAMAGE = {
    "truncated": "not a complete checkpoint archive",
    "truncated-tail": "not a complete checkpoint archive",
    "random": "not a complete checkpoint archive",
    "empty": "empty file",
    "flipped-tensor-byte": "fails its CRC check",
    "wrong-zip": "torch.load cannot read it",
    "other-torch-file": "not a trainbus checkpoint",
    "older-format": "older trainbus",
    "missing-key": "missing the 'optimizer' entry",
    "wrong-version": "format version 99",
}


@pytest.mark.parametrize("how", sorted(DAMAGE))
def test_a_damaged_or_foreign_file_is_a_checkpoint_error_naming_it(valid: Path, how: str) -> None:
    bad = valid.with_name("step-00000004.pt")
    bad.write_bytes(_damaged(valid, how))
    with pytest.raises(CheckpointError) as info:
        read_checkpoint(bad)
    assert str(bad) in str(info.value) and DAMAGE[how] in str(info.value)
    assert info.value.path == str(bad)


def test_latest_valid_skips_bad_files_and_logs_each(valid: Path) -> None:
    folder = valid.parent
    (folder / "step-00000010.pt").write_bytes(_damaged(valid, "truncated"))
    (folder / "step-00000009-best.pt").write_bytes(b"")
    (folder / "step-00000008.pt").write_bytes(_damaged(valid, "other-torch-file"))
    (folder / "notes.pt").write_bytes(b"ignored: not a checkpoint name")
    with structlog.testing.capture_logs() as logs:
        assert CheckpointStore(folder).latest_valid() == valid
    skipped = [(e["path"], e["log_level"]) for e in logs if e["event"] == "checkpoint_skipped"]
    names = ["step-00000010.pt", "step-00000009-best.pt", "step-00000008.pt"]
    assert skipped == [(str(folder / n), "warning") for n in names]
    assert all("reason" in e for e in logs if e["event"] == "checkpoint_skipped")
    assert all((folder / n).exists() for n in names)  # kept for a person to look at


def test_latest_orders_by_step_number_not_by_name(tmp_path: Path) -> None:
    write(tmp_path, step=99_999_999)
    big = write(tmp_path, step=100_000_000)  # 9 digits: sorts before 99999999 as a string
    assert latest_checkpoint(tmp_path) == big


def test_latest_of_a_missing_or_empty_folder_is_none(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path / "none") is None
    assert CheckpointStore(tmp_path).find_latest().checkpoint is None
    assert not (tmp_path / "none").exists()


# ---------------------------------------------------------------------------- writing


def test_save_leaves_only_the_final_file(tmp_path: Path) -> None:
    path = write(tmp_path / "a" / "b", step=7, tag="best")
    assert [p.name for p in path.parent.iterdir()] == ["step-00000007-best.pt"]
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask


def test_a_failed_save_removes_its_temp_file_and_keeps_the_previous_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    good = write(tmp_path, step=1)

    def full_disk(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space"):
        write(tmp_path, step=2)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == [good.name]
    assert latest_checkpoint(tmp_path) == good


def test_stale_temp_files_are_removed_on_open(tmp_path: Path) -> None:
    write(tmp_path, step=1)
    dead = 2**22 + 12345  # above the default pid_max: no such process
    stale = tmp_path / f".step-00000002.pt.{dead}.0a1b2c3d{TEMP_SUFFIX}"
    stale.write_bytes(b"half a checkpoint")
    mine_left = tmp_path / f".step-00000003.pt.{os.getpid()}.deadbeef{TEMP_SUFFIX}"
    mine_left.write_bytes(b"left by a killed process that had this pid")
    alive = tmp_path / f".step-00000004.pt.{os.getppid()}.0a1b2c3d{TEMP_SUFFIX}"
    alive.write_bytes(b"a writer that is still running")
    other = tmp_path / ".hidden"
    other.write_bytes(b"not ours")
    with structlog.testing.capture_logs() as logs:
        store = CheckpointStore(tmp_path)
    assert not stale.exists() and not mine_left.exists()
    assert alive.exists() and other.exists()
    removed = {e["path"] for e in logs if e["event"] == "checkpoint_temp_removed"}
    assert removed == {str(stale), str(mine_left)}
    assert store.clean_stale() == []


def test_clean_can_be_deferred(tmp_path: Path) -> None:
    tmp_path.joinpath(f".x.pt.{2**22 + 1}.00{TEMP_SUFFIX}").write_bytes(b"")
    store = CheckpointStore(tmp_path, clean=False)
    assert len(list(tmp_path.iterdir())) == 1
    assert len(store.clean_stale()) == 1


# ---------------------------------------------------------------------------- checkpoint_dir


def test_check_checkpoint_dir_accepts_new_and_existing_folders(tmp_path: Path) -> None:
    assert check_checkpoint_dir(tmp_path) == tmp_path
    assert check_checkpoint_dir(str(tmp_path / "a" / "b")) == tmp_path / "a" / "b"
    assert list(tmp_path.iterdir()) == []  # nothing left behind (the probe folder removed)


@pytest.mark.parametrize(
    ("make", "allowed"),
    [
        pytest.param(lambda p: p / "file", "this path is a file", id="is-a-file"),
        pytest.param(lambda p: p / "file" / "run", "file is a file", id="under-a-file"),
        pytest.param(lambda p: p / "file" / "a" / "b", "file is a file", id="deep-under-a-file"),
        pytest.param(lambda p: 5, "a folder path", id="not-a-path"),
        pytest.param(lambda p: "", "a folder path", id="empty"),
    ],
)
def test_check_checkpoint_dir_refuses(tmp_path: Path, make: object, allowed: str) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="checkpoint_dir") as info:
        check_checkpoint_dir(make(tmp_path))  # type: ignore[operator]
    assert allowed in str(info.value)


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes anywhere")
def test_check_checkpoint_dir_refuses_a_read_only_folder(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    try:
        with pytest.raises(ConfigError, match="no folder can be created in"):
            check_checkpoint_dir(ro / "run")
    finally:
        ro.chmod(0o700)


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_check_checkpoint_dir_refuses_a_folder_even_root_cannot_create() -> None:
    """``os.access`` says yes to root everywhere; /proc refuses every mkdir: found up front,
    not as a failed save at the end of the run."""
    with pytest.raises(ConfigError, match=r"^checkpoint_dir='/proc/trainbus-nope/runs' is "
                       r"invalid: .*no folder can be created in /proc"):  # fmt: skip
        check_checkpoint_dir("/proc/trainbus-nope/runs")


def test_model_state_survives_the_store(tmp_path: Path) -> None:
    model, _, _ = trained()
    ck = read_checkpoint(write(tmp_path))
    assert all(torch.equal(ck.model[k], v) for k, v in model.state_dict().items())

"""Faults: a writer SIGKILLed mid-write (at chosen points) or at random moments never leaves the
folder without a loadable checkpoint, and no mutation of a checkpoint's bytes escapes as
anything but CheckpointError."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import trainbus
from trainbus import CheckpointError
from trainbus.checkpoint import CheckpointStore, TrainState, read_checkpoint, save_checkpoint
from trainbus.checkpoint._store import TEMP_SUFFIX
from trainbus.testing import tiny_model

from ._writer import KILL_POINTS

WRITER = Path(__file__).with_name("_writer.py")
SRC = str(Path(trainbus.__file__).resolve().parents[1])


def _start_writers(folder: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen([sys.executable, str(WRITER), str(folder)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)  # fmt: skip


def _expect(child: subprocess.Popen[str], word: str) -> str:
    assert child.stdout is not None
    line = child.stdout.readline()
    assert line.split()[:1] == [word], f"expected {word!r}, got {line!r}"
    return line


def _check_folder(folder: Path) -> int:
    """What the next start finds: stale temp files removed, every checkpoint complete, the
    newest one the one resumed. Returns its step."""
    store = CheckpointStore(folder)  # the next start: stale temps are removed
    assert not [p for p in folder.iterdir() if p.name.endswith(TEMP_SUFFIX)]
    # Atomic writes: no file under a checkpoint name is ever partial (a direct write to the
    # final name fails this), so the newest file is the one resumed.
    for path in store.checkpoints():
        ck = read_checkpoint(path)
        assert ck.metrics == {"loss": float(ck.state.step)}
    latest = store.latest_valid()
    assert latest is not None and latest == store.checkpoints()[0]
    return read_checkpoint(latest).state.step


def _temps(folder: Path) -> list[Path]:
    return [p for p in folder.iterdir() if p.name.endswith(TEMP_SUFFIX)]


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "fork"), reason="the writers are forked")
def test_sigkill_mid_write_and_at_random_moments_always_leaves_a_loadable_checkpoint(
    tmp_path: Path,
) -> None:
    zygote = _start_writers(tmp_path)
    assert zygote.stdin is not None

    def start(line: str) -> int:
        assert zygote.stdin is not None
        zygote.stdin.write(line + "\n")
        zygote.stdin.flush()
        pid = int(_expect(zygote, "child").split()[1])
        _expect(zygote, "ready")  # this writer's first checkpoint is complete
        return pid

    def reaped() -> int:
        return int(_expect(zygote, "reaped").split()[2])  # its pid no longer runs

    step = 0
    try:
        # Chosen moments: the writer kills itself there in its second save (from a patched
        # torch.save / os.replace), so where each kill landed is known, not hoped for.
        for point in KILL_POINTS:
            pid = start(f"go {step} {point}")
            # A guard, not a timer: a writer that never reached its kill point is stopped by
            # SIGTERM after 60 s, which the status check below reports.
            guard = threading.Timer(60, os.kill, (pid, signal.SIGTERM))
            guard.start()
            try:
                status = reaped()
            finally:
                guard.cancel()
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, point
            temps = _temps(tmp_path)
            if point == "after-rename":
                # Renamed: the second save is complete and is the newest.
                assert not temps
                assert _check_folder(tmp_path) == step + 1
            else:
                # Killed mid-write: its temp file is left (stale: its pid is gone), the
                # checkpoint names hold only complete files, the first save is the newest.
                assert len(temps) == 1, [p.name for p in tmp_path.iterdir()]
                if point == "mid-bytes":
                    with pytest.raises(CheckpointError):
                        read_checkpoint(temps[0])  # half a file
                else:
                    assert read_checkpoint(temps[0]).state.step == step + 1  # complete
                assert _check_folder(tmp_path) == step
            step += 1_000  # the next writer writes newer steps

        # Random moments (seeded): wherever the kill lands, the same holds.
        rng = random.Random(1234)
        for _ in range(6):
            pid = start(f"go {step}")
            try:
                time.sleep(rng.uniform(0.0, 1.0))
            finally:
                os.kill(pid, signal.SIGKILL)
            reaped()
            assert _check_folder(tmp_path) >= step
            step = _check_folder(tmp_path) + 1_000
    finally:
        zygote.stdin.close()
        zygote.wait(timeout=60)
        assert zygote.stdout is not None
        zygote.stdout.close()


# ---------------------------------------------------------------------------- fuzzing


def _valid_bytes() -> bytes:
    model = tiny_model(8, 8, 4)
    opt = torch.optim.Adam(model.parameters())
    model(torch.zeros(1, 8)).sum().backward()
    opt.step()
    folder = Path(tempfile.mkdtemp())
    path = save_checkpoint(folder, tag=None, state=TrainState(step=1), model=model,
                           optimizer=opt, scheduler=None, scaler=None,
                           metrics={"val_loss": 1.0})  # fmt: skip
    data = path.read_bytes()
    path.unlink()
    folder.rmdir()
    return data


VALID = _valid_bytes()

_mutation = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, len(VALID) - 1), st.integers(1, 255)),
    st.tuples(st.just("truncate"), st.integers(0, len(VALID) - 1), st.just(0)),
    st.tuples(st.just("delete"), st.integers(0, len(VALID) - 1), st.integers(1, 64)),
    st.tuples(st.just("insert"), st.integers(0, len(VALID)), st.integers(0, 255)),
)


def _mutate(data: bytes, mutations: list[tuple[str, int, int]]) -> bytes:
    buf = bytearray(data)
    for kind, at, arg in mutations:
        at = min(at, max(len(buf) - 1, 0))
        if kind == "flip" and buf:
            buf[at] ^= arg
        elif kind == "truncate":
            del buf[at:]
        elif kind == "delete":
            del buf[at : at + arg]
        elif kind == "insert":
            buf[at:at] = bytes([arg])
    return bytes(buf)


@settings(max_examples=300, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(st.lists(_mutation, min_size=1, max_size=4))
def test_mutated_bytes_load_or_raise_checkpoint_error(
    tmp_path: Path, mutations: list[tuple[str, int, int]]
) -> None:
    path = tmp_path / "step-00000001.pt"
    data = _mutate(VALID, mutations)
    path.write_bytes(data)
    try:
        ck = read_checkpoint(path)
    except CheckpointError as exc:
        assert str(path) in str(exc)
    else:
        assert ck.state.step == 1  # a mutation the format tolerates (zip padding, say)


def test_the_fuzzer_starts_from_a_valid_file(tmp_path: Path) -> None:
    path = tmp_path / "step-00000001.pt"
    path.write_bytes(VALID)
    assert read_checkpoint(path).metrics == {"val_loss": 1.0}

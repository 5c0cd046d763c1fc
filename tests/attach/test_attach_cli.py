"""`trainbus attach RUN_DIR`: the command against a real job, as a user's terminal meets it."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import anyio
import pytest
import structlog

import trainbus
from trainbus import events as ev
from trainbus.cli import main

from ._job import Job, env

# Real processes on a loaded machine: each job starts Python and torch (tens of seconds).
pytestmark = pytest.mark.timeout(600)


def attach_cli(*args: str, stdin: int | None = None) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "trainbus", "attach", "--timeout", "30", *args]
    return subprocess.Popen(argv, env=env(),
                            stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip


def read_until(p: subprocess.Popen[str], word: str) -> list[str]:
    assert p.stdout is not None
    lines = []
    while line := p.stdout.readline():
        lines.append(line)
        if word in line:
            return lines
    raise AssertionError(f"no {word!r} in {lines} (stderr: {p.stderr.read() if p.stderr else ''})")


def test_stop_as_an_option_lands_at_the_paused_step(job: Callable[..., Job]) -> None:
    j = job("--max-steps", "40", "--pause-at", "8")
    j.wait_for("paused-8")
    out, err = attach_cli(str(j.run_dir), "--stop").communicate(timeout=240)
    assert "applied: StopTraining(reason='attach'" in out and "at step 8" in out, (out, err)
    assert "run ended at step 8: stopped (attach)" in out
    assert j.finish()["steps"] == 8


@pytest.mark.asyncio
async def test_the_prompt_steers_while_a_second_attachment_watches(
    job: Callable[..., Job],
) -> None:
    j = job("--max-steps", "20", "--pause-at", "4", "--pause-at", "9", "--pause-at", "15")
    await anyio.to_thread.run_sync(j.wait_for, "paused-4")
    applied: list[ev.CommandApplied] = []
    watcher = trainbus.attach(j.run_dir, timeout=30)
    watcher.subscribe(watcher.stream(ev.CommandApplied), applied.append)
    async with watcher:
        p = attach_cli(str(j.run_dir), stdin=subprocess.PIPE)
        assert p.stdin is not None
        await anyio.to_thread.run_sync(read_until, p, "attached to")
        p.stdin.write("bogus 1\nlr abc\nsave mine\n")
        p.stdin.flush()
        lines = await anyio.to_thread.run_sync(read_until, p, "applied: SaveCheckpoint")
        text = "".join(lines)
        assert "error: unknown or malformed command 'bogus 1' (commands: stop [reason], save " \
               "[tag], evaluate, lr VALUE, help, detach)" in text  # fmt: skip
        assert "error: lr needs a positive number, not 'abc'" in text
        assert "at step 4" in lines[-1] and "checkpoint @ step 4" in text
        await anyio.to_thread.run_sync(j.wait_for, "paused-9")
        p.stdin.write("lr 0.05\n")
        p.stdin.flush()
        lines = await anyio.to_thread.run_sync(read_until, p, "applied: SetLearningRate")
        assert "at step 9" in lines[-1]
        # Detach while the run is held at step 15, so the prompt's "detach" cannot race the
        # run's end (unheld, steps 10 to 20 take well under a second).
        await anyio.to_thread.run_sync(j.wait_for, "paused-15")
        p.stdin.write("detach\n")
        p.stdin.flush()
        out, _ = p.communicate(timeout=30)
        assert p.returncode == 0 and "detached (the run goes on)" in out, out
        assert "run ended" not in out
        j.release(15)
        ended = await watcher.wait(60)
    assert ended is not None and ended.step == 20  # detaching left the run alone
    assert [(type(a.command).__name__, a.step) for a in applied] == [
        ("SaveCheckpoint", 4), ("SetLearningRate", 9)]  # fmt: skip
    result = j.finish()
    assert result["steps"] == 20 and result["lr"] == 0.05


@pytest.fixture
def _restore_structlog() -> Iterator[None]:
    # main() configures structlog process-wide; later tests must not inherit it.
    yield
    structlog.reset_defaults()


@pytest.mark.usefixtures("_restore_structlog")
def test_bad_folders_are_clear_errors_naming_the_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nope"
    assert main(["attach", str(missing)]) == 1
    assert f"cannot attach to {missing}: no such folder" in capsys.readouterr().err
    assert main(["attach", str(tmp_path)]) == 1
    assert f"cannot attach to {tmp_path}: no running job there" in capsys.readouterr().err
    assert main(["attach", str(tmp_path), "--lr", "-1"]) == 2
    assert "lr" in capsys.readouterr().err

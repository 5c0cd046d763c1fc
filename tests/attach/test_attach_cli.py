"""`trainbus attach RUN_DIR`: the command against a real job, as a user's terminal meets it."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import structlog

import trainbus
from trainbus import _wire as wire
from trainbus import events as ev
from trainbus._cli import main
from trainbus._cli.attach import View

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


def read_records(
    p: subprocess.Popen[str], records: list[dict[str, Any]], until: Callable[[Any], bool]
) -> None:
    """Read ``--json`` output record by record (each line must be one whole JSON record) into
    ``records`` until one satisfies ``until``."""
    assert p.stdout is not None
    while line := p.stdout.readline():
        record = json.loads(line)
        assert line.endswith("\n") and record["v"] == wire.FORMAT_VERSION, line
        records.append(record)
        if until(record):
            return
    raise AssertionError(f"the output ended after {records[-3:]} (stderr: "
                         f"{p.stderr.read() if p.stderr else ''})")  # fmt: skip


def test_json_records_arrive_one_by_one_and_a_kill_loses_none(job: Callable[..., Job]) -> None:
    j = job("--max-steps", "40", "--pause-at", "2", "--pause-at", "12")
    j.wait_for("paused-2")
    p = attach_cli(str(j.run_dir), "--json", stdin=subprocess.DEVNULL)
    records: list[dict[str, Any]] = []
    # The job sends status records (every second) only to an attachment it subscribed for:
    # once one is read, none of the job's events after step 2 can be missed.
    read_records(p, records, until=lambda r: r["type"] == "status")
    j.release(2)
    read_records(p, records, until=lambda r: r["type"] == "StepEnded" and r["step"] == 11)
    # Each record came through the pipe as it was printed: the job is held in step 12, its
    # run not over, and step 11's record is here already.
    assert j.process.poll() is None and not (j.run_dir / "result-rank0.json").exists()
    p.kill()  # SIGKILL: no exit handler flushes anything
    rest, _ = p.communicate(timeout=60)  # what it printed before the kill, not read yet
    assert rest == "" or rest.endswith("\n")
    after = [json.loads(line) for line in rest.splitlines()]
    assert all(r["type"] == "status" for r in after), after  # the job is held: no events
    events = [r for r in records + after if r["type"] != "status"]
    steps = [r["step"] for r in events if r["type"] == "StepEnded"]
    assert steps == list(range(steps[0], 12)) and steps[0] <= 3  # none lost, none twice
    logged = [r["step"] for r in events if r["type"] == "MetricsLogged"]
    assert logged == [s for s in (5, 10) if s >= steps[0]]
    j.release(12)
    assert j.finish()["steps"] == 40  # the killed attachment left the run alone


def test_json_reader_closing_the_pipe_detaches_quietly(job: Callable[..., Job]) -> None:
    j = job("--max-steps", "30", "--pause-at", "2", "--pause-at", "20")
    j.wait_for("paused-2")
    p = attach_cli(str(j.run_dir), "--json", stdin=subprocess.DEVNULL)
    read_records(p, [], until=lambda r: r["type"] == "status")
    assert p.stdout is not None
    p.stdout.close()  # the reader goes away, as `| head -n 1` does
    j.release(2)  # events flow: the next record finds the pipe closed
    _, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert "subscriber_failed" not in err, err
    j.wait_for("paused-20")
    j.release(20)
    assert j.finish()["steps"] == 30  # detaching left the run alone


@pytest.mark.asyncio
async def test_each_json_record_is_in_the_pipe_when_it_is_shown() -> None:
    read_end, write_end = os.pipe()
    os.set_blocking(read_end, False)  # an empty pipe raises instead of waiting
    err = io.StringIO()
    with os.fdopen(write_end, "w") as out:  # a pipe: block-buffered, as a script's stdout
        try:
            view = View(out, json_records=True, err=err)
            step = ev.StepEnded(step=3, epoch=0, loss=0.5, lr=0.1, grad_norm=None, samples=8,
                                duration_s=0.01)  # fmt: skip
            view.show(step)
            assert os.read(read_end, 1 << 16) == wire.dumps(step)
            view.status({"queue_depth": 0, "holding": []})
            status = json.loads(os.read(read_end, 1 << 16))
            assert status == {"v": wire.FORMAT_VERSION, "type": "status", "queue_depth": 0,
                              "holding": []}  # fmt: skip
            view.line("error: shown on stderr")  # stdout stays records only
            with pytest.raises(BlockingIOError):
                os.read(read_end, 1 << 16)
            assert err.getvalue() == "error: shown on stderr\n"
        finally:
            os.close(read_end)  # the reader goes away
        view.show(step)
        assert view.gone.is_set()
        view.show(step)  # nothing more is written, nothing raises


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

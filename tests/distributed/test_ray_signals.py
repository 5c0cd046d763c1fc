"""Ctrl-C on a real Ray driver script (``scripts/ray_driver.py``, its own local Ray): the first
signal stops every rank gracefully, a second one kills the workers at once; either way nothing
of the run is left running once the script exited."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ._torchrun import SCRIPTS, env

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)"),
]


@pytest.fixture(autouse=True)
def _ray_installed() -> None:
    pytest.importorskip(
        "ray.train.torch", reason="Ray Train is missing: pip install 'trainbus[ray]'"
    )


def descendants(root: int) -> set[int]:
    """Every live process below ``root`` (from /proc's parent links)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    out: set[int] = set()
    todo = [root]
    while todo:
        pid = todo.pop()
        children = [p for p, parent in parents.items() if parent == pid]
        out.update(children)
        todo.extend(children)
    return out


def alive(pid: int) -> bool:
    """Running, not a zombie waiting for a parent to reap it."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def left_running(pids: set[int], limit_s: float = 30.0) -> list[int]:
    """Those of ``pids`` still running once they had ``limit_s`` to end (Ray's processes end
    a moment after the driver that started them)."""
    deadline = time.monotonic() + limit_s
    while (running := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    return running


@pytest.fixture
def temp_dir() -> Iterator[str]:
    # Ray's socket paths live under it: a short one (a unix socket path has ~107 bytes).
    folder = tempfile.mkdtemp(prefix="tbray", dir="/tmp")
    yield folder
    subprocess.run(["rm", "-rf", folder], check=False)


def drive(out: Path, temp_dir: str, signals: int, slow: float) -> tuple[int, str, set[int]]:
    """Run the driver script, send ``signals`` SIGINTs once it is training: (exit status,
    its stdout and stderr's tail, the processes that were below it then)."""
    log = out / "driver.err"
    with log.open("w") as err:  # a file: Ray writes much, a full pipe would block the driver
        driver = subprocess.Popen(
            [sys.executable, str(SCRIPTS / "ray_driver.py"), str(out), temp_dir, str(slow)],
            env=env(), stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True,
        )  # fmt: skip
    try:
        assert driver.stdout is not None
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            ready, _, _ = select.select([driver.stdout], [], [], deadline - time.monotonic())
            line = driver.stdout.readline() if ready else ""
            if line.startswith("training") or not line:
                break
        below = descendants(driver.pid)
        for i in range(signals):
            if i:  # the kernel merges a signal still pending: wait until the first one landed
                while "launch_stopping" not in log.read_text() and driver.poll() is None:
                    time.sleep(0.05)
            driver.send_signal(signal.SIGINT)
        rest, _ = driver.communicate(timeout=150)
    finally:
        if driver.poll() is None:  # the test failed: take Ray's processes down with it
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait()
        driver.stdout.close()  # type: ignore[union-attr]
    assert below, "the driver had no child processes while training (no Ray?)"
    return driver.returncode, rest + log.read_text()[-3000:], below


def test_ctrl_c_stops_every_rank_gracefully_and_leaves_nothing_running(
    tmp_path: Path, temp_dir: str
) -> None:
    code, out, below = drive(tmp_path, temp_dir, signals=1, slow=0.0)
    assert code == 0, out
    (line,) = [x for x in out.splitlines() if x.startswith("result ")]
    result = json.loads(line.split(" ", 1)[1])
    assert result["signal"] == signal.SIGINT and result["stop_reason"] == "signal"
    assert result["last"] == "FitEnded" and "final" in result["final"]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["reason"] for r in ranks] == ["stopped", "stopped"]
    assert [r["stop_reason"] for r in ranks] == ["signal", "signal"]
    assert ranks[0]["steps"] == ranks[1]["steps"] < 20_000  # stopped before the end
    assert all(r["saved"][-1:] == ["final"] for r in ranks)  # the final checkpoint
    workers = {int((tmp_path / f"pid{r}").read_text()) for r in (0, 1)}
    assert workers <= below
    assert not left_running(below)


def test_a_second_ctrl_c_kills_the_workers_at_once_and_leaves_nothing_running(
    tmp_path: Path, temp_dir: str
) -> None:
    # Each step sleeps 0.5 s: the graceful stop is still under way when the second signal
    # comes, and the workers are killed, not stopped.
    code, out, below = drive(tmp_path, temp_dir, signals=2, slow=0.5)
    assert code == 1, out
    (line,) = [x for x in out.splitlines() if x.startswith("error ")]
    error = json.loads(line.split(" ", 1)[1])
    assert error["signal"] == signal.SIGINT and "workers were killed" in error["message"]
    assert not list(tmp_path.glob("rank*.json"))  # no rank ended its run
    workers = {int((tmp_path / f"pid{r}").read_text()) for r in (0, 1)}
    assert workers <= below
    assert not left_running(below)

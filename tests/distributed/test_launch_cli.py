"""``trainbus launch``: argument splitting, and Ctrl-C on a real driver stopping real workers
gracefully with nothing left running."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainbus._cli import main, split_launch_args

from ._torchrun import SCRIPTS, env


def test_split_launch_args() -> None:
    assert split_launch_args(["--nproc_per_node=2", "--standalone", "t.py", "--lr", "1"]) == (
        ["--standalone"],
        2,
        False,
        "t.py",
        ["--lr", "1"],
    )
    assert split_launch_args(["--json-logs", "--nproc-per-node", "3", "t.py"]) == (
        [],
        3,
        True,
        "t.py",
        [],
    )
    with pytest.raises(ValueError, match=r"no script\.py"):
        split_launch_args(["--nproc_per_node=2"])
    with pytest.raises(ValueError, match="integer"):
        split_launch_args(["--nproc_per_node=x", "t.py"])


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["launch"]) == 2
    assert main(["launch", "--nproc_per_node=2"]) == 2
    assert "no script.py" in capsys.readouterr().err
    assert main(["launch", "--help"]) == 0


@pytest.mark.slow
def test_ctrl_c_stops_the_workers_gracefully_and_leaves_nothing_running(tmp_path: Path) -> None:
    driver = subprocess.Popen(
        [sys.executable, "-m", "trainbus", "launch", "--nproc_per_node=2",
         str(SCRIPTS / "link_worker.py"), str(tmp_path), "run", "3000"],
        env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert driver.stderr is not None
        deadline = time.monotonic() + 60
        for line in driver.stderr:  # wait until rank 0 is linked and training
            if "driver_linked" in line or time.monotonic() > deadline:
                break
        time.sleep(1.0)
        driver.send_signal(signal.SIGINT)
        out, err = driver.communicate(timeout=60)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert driver.returncode == 128 + signal.SIGINT, err[-3000:]  # the shell's Ctrl-C status
    assert "stopped: signal" in out
    ranks = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"))]
    assert [r["reason"] for r in ranks] == ["stopped", "stopped"]  # graceful: both finished
    assert ranks[0]["stop_step"] == ranks[1]["stop_step"] < 3000
    leftovers = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True)
    assert leftovers.stdout.strip() == "", leftovers.stdout

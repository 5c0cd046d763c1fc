"""Who may attach, and what a bad attachment does to the job: nothing."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

import trainbus
from trainbus import AttachError

from ._job import Job, env

# Real processes on a loaded machine: each job starts Python and torch (tens of seconds).
pytestmark = pytest.mark.timeout(600)

HOLD = """
import sys, time, trainbus
with trainbus.attach(sys.argv[1]) as job:
    print("attached", job.job["pid"], flush=True)
    time.sleep(600)
"""


def attach_once(run_dir: Path) -> None:
    with trainbus.attach(run_dir, timeout=30) as att:
        assert att.linked


def test_wrong_token_refused_and_a_killed_attachment_leaves_the_job_alone(
    job: Callable[..., Job],
) -> None:
    j = job("--max-steps", "15", "--pause-at", "3")
    j.wait_for("paused-3")
    token = j.run_dir / "attach.token"
    assert token.stat().st_mode & 0o777 == 0o600
    assert (j.run_dir / "attach.sock").stat().st_mode & 0o777 == 0o600
    right = token.read_text()
    token.write_text("not-the-token")
    with pytest.raises(AttachError, match="refused this attachment"):
        attach_once(j.run_dir)
    assert "wrong token" in j.wait_log("attach_refused")
    token.write_text(right)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(j.run_dir)], env=env(),
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert holder.stdout is not None
    assert holder.stdout.readline().split() == ["attached", str(j.process.pid)]
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    holder.stdout.close()
    j.wait_log("attach_detached")
    attach_once(j.run_dir)  # the job still takes attachments
    j.release(3)
    result = j.finish()
    assert result["steps"] == 15


def test_a_dead_jobs_stale_socket_is_an_error_then_a_new_job_takes_the_folder(
    job: Callable[..., Job],
) -> None:
    j = job("--max-steps", "10", "--pause-at", "2")
    j.wait_for("paused-2")
    j.kill()  # SIGKILL: the socket and the token stay behind
    assert (j.run_dir / "attach.sock").exists()
    stale = re.escape(f"cannot attach to {j.run_dir}: stale attach.sock")
    with pytest.raises(AttachError, match=stale):
        attach_once(j.run_dir)
    (j.run_dir / "paused-2").unlink()
    k = job("--max-steps", "10", "--pause-at", "2", run_dir=j.run_dir)
    k.wait_for("paused-2")
    attach_once(k.run_dir)
    k.release(2)
    assert k.finish()["steps"] == 10


def test_another_users_folder_and_a_readable_token_are_refused(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(run / "attach.sock"))
    (run / "attach.token").write_text("t")
    os.chmod(run / "attach.token", 0o644)
    try:
        with pytest.raises(AttachError, match=r"attach\.token is readable by others"):
            attach_once(run)
        if os.getuid() == 0:  # only root can give a folder away
            os.chown(run, 65534, 65534)
            with pytest.raises(
                AttachError,
                match=re.escape(f"cannot attach to {run}: its folder belongs to uid 65534"),
            ):
                attach_once(run)
    finally:
        server.close()

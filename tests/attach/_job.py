"""Starting the attach tests' training job (scripts/job.py) as a real process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SRC = Path(__file__).resolve().parents[2] / "src"
SCRIPT = Path(__file__).resolve().parent / "scripts" / "job.py"


def env() -> dict[str, str]:
    """The environment for child processes: this checkout's src first on the path."""
    out = dict(os.environ)
    out["PYTHONPATH"] = os.pathsep.join([str(SRC), *filter(None, [out.get("PYTHONPATH")])])
    return out


class Job:
    """``scripts/job.py`` running in a subprocess (killed at the end of the test if alive)."""

    def __init__(self, run_dir: Path, *args: str, nproc: int = 0) -> None:
        self.run_dir = run_dir
        launcher = []
        if nproc:  # under torchrun: gloo ranks on localhost
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            launcher = ["-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                        "--master_addr=127.0.0.1", f"--master_port={port}"]  # fmt: skip
        self.process = subprocess.Popen(
            [sys.executable, *launcher, str(SCRIPT), str(run_dir), *args],
            env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip

    def wait_for(self, name: str, limit_s: float = 240) -> Path:
        """Wait until ``run_dir/name`` exists (the job got there); fail if the job exited."""
        path = self.run_dir / name
        deadline = time.monotonic() + limit_s
        while not os.path.lexists(path):
            if self.process.poll() is not None:
                raise AssertionError(
                    f"the job exited ({self.process.returncode}) before "
                    f"{name}:\n{self.process.stderr.read()[-4000:]}"
                )  # type: ignore[union-attr]
            if time.monotonic() > deadline:
                raise AssertionError(f"the job did not write {name} within {limit_s} s")
            time.sleep(0.02)
        return path

    def wait_log(self, word: str, limit_s: float = 240) -> str:
        """Read the job's stdout (its structlog lines) until a line containing ``word``."""
        stdout = self.process.stdout
        assert stdout is not None
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            line = stdout.readline()
            if not line:
                raise AssertionError(f"the job's output ended before {word!r}")
            if word in line:
                return line
        raise AssertionError(f"no {word!r} in the job's output within {limit_s} s")

    def release(self, step: int) -> None:
        """Let a job paused at ``step`` go on without a command."""
        (self.run_dir / f"release-{step}").write_text("")

    def finish(self, limit_s: float = 240, rank: int = 0) -> dict[str, Any]:
        """Wait for the job's exit (0) and return ``rank``'s result."""
        out, err = self.process.communicate(timeout=limit_s)
        self.stdout = out
        assert self.process.returncode == 0, err[-4000:]
        self.stderr = err
        return self.result(rank)

    def result(self, rank: int) -> dict[str, Any]:
        """What ``rank`` wrote at its end."""
        return dict(json.loads((self.run_dir / f"result-rank{rank}.json").read_text()))

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.communicate()

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ._job import Job


@pytest.fixture
def job(tmp_path: Path) -> Iterator[Callable[..., Job]]:
    """Start ``scripts/job.py`` in ``tmp_path/run`` (args as its command line)."""
    jobs: list[Job] = []

    def start(*args: str, run_dir: Path | None = None, nproc: int = 0) -> Job:
        j = Job(run_dir or tmp_path / "run", *args, nproc=nproc)
        jobs.append(j)
        return j

    yield start
    for j in jobs:
        j.kill()

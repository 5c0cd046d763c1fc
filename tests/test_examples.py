"""Run every script in examples/ as a user would, and check what it says it demonstrated.

Each example is a subprocess (``sys.executable examples/<name>.py``) in a temporary working
directory; it must exit 0, print its summary line, and log no subscriber failure. The table
below must name every ``examples/*.py``, so a new example cannot go untested.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@dataclass(frozen=True)
class Case:
    script: str
    pattern: str
    """Regex the output must match (the example's summary line)."""
    check: Callable[[re.Match[str]], bool] = lambda m: True
    """Extra condition on the match, e.g. on the numbers it captured."""
    timeout: float = 60
    """Seconds the script may run (one that starts torchrun ranks needs more)."""


CASES = [
    Case(
        "throttled_logging.py",
        r"throttled logging: (\d+) steps ran, (\d+) lines logged",
        # Throttled: far fewer lines than steps, but not silent.
        lambda m: 1 <= int(m[2]) and int(m[2]) * 10 < int(m[1]),
    ),
    Case(
        "sampled_logging.py",
        r"sampled logging: 2000 steps, (\d+) timed lines, steps \[500, 1000, 1500, 2000\], "
        r"(\d+) events published",
        # Sampled: a few lines, and far fewer events published than steps.
        lambda m: int(m[1]) >= 1 and int(m[2]) < 500,
    ),
    Case(
        "on_checkpoint.py",
        r"on_checkpoint: (\d+) checkpoints saved in 90 steps .*each seen by filter\(is_save\) "
        r"and of_type and loadable",
        lambda m: int(m[1]) >= 2,
    ),
    Case(
        "async_eval_service.py",
        r"async eval service: (\d+) checkpoints, (\d+) replies before fit\(\) returned; "
        r"training advanced during (\d+) of them",
        lambda m: int(m[1]) == int(m[2]) >= 2 and int(m[3]) >= 1,
    ),
    Case(
        "early_stopping_pipeline.py",
        r"FitResult: reason='stopped' steps=50 stop_reason='early stopping: val_loss did not "
        r"improve for 2 evaluations",
    ),
    Case(
        "hooks_and_callbacks.py",
        r"hooks and callbacks: 30 steps, loss scaled by 0\.5 in hook_loss .* 3 async "
        r"evaluations; global EventCounter saw \d+ events; delivery order \['user', 'global'\]",
    ),
    Case(
        "replay_alerting.py",
        r"replay alerting: 60 steps, (\d+) alerts live, (\d+) on the replay, same steps: True",
        lambda m: int(m[1]) == int(m[2]) >= 1,
    ),
    Case(
        "gan.py",
        r"gan: 12 steps, d_loss (\d+\.\d+), lr/g 0\.00025, resumed at step 6 bit-identical: True",
    ),
    Case(
        "contrastive.py",
        r"contrastive: 8 steps of 2 micro-batches, pos_sim (-?\d+\.\d+), grad_norm logged: "
        r"True, resumed at step 4 bit-identical: True",
    ),
    Case(
        "sweep_optuna.py",
        r"optuna sweep: 4 trials, (\d+) pruned, (\d+) complete; best val_loss [\d.]+ at lr "
        r"[\d.e-]+; final checkpoints of (\d+) trials \(none of the pruned ones\)",
        # The two tiny learning rates at least are pruned; every trial ended; only the
        # completed ones kept a final checkpoint.
        lambda m: int(m[1]) >= 2 and int(m[1]) + int(m[2]) == 4 and int(m[3]) == int(m[2]),
    ),
    Case(
        "fsdp2.py",
        r"fsdp2: 2 ranks, folder step-00000007-final holds \['\.metadata', '__0_0\.distcp', "
        r"'__1_0\.distcp', 'rank-0\.pt', 'rank-1\.pt', 'trainbus\.pt'\]; resumed at step 7 "
        r"bit-identical: True; exported model loads: True",
        timeout=240,  # two torchrun ranks, three fits
    ),
]


def test_every_example_is_tested() -> None:
    on_disk = {p.name for p in EXAMPLES.glob("*.py")}
    assert on_disk == {c.script for c in CASES}


def test_no_example_works_around_trainbus() -> None:
    """Each example runs as shipped (nothing is patched before it runs), so what a user copies
    is what was tested: none carries a workaround for a trainbus defect."""
    for path in EXAMPLES.glob("*.py"):
        assert "WORKAROUND" not in path.read_text(), path.name


@pytest.mark.parametrize(
    "case",
    [pytest.param(c, marks=pytest.mark.timeout(c.timeout + 60)) for c in CASES],
    ids=[c.script for c in CASES],
)
def test_example_runs(case: Case, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / case.script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=case.timeout,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    match = re.search(case.pattern, output)
    assert match is not None, output
    assert case.check(match), output
    # The examples exercise the happy path: no subscriber may have failed, nothing was lost.
    markers = ("Traceback", "subscriber_failed", "bus_closed_with_lost_work", "barrier_timeout")
    for marker in markers:
        assert marker not in output, output
    # Examples write only under their own temporary directories.
    assert list(tmp_path.iterdir()) == []

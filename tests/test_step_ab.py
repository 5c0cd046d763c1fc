"""benchmarks/step_ab.py: an earlier tree imported beside this one, in one process."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "step_ab.py"


@pytest.mark.slow
def test_this_tree_against_itself_gives_a_paired_difference(tmp_path: Path) -> None:
    out = tmp_path / "ab.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--before-src", str(ROOT / "src"), "--rounds", "3",
         "--steps", "60", "--kit", "sampled", "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    ratios = result["ratios"]
    assert len(ratios["before"]) == len(ratios["after"]) == 3
    assert all(r > 0 for side in ratios.values() for r in side)
    assert result["diffs"] == pytest.approx(
        [100 * (a - b) for a, b in zip(ratios["after"], ratios["before"], strict=True)]
    )
    assert "paired difference (after - before)" in done.stdout


def test_a_tree_that_imports_itself_absolutely_is_refused(tmp_path: Path) -> None:
    """Such a module would run this tree's code inside the earlier one: the A/B would lie."""
    src = tmp_path / "src"
    shutil.copytree(ROOT / "src" / "trainbus", src / "trainbus")
    (src / "trainbus" / "_absolute.py").write_text("from trainbus import events\n")
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--before-src", str(src), "--out", str(tmp_path / "x.json")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode != 0
    assert "trainbus/_absolute.py" in done.stderr and not (tmp_path / "x.json").exists()

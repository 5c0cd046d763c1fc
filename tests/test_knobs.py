"""benchmarks/knobs.py: every setting it names runs, and each ratio is read against a bare loop."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "knobs.py"


@pytest.mark.slow
def test_every_variant_runs_and_gets_a_ratio_per_round(tmp_path: Path) -> None:
    out = tmp_path / "knobs.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--rounds", "3", "--steps", "20", "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    for clock in ("wall", "cpu"):
        ratios = result["ratios"][clock]
        assert set(ratios) == set(result["summary"][clock]) and len(ratios) == 12
        assert all(len(r) == 3 and all(x > 0 for x in r) for r in ratios.values())
        assert len(result["bare_us"][clock]) == 3 * 12
    assert "barrier_each" in done.stdout


def test_an_unknown_variant_is_refused_naming_it(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--only", "none,warp", "--out", str(tmp_path / "x.json")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode != 0
    assert "warp" in done.stderr and not (tmp_path / "x.json").exists()

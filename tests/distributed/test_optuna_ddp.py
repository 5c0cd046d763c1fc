"""OptunaPruning under torchrun: rank 0 talks to the study and decides; every rank stops
at the same step; the trial is stored PRUNED. Two real gloo ranks, a real SQLite study."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tests.distributed._torchrun import torchrun

pytest.importorskip("optuna")


def test_a_trial_pruned_on_rank0_stops_every_rank_at_the_same_step(tmp_path: Path) -> None:
    torchrun("optuna_worker.py", str(tmp_path), timeout=150)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    trial = json.loads((tmp_path / "trial.json").read_text())
    # Evaluations at 2, 4, 6: the pruner says prune at 6, the stop lands before step 7.
    assert trial == {"state": "PRUNED", "reported": [2, 4, 6]}
    assert r0["steps"] == r1["steps"] == [1, 2, 3, 4, 5, 6]
    assert r0["result_steps"] == r1["result_steps"] == 6
    assert r0["ending"] == r1["ending"] == "pruned"
    # Only rank 0's run() raises TrialPruned (Optuna's study.optimize there stores it PRUNED).
    assert (r0["raised"], r1["raised"]) == ("TrialPruned", None)

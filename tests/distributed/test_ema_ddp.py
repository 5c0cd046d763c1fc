"""EMA under torchrun: 2 gloo ranks running tests/distributed/scripts/ema_worker.py.

Both ranks keep the same average, evaluate it (the swap inside DistributedDataParallel's
module), train on with raw weights equal to a run without EMA, and rank 0 saves the average.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ._torchrun import torchrun

pytestmark = pytest.mark.slow


def read(out: Path, name: str) -> list[dict[str, Any]]:
    return [json.loads((out / f"{name}-rank{r}.json").read_text()) for r in (0, 1)]


def test_ema_on_two_ranks(tmp_path: Path) -> None:
    torchrun("ema_worker.py", str(tmp_path), timeout=120)
    plain0, plain1 = read(tmp_path, "plain")
    r0, r1 = read(tmp_path, "ema")
    # 64 samples, batch 4, 2 ranks: 8 steps an epoch, 2 epochs; an update after each step.
    assert r0["steps"] == r1["steps"] == 16 and r0["updates"] == r1["updates"] == 16
    # One average on both ranks; the raw weights those of a run without EMA (the swaps around
    # every evaluation were undone exactly). Parameters: BatchNorm's running statistics are
    # each rank's own under DDP (it broadcasts rank 0's at the next forward).
    assert r0["average"] == r1["average"] and r0["raw"] == r1["raw"]
    assert r0["raw"] == plain0["raw"] == plain1["raw"] and r0["average"] != r0["raw"]
    # Evaluations at steps 5, 8 (epoch end), 10, 15, 16 (epoch end) and the evaluate() after:
    # each saw the same (averaged) model on both ranks; the last ones the final average.
    assert [s for s, _ in r0["in_eval"]] == [5, 8, 10, 15, 16, 16]
    assert r0["in_eval"] == r1["in_eval"]
    assert r0["in_eval"][-1][1] == r0["in_eval"][-2][1] == r0["average"]
    assert all(d != r0["raw"] for _, d in r0["in_eval"])
    # Metrics agreed across ranks, and evaluate() after the run scores the same averaged model.
    assert r0["metrics"] == r1["metrics"] == r0["again"] == r1["again"]
    # Rank 0 wrote its average, buffers included, with the final checkpoint.
    assert r0["saved"] == r0["average_all"]
    assert "1.running_mean" in r0["saved_keys"] and "1.num_batches_tracked" in r0["saved_keys"]

"""Checkpointing under torchrun: 2 gloo ranks running
tests/distributed/scripts/checkpoint_worker.py (a run, then a new Trainer resuming it).

Retention spans the resume (rank 0 deletes, every rank keeps the books) and
``load_best_at_end`` loads the best file on every rank, one written before the resume too.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ._torchrun import torchrun

pytestmark = pytest.mark.slow


def test_retention_and_best_weights_on_two_ranks(tmp_path: Path) -> None:
    torchrun("checkpoint_worker.py", str(tmp_path), timeout=120)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["steps"] == r1["steps"] == 10
    assert r0["best_path"] == r1["best_path"] is not None
    # Both ranks hold the best file's weights, not the last ones.
    assert r0["model"] == r1["model"] == r0["best"] != r0["last"]
    best = [n for n in r0["files"] if n.endswith("-best.pt")]
    assert best == [Path(r0["best_path"]).name]
    assert [n for n in r0["files"] if not n.endswith("-best.pt")] == ["step-00000010.pt"]

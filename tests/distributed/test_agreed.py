"""Decisions agreed across 2 gloo ranks when the ranks see different things
(tests/distributed/scripts/agreed_worker.py): a NaN loss on rank 1 only under each
``on_nonfinite`` policy, and DDP's gradient all-reduces with gradient accumulation.

Before the agreement, rank 1 alone skipped, stopped or raised: under "skip" rank 0 applied the
averaged NaN gradients and the ranks' step counts parted (mismatched collectives); under
"stop" / "raise" rank 0 waited in its next all-reduce for a peer that had left (a hang, caught
by the timeout).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ._torchrun import torchrun

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One launch: every mode runs in the same two processes, one Trainer each."""
    out: Path = tmp_path_factory.mktemp("agreed")
    torchrun("agreed_worker.py", str(out), "nosync,cut,skip,stop,raise", timeout=110)
    return out


def read(out: Path, mode: str) -> tuple[dict[str, Any], dict[str, Any]]:
    r0, r1 = (json.loads((out / f"{mode}-rank{r}.json").read_text()) for r in (0, 1))
    assert (r0["rank"], r1["rank"]) == (0, 1)
    return r0, r1


def test_skip_on_one_rank_skips_the_update_on_every_rank(out: Path) -> None:
    r0, r1 = read(out, "skip")
    # 2 epochs x 8 batches per rank, step 5's update skipped by both
    assert r0["steps"] == r1["steps"] == 15
    assert r0["skipped"] == r1["skipped"] == 1
    assert r0["reason"] == r1["reason"] == "completed"
    assert r0["finite"] and r1["finite"]  # rank 0 never applied the NaN gradients
    assert r0["digest"] == r1["digest"]


def test_stop_on_one_rank_stops_every_rank_at_the_same_window_close(out: Path) -> None:
    r0, r1 = read(out, "stop")
    # NaN at step 5 on rank 1; the window closes at step 6 (log_every=3) with the flag set
    assert r0["steps"] == r1["steps"] == 6
    assert r0["reason"] == r1["reason"] == "stopped"
    assert r0["digest"] == r1["digest"]


def test_raise_on_one_rank_raises_on_every_rank_naming_the_step(out: Path) -> None:
    r0, r1 = read(out, "raise")
    assert r0["reason"] == r1["reason"] == "failed"
    assert r0["steps"] == r1["steps"] == 6
    for r in (r0, r1):
        assert r["error"] is not None and "non-finite loss at step 5" in r["error"]


def test_ddp_reduces_gradients_once_per_step_with_accumulation(out: Path) -> None:
    r0, r1 = read(out, "nosync")
    # accumulate=2, 16 micro-batches per rank: 8 steps, one (single-bucket) all-reduce each,
    # not one per micro-batch
    assert r0["steps"] == r1["steps"] == 8
    assert r0["allreduces"] == r1["allreduces"] == 8
    assert r0["digest"] == r1["digest"]


def test_a_window_cut_short_after_no_sync_still_averages_the_gradients(out: Path) -> None:
    r0, r1 = read(out, "cut")
    # step 2's second micro-batch skipped by a hook on both ranks: its first backward ran
    # under no_sync, so its gradients were averaged by hand (7 DDP all-reduces, not 8)
    assert r0["allreduces"] == r1["allreduces"] == 7
    assert r0["digest"] == r1["digest"]  # the ranks' models did not part

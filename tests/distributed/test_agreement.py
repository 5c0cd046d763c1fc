"""Rank-agreed commands: the merge rule, the single-process fallback, and 2 real gloo ranks
under torchrun (tests/distributed/scripts/agreement_worker.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from trainbus import ConfigError
from trainbus import commands as cmd
from trainbus._distributed.group import ProcessGroup
from trainbus._distributed.sync import RankSync, merge

from ._torchrun import torchrun

RUNS = 40
LOG_EVERY, DECIDE_EVERY = 4, 7  # as in the worker script


def test_merge_orders_by_rank_then_send_order() -> None:
    a, b, c = cmd.Evaluate(), cmd.SaveCheckpoint(tag="x"), cmd.SetLearningRate(lr=0.1)
    assert merge([[b, a], [c]]) == [b, a, c]
    assert merge([[], [c, a]]) == [c, a]


def test_merge_applies_a_command_sent_by_every_rank_once_per_send() -> None:
    half = cmd.ScaleLearningRate(factor=0.5)
    assert merge([[half], [half]]) == [half]  # a ranks="all" subscriber: one decision
    assert merge([[half, half], [half]]) == [half, half]  # rank 0 sent it twice
    assert merge([[half], [half, half, half]]) == [half, half, half]


def test_merge_keeps_only_the_first_stop() -> None:
    merged = merge([[cmd.StopTraining(reason="a")], [cmd.Evaluate(), cmd.StopTraining(reason="b")]])
    assert merged == [cmd.StopTraining(reason="a"), cmd.Evaluate()]


def test_single_process_needs_no_collective() -> None:
    agreement = RankSync(ProcessGroup.single())
    stop = cmd.StopTraining()
    agreed = agreement.agree([stop, cmd.StopTraining(reason="again")])
    assert agreed == [stop] and agreed[0] is stop  # the sender's own object: request() resolves
    assert agreement.reduce_metrics({"loss": 2.0}) == {"loss": 2.0}
    flags = agreement.reduce_metrics_flags({"loss": 2.0}, (False, True))
    assert flags == ({"loss": 2.0}, [False, True])
    assert agreement.any_nonfinite(True) and not agreement.any_nonfinite(False)
    assert agreement.first_nonfinite(7) == 7 and agreement.first_nonfinite(None) is None
    assert agreement.collectives == 0


def test_capacity_and_metrics_are_validated() -> None:
    with pytest.raises(ConfigError, match="capacity"):
        RankSync(ProcessGroup.single(), capacity=8)
    with pytest.raises(ConfigError, match="metrics"):
        RankSync(ProcessGroup.single()).reduce_metrics({"loss": "high"})  # type: ignore[dict-item]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out: Path = tmp_path_factory.mktemp("agreement")
    torchrun("agreement_worker.py", str(out), str(RUNS))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.slow
def test_a_command_on_rank_1_only_is_applied_by_both(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["world_size"] == 2 and r["owns_group"]
        assert r["rank1_only"] == [
            "SetLearningRate(lr=0.5, param_group=None, optimizer=None, decided_at=None)"
        ]
        assert r["both"] == [
            "Evaluate(decided_at=None)",
            "StopTraining(reason='r0', decided_at=None)",
        ]
        assert r["many"] == 40  # past the first buffer: the second round carried them


@pytest.mark.slow
def test_reduce_metrics_averages_and_refuses_different_names(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["mean"] == {"loss": 1.5, "acc": 5.0}
        assert r["mismatch"] == "DistributedError"


@pytest.mark.slow
def test_a_rank_0_stop_at_random_steps_stops_both_at_the_same_step(
    ranks: list[dict[str, Any]],
) -> None:
    zero, one = ranks[0]["runs"], ranks[1]["runs"]
    assert len(zero) == len(one) == RUNS
    for a, b in zip(zero, one, strict=True):
        assert a["stop_step"] == b["stop_step"]  # same step on both ranks, and nobody hung
        # applied at the first sync point at or after the send: at most LOG_EVERY - 1 later
        assert a["stop_at"] <= a["stop_step"] < a["stop_at"] + LOG_EVERY
        # one collective per sync point, one more only where some rank had something pending
        assert a["collectives"] == a["syncs"] + a["flagged"] == b["collectives"]
    assert len({a["stop_at"] for a in zero}) > 5  # the stops really were at different steps


@pytest.mark.slow
def test_the_group_tears_down_what_it_created(ranks: list[dict[str, Any]]) -> None:
    assert [r["initialized_after_close"] for r in ranks] == [False, False]

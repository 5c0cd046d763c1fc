"""Run under torchrun (2 ranks, gloo): exercises RankSync at sync points of a plain loop
and writes what each rank saw to <out>/rank<r>.json for tests/distributed/test_agreement.py."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from trainbus import commands as cmd
from trainbus._distributed.group import ProcessGroup
from trainbus._distributed.sync import RankSync

LOG_EVERY = 4
DECIDE_EVERY = 7
MAX_STEPS = 60


def simulated_run(agreement: RankSync, group: ProcessGroup, seed: int) -> dict[str, int]:
    """A plain loop: a gradient all-reduce per step (what DDP does, and what hangs when one rank
    stops alone), sync points at log-window closes (piggybacked flag) and decision steps."""
    rng = random.Random(seed * 1000 + group.rank)  # each rank decides alone, unknown to the other
    stop_at = rng.randrange(1, MAX_STEPS) if group.rank == 0 else None
    pending: list[cmd.Command] = []
    before = agreement.collectives
    flagged = 0
    syncs = 0
    for step in range(1, MAX_STEPS + 1):
        grad = torch.ones(4)
        dist.all_reduce(grad)  # the step's own collective
        if step == stop_at:
            pending.append(cmd.StopTraining(reason=f"seed{seed}"))
        if group.rank == 1 and rng.random() < 0.1:
            pending.append(cmd.SaveCheckpoint(tag=f"s{step}"))
        agreed: list[cmd.Command] = []
        if step % LOG_EVERY == 0:
            syncs += 1
            _, (any_pending,) = agreement.reduce_metrics_flags({"loss": 1.0}, (bool(pending),))
            if any_pending:
                flagged += 1
                agreed = agreement.agree(pending)
                pending = []
        elif step % DECIDE_EVERY == 0:
            syncs += 1
            agreed = agreement.agree(pending)
            pending = []
        if any(isinstance(c, cmd.StopTraining) for c in agreed):
            return {
                "stop_step": step,
                "stop_at": stop_at or -1,
                "flagged": flagged,
                "syncs": syncs,
                "collectives": agreement.collectives - before,
            }
    return {
        "stop_step": -1,
        "stop_at": stop_at or -1,
        "flagged": flagged,
        "syncs": syncs,
        "collectives": agreement.collectives - before,
    }


def main() -> None:
    out = Path(sys.argv[1])
    runs = int(sys.argv[2])
    group = ProcessGroup.from_env(timeout=30)
    agreement = RankSync(group)
    result: dict[str, object] = {
        "rank": group.rank,
        "world_size": group.world_size,
        "owns_group": group.owns_group,
    }
    # 1. a command on rank 1 only is applied by both
    only = [cmd.SetLearningRate(lr=0.5)] if group.rank == 1 else []
    result["rank1_only"] = [repr(c) for c in agreement.agree(only)]
    # 2. the same command from both ranks once; StopTraining once whatever the reasons
    both = [cmd.Evaluate(), cmd.StopTraining(reason=f"r{group.rank}")]
    result["both"] = [repr(c) for c in agreement.agree(both)]
    # 3. more than the first buffer holds: a second round
    many = [cmd.SaveCheckpoint(tag=f"t{i}") for i in range(40)] if group.rank == 1 else []
    result["many"] = len(agreement.agree(many))
    # 4. reduce_metrics averages
    result["mean"] = agreement.reduce_metrics({"loss": group.rank + 1.0, "acc": 10.0 * group.rank})
    # 5. a rank-0 StopTraining at a random step, many times over
    result["runs"] = [simulated_run(agreement, group, seed) for seed in range(runs)]
    # 6. different metric names are refused on every rank, not hung on
    try:
        agreement.reduce_metrics({"loss": 1.0} if group.rank == 0 else {"acc": 1.0})
        result["mismatch"] = "no error"
    except Exception as exc:
        result["mismatch"] = type(exc).__name__
    group.barrier()
    group.close()
    result["initialized_after_close"] = dist.is_initialized()
    (out / f"rank{result['rank']}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()

"""Cost of rank-agreed commands on 2 gloo ranks (run under torchrun; rank 0 prints and writes).

Run::

    .venv/bin/python -m torch.distributed.run --nproc_per_node=2 --standalone \\
        benchmarks/agreement.py [--rounds 7] [--iters 2000]

Each variant is timed in interleaved rounds (``_common.interleaved_rounds``; every rank runs
the same order, so the collectives pair up) and reported as the median µs per call on rank 0:

- ``all_reduce float64[4]``: the log-window reduction the loop pays anyway (loss_sum, count).
- ``reduce_metrics_flags``: the same reduction carrying the metrics and the pending flag
  (one all-reduce of names+3 float64s), what the loop pays per ``log_every`` window.
- ``exchange([])``: a sync point with nothing pending (one all_gather of 512 bytes).
- ``exchange([StopTraining])``: a sync point where rank 0 has a command (same collective, plus
  JSON encode/decode).
- ``all_gather uint8[8]``: the bare collective of a few bytes, for scale.
- ``all_gather uint8[512]``: the bare collective ``agree`` runs (its default capacity).
- ``broadcast int64[1]``: the per-step broadcast a naive protocol would pay every step.

Writes ``benchmarks/results/agreement.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from trainbus import commands as cmd
from trainbus._distributed.group import ProcessGroup
from trainbus._distributed.sync import RankSync


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--iters", type=int, default=2000)
    args = parser.parse_args()
    group = ProcessGroup.from_env(timeout=60)
    agreement = RankSync(group)
    stop = [cmd.StopTraining(reason="bench")] if group.rank == 0 else []
    few = torch.zeros(8, dtype=torch.uint8)
    rows = [torch.empty_like(few) for _ in range(group.world_size)]
    buf512 = torch.zeros(512, dtype=torch.uint8)
    rows512 = [torch.empty_like(buf512) for _ in range(group.world_size)]
    word = torch.zeros(1, dtype=torch.int64)
    window = torch.zeros(4, dtype=torch.float64)
    metrics = {"loss": 0.5, "count": 32.0}
    variants = {
        "all_reduce float64[4]": lambda: dist.all_reduce(window),
        "reduce_metrics_flags": lambda: agreement.reduce_metrics_flags(metrics, (False,)),
        "exchange([])": lambda: agreement.agree([]),
        "exchange([StopTraining])": lambda: agreement.agree(stop),
        "all_gather uint8[8]": lambda: dist.all_gather(rows, few),
        "all_gather uint8[512]": lambda: dist.all_gather(rows512, buf512),
        "broadcast int64[1]": lambda: dist.broadcast(word, 0),
    }
    names = list(variants)
    results: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            fn = variants[name]
            for _ in range(50):  # warm-up
                fn()
            group.barrier()
            t0 = time.perf_counter()
            for _ in range(args.iters):
                fn()
            results[name].append((time.perf_counter() - t0) / args.iters * 1e6)
    if group.rank == 0:
        table = {n: sorted(v)[len(v) // 2] for n, v in results.items()}
        width = max(map(len, names))
        print(f"{'variant':<{width}}  median µs/call ({args.rounds} rounds x {args.iters})")
        for n, us in table.items():
            print(f"{n:<{width}}  {us:8.1f}")
        out = Path(__file__).resolve().parent / "results" / "agreement.json"
        out.write_text(
            json.dumps(
                {
                    "world_size": group.world_size,
                    "backend": group.backend,
                    "rounds": args.rounds,
                    "iters": args.iters,
                    "median_us": table,
                    "all_us": results,
                },
                indent=2,
            )
            + "\n"
        )
    group.close()


if __name__ == "__main__":
    main()

"""Per-step cost of the Trainer's rank agreement on 2 gloo ranks against a plain DDP loop.

Run (2 CPU ranks, one thread each)::

    OMP_NUM_THREADS=1 .venv/bin/python -m torch.distributed.run --nproc_per_node=2 \\
        --standalone benchmarks/ddp_step.py [--rounds 5] [--quick]

Variants, each the same DDP model, optimizer and pre-built batches on every rank, timed in
interleaved rounds (``_common.interleaved_rounds``; every rank runs the same order, so the
collectives pair up), median µs per optimizer step on rank 0:

- ``plain DDP``: ``forward, loss, zero_grad, backward, step`` by hand, no agreement at all.
- ``plain DDP + agreement``: the same loop plus exactly what the Trainer's protocol adds: every
  ``log_every`` (50) steps one ``reduce_metrics_flags`` (the window's loss and the pending
  flag) and, never here, an exchange (nothing is pending).
- ``Trainer``: ``Trainer(ddp_model, ...).fit_sync()`` with ``log_every=50`` and no subscriber: the
  whole trainer (bus, loop, agreement) over the same batches.

Models as ``step_overhead.py``: ``tiny`` (32-64-10, batch 32) and ``wide`` (256-768-768-10,
batch 96, a few ms a step). Writes ``benchmarks/results/ddp_step.json``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import structlog
import torch
import torch.distributed as dist
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import interleaved_rounds, load_average, median, write_json

from trainbus import Trainer
from trainbus._distributed.group import ProcessGroup
from trainbus._distributed.sync import RankSync

LOG_EVERY = 50


def build(kind: str) -> tuple[torch.nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(0)
    if kind == "tiny":
        layers = [torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)]
        d, b = 32, 32
    else:
        layers = [torch.nn.Linear(256, 768), torch.nn.ReLU(), torch.nn.Linear(768, 768),
                  torch.nn.ReLU(), torch.nn.Linear(768, 10)]  # fmt: skip
        d, b = 256, 96
    batches = [(torch.randn(b, d), torch.randint(0, 10, (b,))) for _ in range(64)]
    return torch.nn.Sequential(*layers), batches


def plain(kind: str, steps: int, agreement: RankSync | None) -> float:
    model, batches = build(kind)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    dist.barrier()
    t0 = time.perf_counter()
    for i in range(1, steps + 1):
        x, y = batches[i % len(batches)]
        loss = F.cross_entropy(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if agreement is not None and i % LOG_EVERY == 0:
            _, (pending,) = agreement.reduce_metrics_flags({"loss": loss.item()}, (False,))
            if pending:
                agreement.agree([])
    return (time.perf_counter() - t0) / steps * 1e6


def trainer(kind: str, steps: int) -> float:
    model, batches = build(kind)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    data = [batches[i % len(batches)] for i in range(1, steps + 1)]
    t = Trainer(ddp, opt, data, loss_fn=F.cross_entropy, max_steps=steps, log_every=LOG_EVERY,
                progress=False, on_signal=None, device="cpu")  # fmt: skip
    dist.barrier()
    t0 = time.perf_counter()
    t.fit_sync()
    return (time.perf_counter() - t0) / steps * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    # The list of batches is not a DataLoader: silence the data_not_sharded warning.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    group = ProcessGroup.from_env(timeout=60)
    agreement = RankSync(group)
    steps = {"tiny": 600 if args.quick else 2000, "wide": 40 if args.quick else 150}
    results: dict[str, Any] = {}
    for kind in ("tiny", "wide"):
        n = steps[kind]
        variants = {
            "plain DDP": lambda k=kind, n=n: plain(k, n, None),
            "plain DDP + agreement": lambda k=kind, n=n: plain(k, n, agreement),
            "Trainer": lambda k=kind, n=n: trainer(k, n),
        }
        runs = interleaved_rounds(variants, args.rounds)
        med = {name: median(v) for name, v in runs.items()}  # type: ignore[arg-type]
        results[kind] = {"steps": n, "median_us": med, "all_us": runs,
                         "ratio_agreement": med["plain DDP + agreement"] / med["plain DDP"],
                         "ratio_trainer": med["Trainer"] / med["plain DDP"]}  # fmt: skip
    if group.rank == 0:
        print(f"load average {load_average()}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}")
        print(f"{'model':<6} {'variant':<24} {'µs/step':>9} {'vs plain':>9}")
        for kind, r in results.items():
            base = r["median_us"]["plain DDP"]
            for name, us in r["median_us"].items():
                print(f"{kind:<6} {name:<24} {us:9.1f} {us / base:9.3f}")
        write_json(Path(__file__).resolve().parent / "results" / "ddp_step.json",
                   {"world_size": group.world_size, "backend": group.backend,
                    "rounds": args.rounds, "load_average": load_average(), **results})  # fmt: skip
    dist.barrier()
    group.close()


if __name__ == "__main__":
    main()

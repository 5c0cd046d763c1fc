"""Paired A/B of the training step's CPU time against an earlier tree, both in one process.

``step_ab.py`` reads wall time, which a loaded shared machine scatters by tens of points per
round. This reads the process' CPU time per step (``time.process_time``: every thread, the
training thread and the bus' event loop): what the step's Python work costs, which the other
processes on the machine barely move. It says nothing of waits (a GIL hand-over between the two
threads costs wall time, not CPU time), so it complements ``step_ab.py``, never replaces it.

Same run, same trees, same rounds as ``step_ab.py`` (the earlier tree imported as
``trainbus_before``, sides alternating each round). Subscribers (``--kit``): ``none``,
``sampled`` (``bus.stream(StepEnded, every_s=0.5)`` reading the loss) or ``each`` (a sync
subscriber of every ``StepEnded``).

Run: ``PYTHONPATH=src .venv/bin/python benchmarks/step_cpu_ab.py --before-src OTHER/src``.
Prints the medians and the paired difference (after minus before) in µs of CPU per step with a
95 % bootstrap interval of its median.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median, median_ci
from step_ab import import_before, trainer_with_kit

import trainbus
from trainbus.testing import tiny_loader


def cpu_us(package: ModuleType, data: list[Any], kit: str) -> float:
    """µs of process CPU time per step of ``package``'s Trainer over ``data``."""
    trainer = trainer_with_kit(package, data, kit)
    start = time.process_time()
    trainer.fit_sync()
    return (time.process_time() - start) / len(data) * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before-src", type=Path, required=True, help="the earlier tree's src/")
    parser.add_argument("--rounds", type=int, default=10, help="at least 3")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--kit", choices=["none", "sampled", "each"], default="none")
    args = parser.parse_args()
    if args.rounds < 3 or args.steps < 1:
        parser.error("--rounds takes 3 or more, --steps 1 or more")
    torch.set_num_threads(1)
    data = list(tiny_loader(args.steps, 32))
    with tempfile.TemporaryDirectory() as tmp:
        sides = {"before": import_before(args.before_src.resolve(), Path(tmp)), "after": trainbus}
        for package in sides.values():  # warm-up
            cpu_us(package, data[:200], args.kit)
        us: dict[str, list[float]] = {"before": [], "after": []}
        for r in range(args.rounds):
            for side in ["before", "after"] if r % 2 == 0 else ["after", "before"]:
                us[side].append(cpu_us(sides[side], data, args.kit))
    diffs = [a - b for a, b in zip(us["after"], us["before"], strict=True)]
    low, high = median_ci(diffs)
    print(f"kit {args.kit}, {args.rounds} rounds of {args.steps} steps, CPU µs per step: "
          f"before {median(us['before']):.1f}, after {median(us['after']):.1f}; paired "
          f"difference {median(diffs):+.2f} µs, 95 % interval {low:+.2f}..{high:+.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

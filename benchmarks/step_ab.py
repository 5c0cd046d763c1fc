"""Paired A/B of the training step against an earlier commit, both trees in one process.

Two processes differ by more than their code: where memory lands, which caches are warm, what
the machine did meanwhile. On these shared 2-core machines that noise is as large as the
differences the step-cost target is about (2 points on a ~0.6 ms step). Here the earlier tree
is imported under another name (``trainbus_before``, from a copy of its ``src/trainbus``: the
package imports itself relatively, so the copy runs its own code), and the rounds alternate
``before`` and ``after`` in the same process, each run right after a bare loop of its own, so
each ratio is read against the machine of that moment.

Tiny MLP (``tiny_model``: 32-64-10), batch 32, SGD, cross-entropy, torch on 1 thread, the
loop time from ``FitStarted.time`` to ``FitEnded.time``. Subscribers (``--kit``): ``none``,
``sampled`` (a ``StepEnded`` stream with ``every_s=1.0`` reading the loss, and an
``EpochEnded`` subscriber) or ``each`` (a sync subscriber of every ``StepEnded``).

Run (the earlier tree in a worktree or a clone at that commit)::

    git worktree add /tmp/before bf260e7
    .venv/bin/python benchmarks/step_ab.py --before-src /tmp/before/src [--rounds 16]

Prints the median ratio to the bare loop of each side and the paired difference (after minus
before) in points, with its quartiles and a 95 % bootstrap interval of the median (3 rounds at
least); writes ``benchmarks/results/step_ab_<kit>.json``, the file benchmarks/HISTORY.md quotes,
or ``--out PATH`` (a short trial run should name one).
"""

from __future__ import annotations

import argparse
import importlib
import shutil
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    RESULTS_DIR,
    bare_loop_s,
    machine_info,
    median,
    median_ci,
    percentile,
    write_json,
)

import trainbus
from trainbus.testing import tiny_loader, tiny_model

BEFORE = "trainbus_before"


def import_before(src: Path, into: Path) -> ModuleType:
    """Import ``src/trainbus`` of the earlier tree as :data:`BEFORE` (a copy under ``into``)."""
    package = src / "trainbus"
    if not (package / "__init__.py").is_file():
        raise SystemExit(f"step_ab.py: {src} has no trainbus package (give the tree's src/)")
    # A module-level absolute import would run the current tree's code inside the earlier
    # one. (Indented ones are in functions the step never calls, such as the Ray launcher's,
    # or in docstrings.)
    absolute = [
        str(p.relative_to(src))
        for p in package.rglob("*.py")
        if any(
            line.startswith(("import trainbus", "from trainbus"))
            for line in p.read_text().splitlines()
        )
    ]
    if absolute:
        raise SystemExit(f"step_ab.py: these modules import trainbus absolutely: {absolute}")
    shutil.copytree(package, into / BEFORE)
    sys.path.insert(0, str(into))
    return importlib.import_module(BEFORE)


def bare(data: list[Any]) -> float:
    """µs a step of the hand-written loop, on this thread."""
    torch.manual_seed(0)
    return bare_loop_s(tiny_model(), data, lr=0.01) / len(data) * 1e6


def trainer_with_kit(package: ModuleType, data: list[Any], kit: str) -> Any:
    """``package``'s Trainer on the tiny model over ``data``, with the subscribers of ``kit``
    (``"none"``; ``"sampled"``: a ``StepEnded`` stream of ``every_s=1.0`` and an ``EpochEnded``
    one; ``"each"``: one of every ``StepEnded``)."""
    events = importlib.import_module(f"{package.__name__}.events")
    torch.manual_seed(0)
    model = tiny_model()
    trainer = package.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), data,
                              loss_fn=F.cross_entropy, max_epochs=1, on_signal=None,
                              progress=False)  # fmt: skip
    bus = trainer.bus
    if kit == "sampled":
        bus.stream(events.StepEnded, every_s=1.0).subscribe(lambda e: float(e.loss))
        bus.stream(events.EpochEnded).subscribe(lambda e: None)
    elif kit == "each":
        bus.stream(events.StepEnded).subscribe(lambda e: None)
    return trainer


def fitted(package: ModuleType, data: list[Any], kit: str) -> float:
    """µs a step of ``package``'s Trainer (loop time, from its own events)."""
    events = importlib.import_module(f"{package.__name__}.events")
    trainer = trainer_with_kit(package, data, kit)
    bus = trainer.bus
    times: dict[str, float] = {}
    bus.stream(events.FitStarted).subscribe(lambda e: times.update(start=e.time))
    bus.stream(events.FitEnded).subscribe(lambda e: times.update(end=e.time))
    # The commit before the sync twins were named called it run().
    (getattr(trainer, "fit_sync", None) or trainer.run)()
    return (times["end"] - times["start"]) / len(data) * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before-src", type=Path, required=True, help="the earlier tree's src/")
    parser.add_argument("--rounds", type=int, default=16, help="at least 3")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--kit", choices=["none", "sampled", "each"], default="none")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="the JSON to write (default: benchmarks/results/step_ab_<kit>.json)",
    )
    args = parser.parse_args()
    if args.rounds < 3 or args.steps < 1:
        parser.error("--rounds takes 3 or more (a median and its interval), --steps 1 or more")
    torch.set_num_threads(1)
    data = list(tiny_loader(args.steps, 32))
    with tempfile.TemporaryDirectory() as tmp:
        sides = {"before": import_before(args.before_src.resolve(), Path(tmp)), "after": trainbus}
        for package in sides.values():  # warm-up: imports, first-thread costs
            fitted(package, data[:200], args.kit)
        ratios: dict[str, list[float]] = {"before": [], "after": []}
        for r in range(args.rounds):
            order = ["before", "after"] if r % 2 == 0 else ["after", "before"]
            for side in order:
                base = bare(data)
                ratios[side].append(fitted(sides[side], data, args.kit) / base)
    diffs = [100 * (a - b) for a, b in zip(ratios["after"], ratios["before"], strict=True)]
    low, high = median_ci(diffs)
    summary: dict[str, Any] = {
        "before": median(ratios["before"]),
        "after": median(ratios["after"]),
        "diff_points": median(diffs),
        "diff_quartiles": [percentile(diffs, 25), percentile(diffs, 75)],
        "diff_ci95": [low, high],
    }
    print(f"kit {args.kit}, {args.rounds} rounds of {args.steps} steps")
    print(f"ratio to the bare loop: before {summary['before']:.4f}, after {summary['after']:.4f}")
    print(f"paired difference (after - before): {summary['diff_points']:+.2f} points, "
          f"quartiles {summary['diff_quartiles'][0]:+.2f}..{summary['diff_quartiles'][1]:+.2f}, "
          f"95 % interval of the median {low:+.2f}..{high:+.2f}")  # fmt: skip
    write_json(args.out or RESULTS_DIR / f"step_ab_{args.kit}.json", {
        "command": " ".join(sys.argv), "machine": machine_info(), "kit": args.kit,
        "before_src": str(args.before_src), "summary": summary, "ratios": ratios,
        "diffs": diffs,
    })  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

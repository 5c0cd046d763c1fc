"""What each setting that touches the step costs: the Trainer with one setting changed at a
time, against a bare PyTorch loop, in one process.

Tiny MLP (``tiny_model``: 32-64-10), batch 32, SGD, cross-entropy, torch on 1 thread, CPU:
the worst case, where a few µs of Python a step show (a step of a few ms hides them). Each run
of a variant comes right after a bare loop of its own, and its ratio is read against that
one; the variants are interleaved, the order rotated each round, and the figure is the median
of the per-round ratios with its 95 % bootstrap interval. The steps are timed from inside the
data (the clocks stamped at the first and the last fetch), on two clocks: the wall clock, and
the process' CPU time (every thread, the event-loop thread's delivery included), which a busy
neighbour inflates least: read the CPU ratio on a shared machine.

Variants (``--only`` picks some):

- ``none``: no subscriber, the defaults (``log_every=50``, ``on_nonfinite="raise"``)
- ``each``: a sync subscriber of every ``StepEnded``
- ``each_async``: an ``async def`` subscriber of every ``StepEnded`` that awaits nothing (a
  buffer large enough that nothing is dropped)
- ``sampled``: a sync subscriber of ``bus.stream(StepEnded, every_s=1.0)``
- ``every_event``: a sync subscriber of ``bus.events``
- ``trace``: ``trace=True`` and a subscriber of ``SpanTraced``
- ``hooks``: a no-op hook at every hook point
- ``barrier_each``: ``EventBus(barriers=(StepEnded,))`` and a sync ``StepEnded`` subscriber
  (a barrier every step)
- ``decide_10``: a sync ``StepEnded`` subscriber piped through ``tbops.every(10)`` (a decision
  step, so a barrier, every 10th step)
- ``nonfinite_ignore`` / ``nonfinite_skip``: ``on_nonfinite="ignore"`` / ``"skip"``
- ``log_every_1``: ``log_every=1`` (a window closed and read every step)

Run::

    .venv/bin/python benchmarks/knobs.py [--rounds 8] [--steps 3000] [--only none,each]

Writes ``benchmarks/results/knobs.json`` (or ``--out PATH``).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import structlog
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    RESULTS_DIR,
    bare_loop_s,
    format_table,
    machine_info,
    median,
    median_ci,
    write_json,
)

from trainbus import EventBus, Trainer
from trainbus import events as ev
from trainbus import operators as tbops
from trainbus._hookpoints import HOOK_POINTS  # every point, no-op hooks at each
from trainbus.testing import tiny_loader, tiny_model

Setup = Callable[[Trainer], None]


def _noop(_: Any) -> None:
    pass


async def _anoop(_: Any) -> None:
    await anyio.lowlevel.checkpoint()


def _hooks(t: Trainer) -> None:
    for point in HOOK_POINTS:
        t.add_hook(point, _noop)


def _each(t: Trainer) -> None:
    t.bus.stream(ev.StepEnded).subscribe(_noop)


def _each_async(t: Trainer) -> None:
    t.bus.subscribe_async(t.bus.stream(ev.StepEnded), _anoop, buffer=1_000_000)


def _sampled(t: Trainer) -> None:
    t.bus.stream(ev.StepEnded, every_s=1.0).subscribe(_noop)


def _every_event(t: Trainer) -> None:
    t.bus.events.subscribe(_noop)


def _traced(t: Trainer) -> None:
    t.bus.stream(ev.SpanTraced).subscribe(_noop)


def _decide_10(t: Trainer) -> None:
    t.bus.stream(ev.StepEnded).pipe(tbops.every(10)).subscribe(_noop)


# name -> (Trainer options, what to subscribe or add)
VARIANTS: dict[str, tuple[dict[str, Any], Setup]] = {
    "none": ({}, _noop),
    "each": ({}, _each),
    "each_async": ({}, _each_async),
    "sampled": ({}, _sampled),
    "every_event": ({}, _every_event),
    "trace": ({"trace": True}, _traced),
    "hooks": ({}, _hooks),
    "barrier_each": ({"bus": "barrier_each"}, _each),
    "decide_10": ({}, _decide_10),
    "nonfinite_ignore": ({"on_nonfinite": "ignore"}, _noop),
    "nonfinite_skip": ({"on_nonfinite": "skip"}, _noop),
    "log_every_1": ({"log_every": 1}, _noop),
}


CLOCKS = ("wall", "cpu")


class Stamped:
    """The batches, read with the clocks stamped at the first and the last fetch, so that a
    run's start and end (the bus opening, the thread hand-off) are left out: µs per step of the
    wall clock and of the process' CPU time (every thread: the training thread and the
    event-loop thread's delivery). CPU time is what a busy neighbour inflates least."""

    def __init__(self, batches: list[Any]) -> None:
        self.batches = batches
        self.marks: list[tuple[float, float]] = []

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[Any]:
        last = len(self.batches) - 1
        for i, batch in enumerate(self.batches):
            if i in (0, last):
                self.marks.append((time.perf_counter(), time.process_time()))
            yield batch

    def per_step_us(self) -> dict[str, float]:
        (w0, c0), (w1, c1) = self.marks[0], self.marks[-1]
        steps = len(self.batches) - 1
        return {"wall": (w1 - w0) / steps * 1e6, "cpu": (c1 - c0) / steps * 1e6}


def bare(data: list[Any]) -> dict[str, float]:
    """µs a step of the hand-written loop, on this thread."""
    torch.manual_seed(0)
    stamped = Stamped(data)
    bare_loop_s(tiny_model(), stamped, lr=0.01)
    return stamped.per_step_us()


def fitted(data: list[Any], name: str) -> dict[str, float]:
    """µs a step of the Trainer with variant ``name``'s setting."""
    options, setup = VARIANTS[name]
    options = dict(options)
    if options.get("bus") == "barrier_each":
        options["bus"] = EventBus(barriers=(ev.StepEnded,))
    torch.manual_seed(0)
    model = tiny_model()
    stamped = Stamped(data)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), stamped,
                      loss_fn=F.cross_entropy, max_epochs=1, on_signal=None, progress=False,
                      **options)  # fmt: skip
    setup(trainer)
    trainer.fit_sync()
    trainer.close()
    return stamped.per_step_us()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=8, help="at least 3")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--only", default=",".join(VARIANTS), help="comma-separated variants")
    parser.add_argument("--out", type=Path, default=None, help="the JSON to write")
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n]
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown or args.rounds < 3 or args.steps < 1:
        parser.error(f"unknown variants {unknown}; one of {list(VARIANTS)}" if unknown
                     else "--rounds takes 3 or more, --steps 1 or more")  # fmt: skip
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    torch.set_num_threads(1)
    data = list(tiny_loader(args.steps, 32))
    for name in names:  # warm-up: imports, first-thread costs
        fitted(data[:200], name)
    ratios: dict[str, dict[str, list[float]]] = {c: {n: [] for n in names} for c in CLOCKS}
    bare_us: dict[str, list[float]] = {c: [] for c in CLOCKS}
    for r in range(args.rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            base = bare(data)
            got = fitted(data, name)
            for c in CLOCKS:
                bare_us[c].append(base[c])
                ratios[c][name].append(got[c] / base[c])
    summary = {
        c: {n: {"median": median(v), "ci95": list(median_ci(v))} for n, v in ratios[c].items()}
        for c in CLOCKS
    }
    print(f"{args.rounds} rounds of {args.steps} steps; bare loop {median(bare_us['wall']):.0f} "
          f"µs a step (wall), {median(bare_us['cpu']):.0f} µs of CPU")  # fmt: skip
    print(format_table(["variant", "wall ratio", "95 % interval", "CPU ratio", "95 % interval"], [
        (n, *(x for c in CLOCKS for x in (f"{summary[c][n]['median']:.3f}",
         f"{summary[c][n]['ci95'][0]:.3f}-{summary[c][n]['ci95'][1]:.3f}")))
        for n in names
    ]))  # fmt: skip
    write_json(args.out or RESULTS_DIR / "knobs.json", {
        "command": " ".join(sys.argv), "machine": machine_info(), "steps": args.steps,
        "bare_us": bare_us, "summary": summary, "ratios": ratios,
    })  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Where a step's overhead goes: the training thread's own time per step, read from inside.

``step_overhead.py`` times the whole loop (``FitStarted`` to ``FitEnded``). This probe times
the steps alone: the training data is wrapped in an iterator that stamps the wall clock, the
training thread's CPU clock and the process' CPU clock at the first and at the last batch
fetched, so run start and end (the bus opening, the final barrier) stay out, and the
event-loop thread's CPU per step ("loop thr") is the process' CPU minus the training thread's.
(``--ab``, which ran each variant without the tight loop of ordinary steps, went with that
loop: every step is now ``Step.run``; compare two trees with ``step_overhead.py`` instead.)

Run: ``.venv/bin/python benchmarks/step_probe.py`` (the tiny 32-64-10 MLP, batch 32, torch 1
thread, 2,000 steps, 12 interleaved rounds; about 2 minutes). ``--model null`` uses a 2-2
linear layer on batches of 2, whose step is almost all framework overhead: the place to read
the trainbus µs per step with the least noise. ``--rounds``, ``--steps``,
``VARIANT ...`` to choose. ``--profile KIND`` prints a cProfile of one run's training thread.

Figures: the median µs per step over rounds, and two ratios to ``bare_thread`` (the same loop
on a worker thread, as the Trainer runs it): the ratio of the medians ("RoM") and the median
of the per-round ratios with its p25-p75. On a shared machine whose speed drifts by 10-20 %
from one second to the next, read a difference of a few points only where both agree.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from reactivex import operators as ops

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import interleaved_rounds, load_average, median
from step_overhead import ignite_update, make_data, make_model

import trainbus._loop.loop as loop_module
from trainbus import Trainer
from trainbus import events as ev

CPU = torch.device("cpu")
Stamps = tuple[float, float, float]  # wall, training-thread CPU, process CPU


class Stamped:
    """The batches, stamped at the first and at the last fetch (on the fetching thread)."""

    def __init__(self, data: list[Any]) -> None:
        self.data = data
        self.first: Stamps = (0.0, 0.0, 0.0)
        self.last: Stamps = (0.0, 0.0, 0.0)

    def __len__(self) -> int:
        return len(self.data)

    def __iter__(self) -> Iterator[Any]:
        last = len(self.data) - 1
        for i, batch in enumerate(self.data):
            if i == 0 or i == last:
                stamps = (time.perf_counter(), time.thread_time(), time.process_time())
                if i == 0:
                    self.first = stamps
                else:
                    self.last = stamps
            yield batch

    def per_step(self) -> dict[str, float]:
        steps = len(self.data) - 1
        wall, thread, process = (b - a for a, b in zip(self.first, self.last, strict=True))
        loop_thread = (process - thread) / steps
        return {"wall": wall / steps, "cpu": thread / steps, "loop_thread": loop_thread}


def null_data(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(2, 2, generator=gen), torch.randint(0, 2, (2,), generator=gen))
            for _ in range(steps)]  # fmt: skip


def null_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(2, 2)


def _bare(data: list[Any], new_model: Callable[[], torch.nn.Module]) -> dict[str, float]:
    model = new_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    stamped = Stamped(data)
    for x, y in stamped:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return stamped.per_step()


def bare_thread(data: list[Any], new_model: Callable[[], torch.nn.Module]) -> dict[str, float]:
    out: list[dict[str, float]] = []
    worker = threading.Thread(target=lambda: out.append(_bare(data, new_model)))
    worker.start()
    worker.join()
    return out[0]


def ignite(data: list[Any], new_model: Callable[[], torch.nn.Module]) -> dict[str, float]:
    from ignite.engine import Engine

    model = new_model()
    stamped = Stamped(data)
    Engine(ignite_update(model, torch.optim.SGD(model.parameters(), lr=0.01))).run(
        stamped, max_epochs=1
    )
    return stamped.per_step()


def _typical(trainer: Trainer) -> None:
    bus = trainer.bus
    bus.stream(ev.StepEnded).pipe(ops.throttle_first(1.0)).subscribe(lambda e: None)
    bus.stream(ev.EpochEnded).subscribe(lambda e: None)
    bus.stream(ev.FitEnded).subscribe(lambda e: None)
    bus.stream(ev.CheckpointSaved).subscribe(lambda e: None)


def _typical_sampled(trainer: Trainer) -> None:
    bus = trainer.bus
    bus.stream(ev.StepEnded, every_s=1.0).subscribe(lambda e: None)
    bus.stream(ev.EpochEnded).subscribe(lambda e: None)
    bus.stream(ev.FitEnded).subscribe(lambda e: None)
    bus.stream(ev.CheckpointSaved).subscribe(lambda e: None)


def _slow_async(trainer: Trainer) -> None:
    import anyio

    async def slow(e: ev.StepEnded) -> None:
        await anyio.sleep(0.02)

    bus = trainer.bus
    step_ended = bus.stream(ev.StepEnded).pipe(ops.filter(lambda e: e.step % 10 == 0))
    bus.subscribe_async(step_ended, slow, overflow="latest")


def _slow_async_sampled(trainer: Trainer) -> None:
    import anyio

    async def slow(e: ev.StepEnded) -> None:
        await anyio.sleep(0.02)

    bus = trainer.bus
    bus.subscribe_async(bus.stream(ev.StepEnded, every_steps=10), slow, overflow="latest")


SETUPS: dict[str, Callable[[Trainer], Any] | None] = {
    "none": None,
    "noop": lambda t: t.bus.stream(ev.StepEnded).subscribe(lambda e: None),
    "typical": _typical,
    "typical_sampled": _typical_sampled,
    "slow_async": _slow_async,
    "slow_async_sampled": _slow_async_sampled,
}


def trainbus_run(
    data: list[Any], new_model: Callable[[], torch.nn.Module], kind: str
) -> dict[str, float]:
    model = new_model()
    stamped = Stamped(data)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), stamped,
                      loss_fn=F.cross_entropy, max_epochs=1, progress=False,
                      handle_signals=False)  # fmt: skip
    setup = SETUPS[kind]
    if setup is not None:
        setup(trainer)
    trainer.fit_sync()
    return stamped.per_step()


def profile(data: list[Any], new_model: Callable[[], torch.nn.Module], kind: str) -> str:
    prof = cProfile.Profile()
    original = loop_module.Loop.run

    def run(self: Any) -> Any:
        prof.enable()
        try:
            return original(self)
        finally:
            prof.disable()

    loop_module.Loop.run = run  # type: ignore[method-assign]
    try:
        trainbus_run(data, new_model, kind)
    finally:
        loop_module.Loop.run = original  # type: ignore[method-assign]
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats("trainbus", 20)
    return out.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kinds", nargs="*", default=list(SETUPS))
    parser.add_argument("--model", choices=["tiny", "null"], default="tiny")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--no-ignite", action="store_true")
    parser.add_argument("--profile", metavar="KIND")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.model == "null":
        data, new_model = null_data(args.steps), null_model
    else:
        data, new_model = make_data("tiny", args.steps, CPU), lambda: make_model("tiny")
    if args.profile:
        print(profile(data, new_model, args.profile))
        return
    variants: dict[str, Callable[[], dict[str, float]]] = {
        "bare_thread": lambda: bare_thread(data, new_model)
    }
    if not args.no_ignite:
        variants["ignite"] = lambda: ignite(data, new_model)
    for kind in args.kinds:
        variants[kind] = lambda kind=kind: trainbus_run(data, new_model, kind)
    load = load_average()
    samples = interleaved_rounds(variants, args.rounds)
    base = samples["bare_thread"]
    print(f"model {args.model}, {args.steps} steps, {args.rounds} rounds, load {load} -> "
          f"{load_average()}")  # fmt: skip
    print(f"{'variant':28s} {'µs/step':>8s} {'RoM':>6s} {'ratio [p25-p75]':>22s} {'CPU µs':>7s} "
          f"{'loop thr µs':>11s}")  # fmt: skip
    base_wall = median(r["wall"] for r in base)
    for name, runs in samples.items():
        ratios = sorted(r["wall"] / b["wall"] for r, b in zip(runs, base, strict=True))
        q = len(ratios) // 4
        wall = median(r["wall"] for r in runs)
        print(f"{name:28s} {wall * 1e6:8.1f} {wall / base_wall:6.3f} "
              f"{statistics.median(ratios):8.3f} [{ratios[q]:.3f}-{ratios[-1 - q]:.3f}] "
              f"{median(r['cpu'] for r in runs) * 1e6:7.1f} "
              f"{median(r['loop_thread'] for r in runs) * 1e6:11.1f}")  # fmt: skip


if __name__ == "__main__":
    main()

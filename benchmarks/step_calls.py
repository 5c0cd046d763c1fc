"""Python work per training step: counts, not timings, so a loaded machine cannot move them.

A tiny-model run (``tiny_model``, ``tiny_loader(400, 8)``, one epoch, no subscriber; then
with one ``StepEnded`` subscriber), observed over ``Loop.run`` on the training thread:

- **calls**: cProfile's primitive calls divided by the steps: every Python function and
  builtin the training thread calls per step, and how many of them are trainbus functions;
- **bytecodes** (``--bytecodes``): the bytecode instructions the training thread executes per
  step (``sys.settrace`` with ``f_trace_opcodes``), all of them and those in trainbus code.
  This is the closer proxy for the Python time a step costs: a call is one count whether it
  runs 5 instructions or 50. With pytorch-ignite installed, its ``Engine`` on the same data and
  update is counted too (those in ignite's code: its loop and event firing).

Compare two trees by running it with each on ``PYTHONPATH``.

Run: ``PYTHONPATH=src .venv/bin/python benchmarks/step_calls.py [--top N] [--bytecodes]``.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
from collections import Counter
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch
import torch.nn.functional as F

from trainbus import Trainer
from trainbus import events as ev
from trainbus._loop import loop as loop_module
from trainbus.testing import tiny_loader, tiny_model

STEPS = 400


def _observed(subscribed: bool, start: Callable[[], None], stop: Callable[[], None]) -> None:
    """One run with ``start()`` / ``stop()`` around ``Loop.run`` (on the training thread)."""
    torch.manual_seed(0)
    model = tiny_model()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01),
                      tiny_loader(STEPS, 8), loss_fn=F.cross_entropy, max_epochs=1,
                      on_signal=None, progress=False)  # fmt: skip
    if subscribed:
        trainer.bus.stream(ev.StepEnded).subscribe(lambda e: None)
    original = loop_module.Loop.run

    def run(self: Any) -> Any:
        start()
        try:
            return original(self)
        finally:
            stop()

    loop_module.Loop.run = run  # type: ignore[method-assign]
    try:
        trainer.fit_sync()
    finally:
        loop_module.Loop.run = original  # type: ignore[method-assign]


def calls(subscribed: bool) -> Counter[str]:
    """Primitive calls per function (``file:function``) over one run."""
    prof = cProfile.Profile()
    _observed(subscribed, prof.enable, prof.disable)
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    return Counter({f"{k[0]}:{k[2]}": v[1] for k, v in stats.items()})


def bytecodes(subscribed: bool) -> Counter[str]:
    """Bytecode instructions executed per function (``file:function``) over one run."""
    counts: Counter[str] = Counter()

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes = True
        if event == "opcode":
            counts[f"{frame.f_code.co_filename}:{frame.f_code.co_name}"] += 1
        return trace

    _observed(subscribed, lambda: sys.settrace(trace), lambda: sys.settrace(None))
    return counts


def ignite_bytecodes() -> tuple[float, float] | None:
    """Bytecodes per iteration of pytorch-ignite's ``Engine`` on the same run: all of them, and
    those in ignite's code (the update function, the counterpart of trainbus' default step, is
    not ignite's). None without ignite (the ``bench`` extra)."""
    try:
        from ignite.engine import Engine
    except ImportError:
        return None
    torch.manual_seed(0)
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def update(engine: Engine, batch: Any) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    engine = Engine(update)
    counts: Counter[str] = Counter()

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes = True
        if event == "opcode":
            counts["ignite" if "/ignite/" in frame.f_code.co_filename else "other"] += 1
        return trace

    sys.settrace(trace)
    try:
        engine.run(tiny_loader(STEPS, 8), max_epochs=1)
    finally:
        sys.settrace(None)
    return sum(counts.values()) / STEPS, counts["ignite"] / STEPS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=0, help="also list the N largest counts")
    parser.add_argument("--bytecodes", action="store_true",
                        help="count bytecode instructions instead of calls")  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(1)
    count, what = (bytecodes, "bytecodes") if args.bytecodes else (calls, "calls")
    for subscribed in (False, True):
        counts = count(subscribed)
        total = sum(counts.values())
        ours = sum(n for k, n in counts.items() if "trainbus" in k)
        name = "one StepEnded subscriber" if subscribed else "no subscriber"
        print(f"{name}: {total / STEPS:.1f} {what}/step, {ours / STEPS:.1f} in trainbus code")
        if args.top and not subscribed:
            for k, n in counts.most_common(args.top):
                print(f"  {n / STEPS:7.2f}  {k}")
    ignite = ignite_bytecodes() if args.bytecodes else None
    if ignite is not None:
        print(f"ignite's Engine, no handler: {ignite[0]:.1f} bytecodes/iteration, "
              f"{ignite[1]:.1f} in ignite code")  # fmt: skip


if __name__ == "__main__":
    main()

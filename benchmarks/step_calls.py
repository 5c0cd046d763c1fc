"""Python calls per training step: a count, not a timing, so a loaded machine cannot move it.

cProfile over ``Loop.run`` of a tiny-model run (``tiny_model``, ``tiny_loader(400, 8)``, one
epoch, no subscriber; then with one ``StepEnded`` subscriber), primitive calls divided by the
steps: every Python function and builtin the training thread calls per step, and how many of
them are trainbus functions. Compare two trees by running it with each on ``PYTHONPATH``.

Run: ``PYTHONPATH=src .venv/bin/python benchmarks/step_calls.py [--top N]``.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
from typing import Any

import torch
import torch.nn.functional as F

from trainbus import Trainer
from trainbus import events as ev
from trainbus.loop import loop as loop_module
from trainbus.testing import tiny_loader, tiny_model

STEPS = 400


def profiled(subscribed: bool) -> dict[Any, Any]:
    """One run's cProfile stats of the training thread (``Loop.run``)."""
    torch.manual_seed(0)
    model = tiny_model()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01),
                      tiny_loader(STEPS, 8), loss_fn=F.cross_entropy, max_epochs=1,
                      handle_signals=False, progress=False)  # fmt: skip
    if subscribed:
        trainer.bus.stream(ev.StepEnded).subscribe(lambda e: None)
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
        trainer.fit_sync()
    finally:
        loop_module.Loop.run = original  # type: ignore[method-assign]
    return pstats.Stats(prof).stats  # type: ignore[attr-defined, no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=0, help="also list the N most called")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for subscribed in (False, True):
        stats = profiled(subscribed)
        total = sum(v[1] for v in stats.values())
        ours = sum(v[1] for k, v in stats.items() if "trainbus" in k[0])
        name = "one StepEnded subscriber" if subscribed else "no subscriber"
        print(f"{name}: {total / STEPS:.1f} calls/step, {ours / STEPS:.1f} in trainbus functions")
        if args.top and not subscribed:
            for n, k in sorted(((v[1], k) for k, v in stats.items()), reverse=True)[: args.top]:
                print(f"  {n / STEPS:6.2f}  {k[0]}:{k[2]}")


if __name__ == "__main__":
    main()

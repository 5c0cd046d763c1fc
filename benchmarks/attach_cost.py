"""What an attachable run costs while nobody is attached.

Per optimizer step, on the tiny MLP of the tests (32-64-10, batch 32, CPU), one ``fit()`` of
``--steps`` steps per measurement:

- ``bare``: a plain PyTorch loop (forward, backward, SGD step, zero_grad);
- ``attach off``: ``Trainer(..., attach=False)``;
- ``attach on``: ``Trainer(..., attach=<folder>)``: rank 0 listens on ``<folder>/attach.sock``
  (socket, token file, an accept thread and a status thread that sleeps until someone
  attaches); nobody attaches.

Both Trainer runs have no ``checkpoint_dir`` (no checkpoint write in the timing) and no
progress bar. Rounds are interleaved (``_common.interleaved_rounds``) and the medians of the
per-round ratios are reported (``paired_ratios``): ``on/off`` is the figure that matters
(what being attachable costs), ``off/bare`` and ``on/bare`` the ratio to a bare loop.

Run: ``PYTHONPATH=src .venv/bin/python benchmarks/attach_cost.py [--steps 400] [--rounds 9]``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from _common import (
    bare_loop_s,
    format_table,
    interleaved_rounds,
    machine_info,
    paired_ratios,
    summarize,
)

import trainbus
from trainbus.testing import tiny_model


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(32, 32, generator=g), torch.randint(0, 10, (32,), generator=g))
            for _ in range(n)]  # fmt: skip


def bare(steps: int) -> float:
    return bare_loop_s(tiny_model(), batches(steps), lr=0.01) / steps


def trainer(steps: int, attach: bool | Path) -> float:
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    t = trainbus.Trainer(model, opt, batches(steps), loss_fn=F.cross_entropy, max_steps=steps,
                         progress=False, attach=attach, handle_signals=False)  # fmt: skip
    t0 = time.perf_counter()
    t.fit_sync()
    elapsed = time.perf_counter() - t0
    if isinstance(attach, Path):
        assert not (attach / "attach.sock").exists()
    return elapsed / steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        samples = interleaved_rounds({
            "bare": lambda: bare(args.steps),
            "attach off": lambda: trainer(args.steps, False),
            "attach on": lambda: trainer(args.steps, folder),
        }, args.rounds)  # fmt: skip
    info = machine_info()
    print(f"torch {torch.__version__}, 1 thread, {args.steps} steps per fit, {args.rounds} "
          f"interleaved rounds; load {info.get('load_average')}")  # fmt: skip
    stats = summarize(samples)
    rows = [[name, f"{s['median'] * 1e6:.1f}", f"{s['min'] * 1e6:.1f}", f"{s['max'] * 1e6:.1f}"]
            for name, s in stats.items()]  # fmt: skip
    print(format_table(["variant", "us/step median", "min", "max"], rows))
    vs_off = paired_ratios(samples, "attach off")["attach on"]
    vs_bare = paired_ratios(samples, "bare")
    print(format_table(["ratio (paired per round)", "median", "p25", "p75"], [
        ["attach on / attach off", f"{vs_off['median']:.3f}", f"{vs_off['p25']:.3f}",
         f"{vs_off['p75']:.3f}"],
        *[[f"{n} / bare", f"{vs_bare[n]['median']:.2f}", f"{vs_bare[n]['p25']:.2f}",
           f"{vs_bare[n]['p75']:.2f}"] for n in ("attach off", "attach on")],
    ]))  # fmt: skip


if __name__ == "__main__":
    main()

"""A small training job the attach tests attach to (a real process, real files).

    job.py RUN_DIR [--max-steps N] [--log-every N] [--pause-at K ...] [--attach FOLDER|off]

``--pause-at K``: rank 0's ``after_optimizer_step`` hook at step K waits until a command is on
its bus (one an attachment sent) or the file ``RUN_DIR/release-K`` exists (at most 240 s):
the tests are deterministic without sleeping as verdicts. Before waiting it writes
``RUN_DIR/paused-K``. Other ranks never wait (the collectives hold them).

At the end each rank writes ``RUN_DIR/result-rank<r>.json``: the steps, the stop reason, the
last StepEnded step, the optimizer's lr, and whether the bus wanted StepEnded while paused.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import trainbus
from trainbus import EvalSchedule
from trainbus import events as ev


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("run_dir")
    p.add_argument("--max-steps", type=int, default=40)
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--pause-at", type=int, action="append", default=[])
    p.add_argument("--attach", default="on")
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stdout)  # trainbus' info lines: stdout
    run = Path(a.run_dir)
    rank = int(os.environ.get("RANK", "0"))
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(16)]
    attach: Any = {"on": True, "off": False}.get(a.attach, a.attach)
    t = trainbus.Trainer(model, opt, data, loss_fn=nn.functional.mse_loss, max_steps=a.max_steps,
                         log_every=a.log_every, checkpoint_dir=run, eval_data=data[:2],
                         eval_schedule=EvalSchedule(epoch_end=False, at_end=False), progress=False,
                         attach=attach, trace={"optimizer_step"})  # fmt: skip
    seen: dict[str, Any] = {"wanted_while_paused": []}
    steps: list[int] = []
    t.bus.stream(ev.StepEnded).subscribe(lambda e: steps.append(e.step), ranks="all")

    def pause(ctx: Any) -> None:
        if rank != 0 or ctx.step not in a.pause_at:
            return
        seen["wanted_while_paused"].append(t.bus.wants(ev.SpanTraced))
        (run / f"paused-{ctx.step}").write_text(str(os.getpid()))
        release = run / f"release-{ctx.step}"
        deadline = time.monotonic() + 240
        port = t.bus.port()  # the loop's face: a command waiting for the next poll point
        while not (port.has_commands() or release.exists()) and time.monotonic() < deadline:
            time.sleep(0.01)

    t.add_hook("after_optimizer_step", pause)
    result = t.fit_sync()
    out = {"steps": result.steps, "stop_reason": result.stop_reason,
           "last_step": steps[-1] if steps else None, "lr": opt.param_groups[0]["lr"],
           "files": sorted(f.name for f in run.iterdir()), **seen}  # fmt: skip
    (run / f"result-rank{rank}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main()

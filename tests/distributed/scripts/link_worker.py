"""Run by trainbus' launcher under torchrun (tests/distributed/test_launcher.py): a hand-built
EventBus on each rank, rank 0's linked to the driver with a WorkerLink, a plain loop that
publishes events and applies the agreed commands at sync points.

argv: <out dir> <mode: run | die | die1 | token> <max steps>

die: every rank SIGKILLs itself at step 5; die1: only rank 1 does (torchrun then SIGTERMs rank
0, blocked in its all-reduce).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import anyio
import anyio.to_thread
import torch
import torch.distributed as dist

from trainbus import EventBus, LaunchError
from trainbus import commands as cmd
from trainbus import events as ev
from trainbus._distributed.group import ProcessGroup
from trainbus._distributed.link import WorkerLink
from trainbus._distributed.protocol import ADDR_ENV
from trainbus._distributed.sync import RankSync


def train(bus: EventBus, group: ProcessGroup, mode: str, max_steps: int) -> dict[str, object]:
    agreement = RankSync(group)
    bus.publish(ev.FitStarted(step=0, epoch=0, max_steps=max_steps, max_epochs=None,
                              device="cpu"))  # fmt: skip
    reason, stop_reason, step = "completed", None, 0
    for step in range(1, max_steps + 1):
        time.sleep(0.01)
        if group.distributed:
            dist.all_reduce(torch.ones(1))  # what DDP does every step
        bus.publish(ev.StepEnded(step=step, epoch=0, loss=torch.tensor(1.0 / step), lr=0.1,
                                 grad_norm=None, samples=4, duration_s=0.01))  # fmt: skip
        if step == 5 and (mode == "die" or (mode == "die1" and group.rank == 1)):
            time.sleep(0.5)  # what was published reaches the driver; then a hard death
            os.kill(os.getpid(), signal.SIGKILL)
        if step % 2 == 0:  # a sync point
            for c in agreement.agree(bus.port().poll_commands()):
                bus.publish(ev.CommandApplied(step=step, epoch=0, command=c))
                if isinstance(c, cmd.StopTraining):
                    reason, stop_reason = "stopped", c.reason
            if reason == "stopped":
                break
    bus.publish(ev.FitEnded(step=step, epoch=0, reason=reason, stop_reason=stop_reason))
    return {"rank": group.rank, "stop_step": step, "reason": reason}


async def main() -> None:
    out, mode, max_steps = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    group = ProcessGroup.from_env(timeout=30)
    bus = EventBus(flush_interval=0.005)
    link = WorkerLink.from_env() if group.is_main else None
    result: dict[str, object] = {}
    if link is not None:
        if mode == "token":  # an impostor without the token is refused
            try:
                WorkerLink(os.environ[ADDR_ENV], "not-the-token", timeout=5).connect()
                result["impostor"] = "accepted"
            except LaunchError as exc:
                result["impostor"] = str(exc)
        link.start(bus)
    async with bus:
        result |= await anyio.to_thread.run_sync(train, bus, group, mode, max_steps)
    if link is not None:
        link.close()
        result["sent"] = link.sent
    group.close()
    (out / f"rank{result['rank']}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    anyio.run(main)

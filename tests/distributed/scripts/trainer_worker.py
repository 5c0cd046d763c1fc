"""A real Trainer script, the same under ``python`` and ``torchrun``: the tests run it with 2
gloo ranks (tests/distributed/test_trainer_ddp.py).

    trainer_worker.py OUT MODE[,MODE...] [SEEDS]

Several modes in one launch run one after the other in the same processes: the script then
owns the process group and each Trainer adopts it (and leaves it alone at the end).

Each rank writes ``OUT/<mode>-rank<r>[-<run>].json``: the steps it took, its final parameters'
checksum and exact bytes' hash, the events its bus delivered, and the FitResult; with several
modes also ``OUT/owned-rank<r>.json``: the OS threads left after the script destroyed its group.

Modes:
    shards          train 2 epochs; record each rank's sample indices (and log its rank)
    custom          a custom step (train_step=) with accumulation under DDP
    stop SEEDS      for each seed: a rank-0 subscriber sends StopTraining at a random step
    rank1           a ranks="all" subscriber sends SetLearningRate on rank 1 only
    save            train with checkpoint_dir OUT/ckpt, stopped mid-epoch (step 11)
    resume          resume from OUT/ckpt latest and finish; compare with `full`
    full            the same run as save+resume, uninterrupted
    launched        a run for `trainbus launch` (events go to the driver)
    signal          a long run the test SIGTERMs on every rank
    setmetric       set_metrics over the sharded eval set; one metric raises on rank 1 only
    exit            a short run whose Trainer stays alive until exit (as a script's top-level
                    ``t``); records the gloo threads still running after ``fit_sync()``
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch
from _threads import TASKS, thread_names  # the scripts' folder is sys.path[0]
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

import trainbus
from trainbus import commands as cmd
from trainbus import events as ev
from trainbus import operators as tbops

OUT = Path(sys.argv[1])
MODES = sys.argv[2].split(",")
ARGS = sys.argv[3:]


class Indexed(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """64 samples; each remembers its index in the last input feature (set to 0 for training)."""

    def __init__(self, n: int = 64) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=g)
        self.y = torch.randint(0, 3, (n,), generator=g)
        self.seen: list[int] = []

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.seen.append(int(i))
        return self.x[i], self.y[i]


def digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().numpy().tobytes())
    return h.hexdigest()


def trainer(data: Indexed, **kw: Any) -> trainbus.Trainer:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(data, batch_size=4, shuffle=True)
    kw.setdefault("max_epochs", 2)
    kw.setdefault("log_every", 3)
    kw.setdefault("on_signal", None)
    return trainbus.Trainer(model, opt, loader, loss_fn=F.cross_entropy, seed=0, progress=False,
                            eval_data=DataLoader(Indexed(), batch_size=8),
                            **kw)  # fmt: skip


def record(t: trainbus.Trainer, name: str, **extra: Any) -> None:
    r = t.result
    assert r is not None
    model = t.settings.model
    rank = t.bus.rank
    out = {"rank": rank, "steps": r.steps, "reason": r.reason, "stop_reason": r.stop_reason,
           "digest": digest(model), "metrics": dict(r.eval_metrics),
           "train_metrics": dict(r.train_metrics), **extra}  # fmt: skip
    (OUT / f"{name}-rank{rank}.json").write_text(json.dumps(out))


def main() -> None:
    own = len(MODES) > 1
    if own:
        torch.distributed.init_process_group("gloo")
    for mode in MODES:
        run(mode)
    if own:
        rank = torch.distributed.get_rank()
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
        # The script's own group, destroyed: nothing may keep it (and gloo's threads) alive.
        (OUT / f"owned-rank{rank}.json").write_text(json.dumps({"threads": native_threads()}))


def run(mode: str) -> None:
    data = Indexed()
    if mode == "shards":
        t = trainer(data)
        started: list[ev.FitStarted] = []
        t.bus.stream(ev.FitStarted).subscribe(started.append, ranks="all")
        rank = int(os.environ["RANK"])  # a metric of each rank's own: averaged like the loss
        t.add_hook("after_optimizer_step", lambda ctx: ctx.log("rank_logged", float(rank)))
        t.fit_sync()
        fs = started[0]
        record(t, "shards", seen=data.seen, rank_field=fs.rank, world_size=fs.world_size)
    elif mode == "custom":
        # A custom step under DDP with accumulation: the ranks see different shards, so they
        # end identical only if the step's backwards were reduced (no_sync but the last).
        def step(ctx: trainbus.TrainContext) -> torch.Tensor:
            x, y = ctx.batch
            loss = F.cross_entropy(ctx.model(x), y) + F.cross_entropy(ctx.model(x * 0.5), y)
            ctx.backward(loss)
            ctx.optimizer_step()
            ctx.log("rank_logged", float(os.environ["RANK"]))
            return loss

        t = trainer(data, train_step=step, accumulate=2, clip_grad_norm=1.0)
        t.fit_sync()
        record(t, "custom")
    elif mode == "stop":
        for seed in [int(a) for a in ARGS]:
            at = random.Random(seed).randint(1, 15)
            t = trainer(data)
            steps: list[ev.StepEnded] = []
            t.bus.stream(ev.StepEnded).subscribe(steps.append, ranks="all")

            def stop(e: ev.StepEnded, at: int = at, t: trainbus.Trainer = t) -> None:
                if e.step == at:
                    t.bus.send(cmd.StopTraining(reason=f"at {at}"))

            t.bus.stream(ev.StepEnded).subscribe(stop)  # rank 0 only (the default)
            t.fit_sync()
            record(t, f"stop{seed}", at=at, last=steps[-1].step if steps else None)
    elif mode == "decided":
        # A rank-0 pipeline declaring its decision steps (tbops.every(5)) stops at step 10:
        # the schedules are agreed at the run's start, so step 10 is a common sync point and
        # both ranks stop exactly there (not at the next log window, step 12).
        t = trainer(data)

        def stop_at_10(e: ev.StepEnded, t: trainbus.Trainer = t) -> None:
            if e.step == 10:
                t.bus.send(cmd.StopTraining(reason="decided at 10"))

        t.bus.stream(ev.StepEnded).pipe(tbops.every(5)).subscribe(stop_at_10)
        t.fit_sync()
        record(t, "decided")
    elif mode == "rank1":
        t = trainer(data)
        lrs: list[float] = []

        def on_step(e: ev.StepEnded) -> None:
            lrs.append(e.lr)
            if e.step == 5 and t.bus.rank == 1:
                t.bus.send(cmd.SetLearningRate(lr=0.01))

        t.bus.stream(ev.StepEnded).subscribe(on_step, ranks="all")
        applied: list[int] = []
        t.bus.stream(ev.CommandApplied).subscribe(lambda e: applied.append(e.step), ranks="all")
        t.fit_sync()
        record(t, "rank1", lrs=lrs, applied=applied)
    elif mode in ("save", "full"):
        # save: stopped mid-epoch (max_steps=11, batch 3 of epoch 1) with its final checkpoint
        kw: dict[str, Any] = {}
        if mode == "save":
            kw = {"checkpoint_dir": OUT / "ckpt", "max_steps": 11}
        t = trainer(data, **kw)
        t.fit_sync()
        saved = sorted(p.name for p in (OUT / "ckpt").glob("*.pt")) if mode == "save" else []
        record(t, mode, saved=saved)
    elif mode == "resume":
        t = trainer(data, checkpoint_dir=OUT / "ckpt")
        t.fit_sync(resume="latest")
        record(t, "resume")
    elif mode == "signal":
        # SIGTERM on every rank (what torchrun forwards): each rank's Trainer sends
        # StopTraining("signal"), agreed like any command. The test signals once OUT/ready-<r>.
        t = trainer(data, max_epochs=200, on_signal="raise")
        t.add_hook("after_optimizer_step", lambda ctx: time.sleep(0.005))
        rank = t.bus.rank

        def ready(e: ev.StepEnded) -> None:
            if e.step == 5:
                (OUT / f"ready-{rank}").write_text(str(os.getpid()))

        t.bus.stream(ev.StepEnded).subscribe(ready, ranks="all")
        try:
            t.fit_sync()
        except SystemExit as exc:  # on_signal="raise": after the graceful stop, 128 + SIGTERM
            record(t, "signal", raised=exc.code, ending=str(t.result.ending if t.result else None))
        else:
            record(t, "signal", raised=None)
    elif mode == "launched":
        # Under `trainbus launch`: rank 0's events go to the driver, whose StopTraining stops
        # both ranks. A slow step (5 ms) leaves the driver time to answer.
        t = trainer(data, max_epochs=20)
        t.add_hook("after_optimizer_step", lambda ctx: time.sleep(0.005))
        t.fit_sync()
        record(t, "launched")
    elif mode == "setmetric":
        rank = int(os.environ["RANK"])
        local: list[int] = []  # the eval samples this rank summed

        class Counted:
            def update(self, outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, Any]:
                local.append(len(targets))
                return {"n": len(targets), "rank": float(rank) * len(targets)}

            def compute(self, totals: dict[str, float]) -> float:
                return totals["n"] + totals["rank"] / 1000

        class Rank1Fails:
            def update(self, outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, Any]:
                if rank == 1:
                    raise ValueError("rank 1 only")
                return {"n": len(targets)}

            def compute(self, totals: dict[str, float]) -> float:
                return totals["n"]

        t = trainer(
            data,
            max_epochs=1,
            set_metrics={"n": Counted(), "acc": trainbus.TokenAccuracy(), "flaky": Rank1Fails()},
        )
        evals: list[dict[str, float]] = []
        t.bus.stream(ev.EvaluationEnded).subscribe(lambda e: evals.append(dict(e.metrics)),
                                                   ranks="all")  # fmt: skip
        t.fit_sync()
        assert t.result is not None
        record(t, "setmetric", local=local, evals=evals, failures=dict(t.result.metric_failures))
    elif mode == "exit":
        t = trainer(data, max_epochs=1)
        t.fit_sync()
        KEPT.append(t)  # alive until the interpreter exits, as a script's top-level trainer
        record(t, "exit", threads=native_threads())
    else:
        raise SystemExit(f"unknown mode {mode}")


KEPT: list[trainbus.Trainer] = []


def native_threads() -> list[str]:
    """The names of this process' OS threads besides the main one (Linux: /proc)."""
    main_name = Path("/proc/self/comm").read_text().strip() if TASKS.is_dir() else ""
    return [n for n in thread_names() if n != main_name]


if __name__ == "__main__":
    main()

"""FSDP2 (fully_shard) under trainbus, the same script on every rank: the tests run it with 2
gloo ranks (tests/distributed/test_fsdp.py).

    fsdp_worker.py OUT MODE[,MODE...]

The script owns the process group; each Trainer adopts it. The model is an MLP 16-64-64-H with
every Linear and then the root sharded (``fully_shard``), trained with AdamW: H=5 splits the
head's rows 3 + 2 across 2 ranks (uneven), H=6 3 + 3 (even).

Each rank writes ``OUT/<mode>-rank<r>.json`` (what it saw) and, for the runs compared
tensor by tensor, ``OUT/<mode>-rank<r>.pt`` (its shards of every parameter and optimizer
moment).

Modes:
    parity        a hand-written FSDP2 loop and trainbus (default ddp, clip_grad_norm, a
                  partial last log window): every loss, norm and parameter
    gradmon       GradientNormMonitor(every=2) with the default rank-0 subscriber
    nan           a NaN in rank 1's shard before the final save: refused on both ranks
    full5 full6   10 steps uninterrupted (head 5 / 6), shuffled data
    save5 save6   the same run stopped at step 7 (mid-epoch), with step checkpoints kept 2
    resume5 resume6  resume="latest" from save<H> and finish
    loadfail      resume from a folder whose rank-1 file is damaged: a CheckpointError on both
    ddp           Trainer(ddp=True) for a sharded model: a ConfigError
    earlyopt      an optimizer built before fully_shard: a ConfigError
    onefile       resume a sharded run from a one-file checkpoint: a CheckpointError
    mesh          a model sharded over a 1-rank mesh on 2 ranks: a ConfigError at fit()
    saveapi       the one-file save_checkpoint() given a sharded model: a ConfigError
    export        export_full of save5's last folder (rank 0), compared with full_tensor()
    mixed         MixedPrecisionPolicy(bf16) + activation checkpointing + clipping, saved
    badstate      a callback state that cannot be saved: a ConfigError on every rank
    reshard       (1 rank) resume save5's 2-rank folder: DCP reshards; train a third epoch
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import trainbus
from trainbus import events as ev
from trainbus.callbacks import Checkpointing, GradientNormMonitor

OUT = Path(sys.argv[1])
MODES = sys.argv[2].split(",")


def dataset(head: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(
        torch.randn(40, 16, generator=g), torch.randint(0, head, (40,), generator=g)
    )


def build(head: int = 5, *, shard: bool = True) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(1)
    model = nn.Sequential(
        nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, head)
    )
    if shard:
        for layer in (model[0], model[2], model[4]):
            fully_shard(layer)
        fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def trainer(model: nn.Module, opt: torch.optim.Optimizer, data: Any, **kw: Any) -> trainbus.Trainer:
    kw.setdefault("max_epochs", 2)
    # No attach server: rank 0's attach.sock and attach.token live in the checkpoint folder
    # until its fit() ends, and the other rank may list the folder before then (seen under load).
    kw.setdefault("attach", False)
    return trainbus.Trainer(model, opt, data, loss_fn=F.cross_entropy, seed=0, progress=False,
                            on_signal=None, **kw)  # fmt: skip


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def shards(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """This rank's shard of every parameter and optimizer moment."""
    out = {f"param/{n}": local(p.detach()).clone() for n, p in model.named_parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, state in opt.state.items():
        for k, v in state.items():
            if isinstance(v, torch.Tensor):
                out[f"optim/{names[id(p)]}/{k}"] = local(v).clone()
    return out


def write(name: str, **data: Any) -> None:
    rank = dist.get_rank()
    (OUT / f"{name}-rank{rank}.json").write_text(json.dumps({"rank": rank, **data}))


def parity() -> None:
    rank = dist.get_rank()
    data = dataset(5)
    model, opt = build()
    sampler: DistributedSampler[Any] = DistributedSampler(
        data, num_replicas=2, rank=rank, shuffle=False
    )
    loader = DataLoader(data, batch_size=4, sampler=sampler)
    hand_losses, hand_norms = [], []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            hand_losses.append(loss.item())
            hand_norms.append(float(norm.full_tensor()))
    hand = shards(model, opt)

    model2, opt2 = build()
    t = trainer(model2, opt2, DataLoader(data, batch_size=4), clip_grad_norm=1.0, log_every=4)
    steps: list[ev.StepEnded] = []
    t.bus.stream(ev.StepEnded).subscribe(steps.append, ranks="all")
    t.fit_sync()
    assert t.result is not None
    ours = shards(model2, opt2)
    wrapped = type(t.settings.model).__name__
    write("parity", hand_losses=hand_losses, losses=[float(e.loss) for e in steps],
          hand_norms=hand_norms, norms=[float(e.grad_norm) for e in steps],
          norm_types=sorted({type(e.grad_norm).__name__ for e in steps}),
          same_params=sorted(hand) == sorted(ours)
          and all(torch.equal(hand[k], ours[k]) for k in hand),
          train_grad_norm=t.result.train_metrics.get("grad_norm"), wrapped=wrapped,
          steps=t.result.steps)  # fmt: skip


def gradmon() -> None:
    model, opt = build()
    t = trainer(
        model, opt, DataLoader(dataset(5), batch_size=4), callbacks=[GradientNormMonitor(every=2)]
    )
    got: list[ev.GradientNormMeasured] = []
    t.bus.stream(ev.GradientNormMeasured).subscribe(got.append)  # the default: rank 0 only
    t.fit_sync()
    assert t.result is not None
    write("gradmon", steps=t.result.steps, measured=[e.step for e in got],
          values=[float(e.grad_norm) for e in got],
          types=sorted({type(e.grad_norm).__name__ for e in got}))  # fmt: skip


def nan() -> None:
    model, opt = build()
    rank = dist.get_rank()

    def poison(ctx: Any) -> None:
        if rank == 1 and ctx.step == 3:
            with torch.no_grad():
                model[4].weight.to_local()[0, 0] = float("nan")

    t = trainer(model, opt, DataLoader(dataset(5), batch_size=4), max_steps=3,
                checkpoint_dir=OUT / "nan")  # fmt: skip
    t.add_hook("after_optimizer_step", poison)
    t.fit_sync()
    assert t.result is not None
    written = sorted(p.name for p in (OUT / "nan").iterdir()) if (OUT / "nan").exists() else []
    write("nan", reason=t.result.reason, checkpoint=t.result.last_checkpoint, written=written)


def straight(mode: str) -> None:
    head = int(mode[-1])
    model, opt = build(head)
    kw: dict[str, Any] = {}
    saved: list[str] = []
    if mode.startswith("save"):
        keep = Checkpointing(every_steps=2, every_epochs=None, keep_last=2)
        kw = {"checkpoint_dir": OUT / f"ckpt{head}", "max_steps": 7, "callbacks": [keep]}
    elif mode.startswith("resume"):
        kw = {"checkpoint_dir": OUT / f"ckpt{head}"}
    t = trainer(model, opt, DataLoader(dataset(head), batch_size=4, shuffle=True), **kw)
    t.bus.stream(ev.CheckpointSaved).subscribe(lambda e: saved.append(e.path), ranks="all")
    t.fit_sync(resume="latest" if mode.startswith("resume") else None)
    assert t.result is not None
    torch.save(shards(model, opt), OUT / f"{mode}-rank{dist.get_rank()}.pt")
    folder = OUT / f"ckpt{head}"
    listing = sorted(p.name for p in folder.iterdir()) if folder.exists() else []
    write(mode, steps=t.result.steps, saved=saved, listing=listing,
          checkpoint=t.result.last_checkpoint)  # fmt: skip


def loadfail() -> None:
    src = OUT / "ckpt5" / "step-00000007-final"
    if dist.get_rank() == 0:
        import shutil

        shutil.copytree(src, OUT / "broken")
        (OUT / "broken" / "rank-1.pt").write_bytes(b"not a torch file")
    dist.barrier()
    model, opt = build()
    t = trainer(model, opt, DataLoader(dataset(5), batch_size=4), checkpoint_dir=OUT / "unused")
    try:
        t.fit_sync(resume=OUT / "broken")
    except trainbus.CheckpointError as exc:
        write("loadfail", error=type(exc).__name__, message=str(exc))
    else:
        write("loadfail", error=None, message="")


def refused(mode: str) -> None:
    data = DataLoader(dataset(5), batch_size=4)
    try:
        if mode == "ddp":
            model, opt = build()
            trainer(model, opt, data, ddp=True)
        elif mode == "earlyopt":
            model, _ = build(shard=False)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            for layer in (model[0], model[2], model[4]):
                fully_shard(layer)
            fully_shard(model)
            trainer(model, opt, data)
        elif mode == "mesh":
            # each rank shards over a mesh of itself alone: the run's collectives span 2
            groups = [dist.new_group([0]), dist.new_group([1])]
            mesh = DeviceMesh.from_group(groups[dist.get_rank()], "cpu")
            torch.manual_seed(1)
            model = nn.Sequential(nn.Linear(16, 5))
            fully_shard(model, mesh=mesh)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            trainer(model, opt, data).fit_sync()
        elif mode == "saveapi":
            model, opt = build()
            trainbus.checkpoint.save_checkpoint(
                OUT / "never", tag=None, state=trainbus.checkpoint.TrainState(), model=model,
                optimizer=opt, scheduler=None, scaler=None, metrics={},
            )  # fmt: skip
        elif mode == "onefile":
            plain, popt = build(shard=False)
            folder = OUT / f"plain{dist.get_rank()}"
            trainbus.checkpoint.save_checkpoint(
                folder, tag=None, state=trainbus.checkpoint.TrainState(), model=plain,
                optimizer=popt, scheduler=None, scaler=None, metrics={},
            )  # fmt: skip
            model, opt = build()
            trainer(model, opt, data, checkpoint_dir=folder).fit_sync(resume="latest")
    except (trainbus.ConfigError, trainbus.CheckpointError) as exc:
        write(mode, error=type(exc).__name__, message=str(exc))
    else:
        write(mode, error=None, message="")


def export() -> None:
    folder = OUT / "ckpt5" / "step-00000007-final"
    model, opt = build()
    t = trainer(model, opt, DataLoader(dataset(5), batch_size=4), max_steps=7)
    t.fit_sync(resume=folder)  # the model now holds the saved state (nothing left to train)
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    if dist.get_rank() == 0:
        target = trainbus.checkpoint.export_full(folder, OUT / "exported.pt")
        plain, _ = build(shard=False)
        plain.load_state_dict(torch.load(target, weights_only=True))
        same = all(torch.equal(full[n], p) for n, p in plain.named_parameters())
        write("export", same=same, keys=sorted(torch.load(target, weights_only=True)))
    dist.barrier()


def reshard() -> None:
    """On 1 rank: resume the 2-rank checkpoint (DCP reshards it), then train on."""
    folder = OUT / "ckpt5" / "step-00000007-final"
    model, opt = build()
    t = trainer(model, opt, DataLoader(dataset(5), batch_size=4), max_epochs=3)
    first: dict[str, torch.Tensor] = {}

    def keep(ctx: Any) -> None:
        if not first:
            first.update({n: local(p.detach()).clone() for n, p in model.named_parameters()})

    t.add_hook("batch", keep)  # before the first update: the state resumed
    t.fit_sync(resume=folder)
    assert t.result is not None
    exported = torch.load(OUT / "exported.pt", weights_only=True)
    write("reshard", steps=t.result.steps, world=dist.get_world_size(),
          same=all(torch.equal(first[n], exported[n]) for n in exported))  # fmt: skip


class Block(nn.Module):
    """A Linear + ReLU recomputed in the backward (activation checkpointing)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = checkpoint(lambda t: F.relu(self.lin(t)), x, use_reentrant=False)
        return out


def mixed() -> None:
    """MixedPrecisionPolicy(bf16) and activation checkpointing, clipped, with a save."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(16, 64), Block(), Block(), nn.Linear(64, 5))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    recomputed: list[int] = []
    model[1].lin.register_forward_hook(lambda *_: recomputed.append(1))
    t = trainer(model, opt, DataLoader(dataset(5), batch_size=4), clip_grad_norm=1.0,
                checkpoint_dir=OUT / "mixed")  # fmt: skip
    t.fit_sync()
    assert t.result is not None
    write("mixed", steps=t.result.steps, reason=t.result.reason,
          checkpoint=t.result.last_checkpoint,
          forwards=len(recomputed), loss=t.result.train_metrics["loss"],
          dtype=str(next(model.parameters()).dtype))  # fmt: skip


class Unsavable(trainbus.Callback):
    """A callback whose state holds an object ``weights_only`` cannot load back."""

    def state_dict(self) -> dict[str, Any]:
        return {"handle": object()}


def badstate() -> None:
    """The final save's callback state cannot be saved: refused on every rank alike."""
    model, opt = build()
    t = trainer(model, opt, DataLoader(dataset(5), batch_size=4), max_steps=2,
                checkpoint_dir=OUT / "badstate", callbacks=[Unsavable()])  # fmt: skip
    try:
        t.fit_sync()
    except trainbus.ConfigError as exc:
        folder = OUT / "badstate"
        left = sorted(p.name for p in folder.iterdir()) if folder.exists() else []
        write("badstate", error=type(exc).__name__, message=str(exc), left=left)
    else:
        write("badstate", error=None, message="", left=[])


def main() -> None:
    dist.init_process_group("gloo")
    for mode in MODES:
        if mode == "parity":
            parity()
        elif mode == "gradmon":
            gradmon()
        elif mode == "nan":
            nan()
        elif mode[:-1] in ("full", "save", "resume"):
            straight(mode)
        elif mode == "loadfail":
            loadfail()
        elif mode in ("ddp", "earlyopt", "mesh", "saveapi", "onefile"):
            refused(mode)
        elif mode == "export":
            export()
        elif mode == "reshard":
            reshard()
        elif mode == "mixed":
            mixed()
        elif mode == "badstate":
            badstate()
        else:
            raise SystemExit(f"unknown mode {mode}")
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

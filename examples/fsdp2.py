"""Sharded training with FSDP2 under trainbus, on 2 CPU ranks (gloo): train, checkpoint, resume,
export.

    python examples/fsdp2.py                              # starts itself under torchrun, 2 ranks
    torchrun --nproc_per_node=2 examples/fsdp2.py         # the same

Each rank builds the model, shards every Linear and then the root with ``fully_shard``, and only
then builds the optimizer (over the sharded parameters). The Trainer recognises the sharded model
(no DDP wrapper) and saves checkpoint folders written by every rank through
``torch.distributed.checkpoint``. The script trains 10 steps straight, then the same run stopped
at step 7 (mid-epoch) and resumed from its checkpoint folder, compares the two bit for bit, and
exports the folder to one plain file an unsharded model loads.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import trainbus
from trainbus.checkpoint import export_full


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(1)
    model = nn.Sequential(
        nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 5)
    )
    # A CPU mesh, named: fully_shard's default mesh is on the GPU when there is one (one GPU
    # per rank, with NCCL: then drop mesh= here and device= below).
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer, mesh=mesh)  # each layer its own unit: gathered only around it
    fully_shard(model, mesh=mesh)  # then the root
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)  # after sharding


def train(folder: Path, *, max_steps: int | None = None, resume: str | None = None) -> nn.Module:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(40, 16, generator=g), torch.randint(0, 5, (40,), generator=g))
    model, opt = build()
    trainer = trainbus.Trainer(
        model, opt, DataLoader(data, batch_size=4, shuffle=True), loss_fn=F.cross_entropy,
        max_epochs=2, max_steps=max_steps, seed=0, checkpoint_dir=folder, device="cpu",
        progress=False,
    )  # fmt: skip
    trainer.fit_sync(resume=resume)
    return model


def main(folder: Path) -> None:
    dist.init_process_group("gloo")
    straight = train(folder / "straight")
    train(folder / "run", max_steps=7)  # stopped mid-epoch: its final checkpoint folder
    resumed = train(folder / "run", resume="latest")
    same = all(
        torch.equal(a.to_local(), b.to_local())
        for a, b in zip(straight.parameters(), resumed.parameters(), strict=True)
    )
    full = {name: p.full_tensor() for name, p in resumed.named_parameters()}  # a collective
    if dist.get_rank() == 0:
        saved = folder / "run" / "step-00000007-final"
        files = sorted(p.name for p in saved.iterdir())
        exported = export_full(folder / "run" / "step-00000010-final", folder / "model.pt")
        plain = nn.Sequential(
            nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 5)
        )
        plain.load_state_dict(torch.load(exported, weights_only=True))
        loads = all(torch.equal(full[n], p) for n, p in plain.named_parameters())
        print(
            f"fsdp2: {dist.get_world_size()} ranks, folder {saved.name} holds {files}; "
            f"resumed at step 7 bit-identical: {same}; exported model loads: {loads}"
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    if "LOCAL_RANK" in os.environ:  # a rank under torchrun
        main(Path(sys.argv[1]))
    else:  # start ourselves on 2 CPU ranks, in a temporary folder
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc_per_node=2", __file__, tmp]  # fmt: skip
            sys.exit(subprocess.run(cmd, check=False).returncode)

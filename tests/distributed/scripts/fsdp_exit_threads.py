"""A model sharded with ``fully_shard``, trained by trainbus on the script's own group, then
``full_tensor()`` (DTensor work after the fit) and the group destroyed: the gloo threads still
running right after the destroy and at exit.

    fsdp_exit_threads.py OUT

Each rank writes ``OUT/rank<r>.json``: ``destroyed`` (gloo threads right after the destroy) and
``exit`` (gloo threads in an exit handler that runs after trainbus's).
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import sys
from pathlib import Path

from _threads import thread_names  # the scripts' folder is sys.path[0]

OUT = Path(sys.argv[1])
record: dict[str, list[str]] = {}


def gloo_threads() -> list[str]:
    return [n for n in thread_names() if "gloo" in n]


def at_exit() -> None:  # registered before trainbus is imported: runs after its exit handler
    record["exit"] = gloo_threads()
    (OUT / f"rank{os.environ['RANK']}.json").write_text(json.dumps(record))


atexit.register(at_exit)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.nn import functional as F  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import trainbus  # noqa: E402  (before init_process_group, as a script does)


def train() -> None:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 5))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(16, 16, generator=g), torch.randint(0, 5, (16,), generator=g))
    loader = DataLoader(data, batch_size=4)
    trainer = trainbus.Trainer(
        model,
        opt,
        loader,
        loss_fn=F.cross_entropy,
        max_epochs=1,
        seed=0,
        clip_grad_norm=1.0,
        checkpoint_dir=OUT / "ckpt",
        progress=False,
        attach=False,
        on_signal=None,
    )
    trainer.fit_sync()
    [p.full_tensor() for p in model.parameters()]  # a collective on DTensors, after the fit


def main() -> None:
    dist.init_process_group("gloo")
    train()
    gc.collect()  # the model, the mesh and the Trainer are gone
    dist.barrier()
    dist.destroy_process_group()
    record["destroyed"] = gloo_threads()


if __name__ == "__main__":
    main()

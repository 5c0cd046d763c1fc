"""Checkpointing under torchrun (tests/distributed/test_checkpoint_ddp.py): 2 gloo ranks.

    checkpoint_worker.py OUT

Run 1 trains 4 steps into OUT/ckpt with ``keep_last=1, keep_best=1, load_best_at_end=True``;
run 2, a new Trainer in the same processes, resumes it to step 10. Each rank writes
``OUT/rank<r>.json``: the best path its Checkpointing names, a hash of its model's weights
after the run, of the best file's weights and of the last file's, and the folder's files.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import trainbus
from trainbus import EvalSchedule
from trainbus.callbacks import Checkpointing

OUT = Path(sys.argv[1])


def digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for k in sorted(tensors):
        h.update(k.encode())
        h.update(tensors[k].detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def trainer(best: Checkpointing, **kw: Any) -> trainbus.Trainer:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 8, generator=g), torch.randint(0, 3, (64,), generator=g)
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    return trainbus.Trainer(
        model,
        opt,
        DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True),
        loss_fn=F.cross_entropy,
        seed=0,
        progress=False,
        on_signal=None,
        max_epochs=5,
        eval_data=DataLoader(TensorDataset(x[:32], y[:32]), batch_size=8),
        eval_schedule=EvalSchedule(every_steps=3, epoch_end=False, at_end=False),
        checkpoint_dir=OUT / "ckpt",
        callbacks=[best],
        **kw,
    )


def checkpointing() -> Checkpointing:
    # The highest val_loss: an early evaluation, so the last weights are not the best.
    return Checkpointing(every_steps=2, every_epochs=None, monitor="val_loss", mode="max",
                         keep_last=1, keep_best=1, load_best_at_end=True)  # fmt: skip


def main() -> None:
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    trainer(checkpointing(), max_steps=4).fit_sync()
    best = checkpointing()
    t = trainer(best, max_steps=10)
    result = t.fit_sync(resume="latest")
    path = best.best_path
    saved = torch.load(path, weights_only=True)["model"] if path else {}
    (OUT / f"rank{rank}.json").write_text(json.dumps({
        "steps": result.steps,
        "best_path": path,
        "model": digest(t.settings.model.state_dict()),
        "best": digest(saved),
        "last": digest(torch.load(OUT / "ckpt" / "step-00000010.pt", weights_only=True)["model"]),
        "files": sorted(p.name for p in (OUT / "ckpt").iterdir()),
    }))  # fmt: skip
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

"""EMA under torchrun (tests/distributed/test_ema_ddp.py): one launch of 2 gloo ranks.

    ema_worker.py OUT

Runs, in the same processes (the script owns the process group, each Trainer adopts it):
``plain`` (no EMA) and ``ema`` (EMA(0.8), evaluation every 5 steps and at each epoch's end,
checkpoints into OUT/ckpt, then ``trainer.evaluate()``). Each rank writes
``OUT/<run>-rank<r>.json``: hashes of the raw weights, of the average, of the model as each
evaluation saw it (parameters), the metrics, and (rank 0) of the final checkpoint's EMA weights.
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
from trainbus._hookpoints import StepContext
from trainbus.callbacks import EMA
from trainbus.checkpoint import read_checkpoint

OUT = Path(sys.argv[1])


def digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for k in sorted(tensors):
        h.update(k.encode())
        h.update(tensors[k].detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def params(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The parameters only: BatchNorm's running statistics differ across ranks under DDP (each
    rank's forward updates its own; DDP broadcasts rank 0's at the next forward)."""
    return {k: v for k, v in tensors.items() if "running" not in k and "batches" not in k}


def module(model: nn.Module) -> nn.Module:
    inner = getattr(model, "module", model)
    assert isinstance(inner, nn.Module)
    return inner


def trainer(callbacks: list[trainbus.Callback], **kw: Any) -> trainbus.Trainer:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 8, generator=g), torch.randint(0, 3, (64,), generator=g)
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return trainbus.Trainer(
        model,
        opt,
        DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True),
        loss_fn=F.cross_entropy,
        seed=0,
        progress=False,
        on_signal=None,
        max_epochs=2,
        eval_data=DataLoader(TensorDataset(x[:32], y[:32]), batch_size=8),
        eval_schedule=EvalSchedule(every_steps=5),
        callbacks=callbacks,
        **kw,
    )


def main() -> None:
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()

    plain = trainer([])
    plain.fit_sync()
    raw = digest(params(module(plain.settings.model).state_dict()))
    (OUT / f"plain-rank{rank}.json").write_text(json.dumps({"raw": raw}))

    ema = EMA(0.8)
    t = trainer([ema], checkpoint_dir=OUT / "ckpt")
    in_eval: list[tuple[int, str]] = []

    def seen(ctx: StepContext) -> None:  # after the EMA's hook: the model as evaluated
        in_eval.append((ctx.step, digest(params(module(ctx.model).state_dict()))))

    t.add_hook("before_evaluation", seen)
    result = t.fit_sync()
    again = t.evaluate_sync()
    out: dict[str, Any] = {
        "rank": rank,
        "steps": result.steps,
        "updates": ema.updates,
        "raw": digest(params(module(t.settings.model).state_dict())),
        "average": digest(params(ema.averaged_state_dict())),
        "average_all": digest(ema.averaged_state_dict()),
        "in_eval": in_eval,
        "metrics": dict(result.eval_metrics),
        "again": again,
    }
    if rank == 0:
        assert result.last_checkpoint is not None
        saved = read_checkpoint(Path(result.last_checkpoint)).callbacks["EMA"]["weights"]
        out["saved"] = digest(saved)
        out["saved_keys"] = sorted(saved)
    (OUT / f"ema-rank{rank}.json").write_text(json.dumps(out))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

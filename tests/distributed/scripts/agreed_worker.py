"""A Trainer under 2 gloo ranks where the ranks see different things: a NaN loss on rank 1
only, and DDP with gradient accumulation (tests/distributed/test_agreed.py).

    agreed_worker.py OUT MODE[,MODE...]

The script owns the process group; each mode's Trainer adopts it. Each rank writes
``OUT/<mode>-rank<r>.json``: steps, reason, error, skipped updates, the parameters' hash and
whether they are finite, and (DDP modes) how many gradient all-reduces DDP ran.

Modes (rank 1's loss is NaN at its 5th loss call, step 5; ``log_every=3``):
    skip     on_nonfinite="skip": both ranks skip step 5's update
    stop     on_nonfinite="stop": both ranks stop at the window close after it (step 6)
    raise    on_nonfinite="raise": both ranks fail with NonFiniteLossError at step 6's close
    nosync   accumulate=2, a user-wrapped DDP counting its bucket all-reduces
    cut      accumulate=2, a batch hook skips the second micro-batch of step 2 on both ranks
"""

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

import trainbus
from trainbus.testing import NaNLossAt

OUT = Path(sys.argv[1])
MODES = sys.argv[2].split(",")


def digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().numpy().tobytes())
    return h.hexdigest()


def build(**kw: Any) -> tuple[nn.Module, torch.optim.Optimizer, DataLoader[Any]]:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 3, (64,), generator=g))
    return model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(data, batch_size=4)


def run(mode: str) -> None:
    rank = dist.get_rank()
    model, opt, loader = build()
    kw: dict[str, Any] = {"max_epochs": 2, "log_every": 3, "on_signal": None,
                          "progress": False, "device": "cpu", "seed": 0}  # fmt: skip
    calls = [0]
    loss_fn: Any = F.cross_entropy
    if mode in ("skip", "stop", "raise"):
        kw["on_nonfinite"] = mode
        loss_fn = NaNLossAt(5) if rank == 1 else F.cross_entropy
    else:
        kw["accumulate"] = 2
        ddp = DistributedDataParallel(model)

        def counting(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            calls[0] += 1
            return default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]

        ddp.register_comm_hook(None, counting)
        model = ddp
    t = trainbus.Trainer(model, opt, loader, loss_fn=loss_fn, **kw)
    if mode == "cut":

        def skip_second(ctx: trainbus.StepContext) -> None:
            if ctx.step == 1 and ctx.micro_batch == 1:
                ctx.skip = True

        t.add_hook("batch", skip_second)
    error = None
    try:
        t.fit_sync()
    except trainbus.NonFiniteLossError as exc:
        error = str(exc)
    r = t.result
    assert r is not None
    params = list(t.settings.model.parameters())
    out = {"rank": rank, "steps": r.steps, "reason": r.reason, "error": error,
           "skipped": r.skipped_nonfinite, "digest": digest(t.settings.model),
           "finite": all(bool(torch.isfinite(p).all()) for p in params),
           "allreduces": calls[0]}  # fmt: skip
    (OUT / f"{mode}-rank{rank}.json").write_text(json.dumps(out))
    dist.barrier()


def main() -> None:
    dist.init_process_group("gloo")
    for mode in MODES:
        run(mode)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

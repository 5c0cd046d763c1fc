"""A straight run against an interrupted and resumed one, on a device: ``python
_device_resume_child.py DEVICE FOLDER``. Prints one line per check and ``equal`` when the resumed
run's parameters, optimizer state (its ``step`` where a straight run keeps it) and RNG-driven
dropout equal the straight run's; exits 1 otherwise.

Runs with deterministic algorithms on (the condition for a bit-identical CUDA resume); the
cuBLAS workspace setting must be in the environment before cuBLAS starts, hence a process of
its own.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from trainbus import Trainer

STEPS, STOP_AT = 10, 4  # 6 batches an epoch: the interrupted run stops mid-epoch


def build(device: str, folder: Path, max_steps: int) -> tuple[Trainer, torch.optim.Optimizer]:
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(48, 6, generator=g), torch.randint(0, 3, (48,), generator=g)
    loader = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True,
                        generator=torch.Generator().manual_seed(11))  # fmt: skip
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                                torch.nn.Linear(32, 3))  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    trainer = Trainer(model, opt, loader, loss_fn=F.cross_entropy, max_steps=max_steps, seed=5,
                      device=device, checkpoint_dir=folder, progress=False,
                      on_signal=None)  # fmt: skip
    return trainer, opt


def main() -> int:
    device, folder = sys.argv[1], Path(sys.argv[2])
    torch.use_deterministic_algorithms(True)
    straight, straight_opt = build(device, folder / "straight", STEPS)
    assert straight.fit_sync().steps == STEPS
    first, _ = build(device, folder / "resumed", STOP_AT)
    assert first.fit_sync().steps == STOP_AT
    resumed, resumed_opt = build(device, folder / "resumed", STEPS)
    assert resumed.fit_sync(resume="latest").steps == STEPS
    ok = True
    a, b = straight.settings.model.state_dict(), resumed.settings.model.state_dict()
    params = all(torch.equal(a[k], b[k]) for k in a)
    print("parameters", "equal" if params else "differ", a[next(iter(a))].device)
    ok &= params
    sa, sb = straight_opt.state_dict()["state"], resumed_opt.state_dict()["state"]
    for k in sa:
        for name, value in sa[k].items():
            other = sb[k][name]
            same = torch.equal(value.cpu(), other.cpu()) and value.device == other.device
            if not same:
                print("optimizer", k, name, value.device, other.device)
            ok &= same
    print("optimizer step on", sa[0]["step"].device, sb[0]["step"].device)
    print("equal" if ok else "DIFFER")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

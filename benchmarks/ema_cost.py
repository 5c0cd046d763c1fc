"""What the EMA callback costs the training thread, next to the training step it follows.

For each model: one training step (forward, backward, SGD step), the EMA's walk of the model's
tensors (``state_dict(keep_vars=True)``, done at every update and swap), one update
(``EMA.update``: the walk plus one ``torch._foreach_lerp_``), and one evaluation's swap in and
out (``swap_in`` + ``swap_out``). Rounds are interleaved (step, walk, update, swap, step, ...)
and the median of each is reported, with the update's share of a step.

Models: the tiny MLP of the tests (32-64-10, batch 32) and a TransformerEncoder (d_model 256,
4 layers, batch 16 x 64 tokens, about 3.2 M parameters).

Run: ``PYTHONPATH=src .venv/bin/python benchmarks/ema_cost.py [--rounds N] [--device cpu]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from trainbus.callbacks import EMA
from trainbus.callbacks._ema import ModelTensors
from trainbus.testing import tiny_model


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def models(device: torch.device) -> list[tuple[str, torch.nn.Module, Callable[[], torch.Tensor]]]:
    torch.manual_seed(0)
    mlp = tiny_model().to(device)
    x, y = torch.randn(32, 32, device=device), torch.randint(0, 10, (32,), device=device)
    layer = torch.nn.TransformerEncoderLayer(256, 4, 1024, batch_first=True, dropout=0.0)
    enc = torch.nn.Sequential(torch.nn.TransformerEncoder(layer, 4), torch.nn.Linear(256, 10))
    enc = enc.to(device)
    tokens = torch.randn(16, 64, 256, device=device)
    labels = torch.randint(0, 10, (16, 64), device=device)
    return [
        ("mlp 32-64-10", mlp, lambda: F.cross_entropy(mlp(x), y)),
        ("encoder 4x256", enc, lambda: F.cross_entropy(enc(tokens).flatten(0, 1),
                                                       labels.flatten())),
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    print(f"torch {torch.__version__}, device {device}, threads {torch.get_num_threads()}, "
          f"{args.rounds} interleaved rounds, medians")  # fmt: skip
    print(f"{'model':<16}{'params':>10}{'step':>12}{'walk':>12}{'update':>12}{'swap in+out':>14}"
          f"{'update/step':>13}")  # fmt: skip
    for name, model, loss in models(device):
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        ema = EMA(0.999)

        def step(model: torch.nn.Module = model, opt: torch.optim.Optimizer = opt,
                 loss: Callable[[], torch.Tensor] = loss) -> None:  # fmt: skip
            loss().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        def swap(ema: EMA = ema, model: torch.nn.Module = model) -> None:
            ema.swap_in(model)
            ema.swap_out()

        for _ in range(3):  # warm up, and the first update (a copy)
            step()
            ema.update(model)
        times: dict[str, list[float]] = {"step": [], "walk": [], "update": [], "swap": []}
        for _ in range(args.rounds):
            times["step"].append(timed(step, device))
            times["walk"].append(timed(lambda m=model: ModelTensors(m), device))
            times["update"].append(timed(lambda e=ema, m=model: e.update(m), device))
            times["swap"].append(timed(swap, device))
        med = {k: statistics.median(v) for k, v in times.items()}
        n = sum(p.numel() for p in model.parameters())
        print(f"{name:<16}{n:>10,}{med['step'] * 1e6:>10.0f}us{med['walk'] * 1e6:>10.0f}us"
              f"{med['update'] * 1e6:>10.0f}us{med['swap'] * 1e6:>12.0f}us"
              f"{med['update'] / med['step']:>12.1%}")  # fmt: skip


if __name__ == "__main__":
    main()

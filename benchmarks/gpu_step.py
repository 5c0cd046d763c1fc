"""trainbus on one GPU against a plain loop, ignite and Lightning: step time, host syncs, resume.

Run on a host with a CUDA GPU (under 3 minutes on one H100/H200)::

    .venv/bin/python benchmarks/gpu_step.py [--rounds 5] [--quick]

Without a GPU it says so and exits 0 (nothing to measure). Workloads:

- ``mlp``: MLP 512-2048-2048-10, batch 256, fp32, AdamW; batches already on the GPU
  (``mlp/device``) and batches on the host, pinned (``mlp/host``: the loop copies them).
- ``transformer``: ``nn.TransformerEncoder``, 8 layers x 1024 (16 heads), batch 16 x 512 tokens,
  bf16 autocast, AdamW.

Variants, timed in interleaved rounds (``_common.interleaved_rounds``, order rotated each
round): ``plain`` (forward, loss, backward, step, zero_grad by hand; ``loss.item()`` every
``log_every`` steps as a logging loop does), ``trainbus`` (``Trainer.fit_sync()``, loop time from
``FitStarted.time`` to ``FitEnded.time``), ``trainbus+throttled`` (a ``StepEnded`` subscriber
through ``ops.throttle_first(0.5)`` reading the loss), ``ignite`` (``Engine`` over the same step
function; returns ``loss.item()`` per step as ignite's supervised trainer does) and
``lightning`` (``Trainer(max_steps=...)`` timed from ``on_train_start`` to ``on_train_end``),
the last two only where installed. Each figure: median ms per step over the rounds, its spread
(min-max over median) and the ratio of medians to ``plain``.

Then host synchronisations per step under ``torch.cuda.set_sync_debug_mode("warn")`` (each
synchronising call warns once; the warnings are counted) for plain and trainbus on both
workloads, and a CUDA resume: 2 epochs with a checkpoint, resumed to 3, against a straight
3-epoch run (``torch.equal`` on the parameters, deterministic algorithms on). Targets printed
beside the figures: the compute-bound (transformer) step <= 1.01x plain; the 1 ms (mlp/device)
step <= ignite's ratio, with the throttled subscriber <= 1.05x; at most one device read per log
window. Writes ``benchmarks/results/gpu_step.json``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Deterministic cuBLAS for the resume check; must be set before CUDA starts.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import RESULTS_DIR, interleaved_rounds, machine_info, median, write_json

LOG_EVERY = 50
Batch = tuple[torch.Tensor, torch.Tensor]


# --------------------------------------------------------------------------- workloads
class Pooled(nn.Module):
    """TransformerEncoder 8 x 1024 over (batch, tokens, 1024) inputs, mean-pooled to 10 logits."""

    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(1024, 16, 4096, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 8, enable_nested_tensor=False)
        self.head = nn.Linear(1024, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.encoder(x).mean(dim=1))
        return out


def build(workload: str, device: torch.device) -> tuple[nn.Module, list[Batch], bool]:
    """A fresh model on ``device`` (the same initial weights every time), its batches (on the
    device, or pinned on the host for ``mlp/host``) and whether it runs in bf16."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if workload.startswith("mlp"):
        model: nn.Module = nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 2048),
                                         nn.ReLU(), nn.Linear(2048, 10))  # fmt: skip
        xs = [torch.randn(256, 512, generator=g) for _ in range(16)]
        ys = [torch.randint(0, 10, (256,), generator=g) for _ in range(16)]
        bf16 = False
    else:
        model = Pooled()
        xs = [torch.randn(16, 512, 1024, generator=g) for _ in range(4)]
        ys = [torch.randint(0, 10, (16,), generator=g) for _ in range(4)]
        bf16 = True
    on_host = workload == "mlp/host"
    batches = [(x.pin_memory(), y.pin_memory()) if on_host else (x.to(device), y.to(device))
               for x, y in zip(xs, ys, strict=True)]  # fmt: skip
    return model.to(device), batches, bf16


def steps_of(batches: list[Batch], n: int) -> list[Batch]:
    return [batches[i % len(batches)] for i in range(n)]


def make_step(
    model: nn.Module, opt: torch.optim.Optimizer, device: torch.device, bf16: bool
) -> Callable[[Batch], torch.Tensor]:
    """One plain training step (the same for the plain loop and ignite)."""

    def step(batch: Batch) -> torch.Tensor:
        x, y = (t.to(device, non_blocking=True) for t in batch)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


# --------------------------------------------------------------------------- variants
def plain(workload: str, n: int, device: torch.device) -> float:
    model, batches, bf16 = build(workload, device)
    step = make_step(model, torch.optim.AdamW(model.parameters(), lr=1e-4), device, bf16)
    data = steps_of(batches, n)
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for i, batch in enumerate(data, 1):
        loss = step(batch)
        if i % LOG_EVERY == 0:
            loss.item()  # a logging loop's read, once per window
    torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) / n * 1e3


def trainbus_run(workload: str, n: int, device: torch.device, throttled: bool = False) -> float:
    from reactivex import operators as ops

    from trainbus import Trainer
    from trainbus import events as ev

    model, batches, bf16 = build(workload, device)
    t = Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-4), steps_of(batches, n),
                loss_fn=F.cross_entropy, max_steps=n, log_every=LOG_EVERY, device=device,
                precision="bf16" if bf16 else "32", progress=False,
                handle_signals=False)  # fmt: skip
    stamps: dict[type, float] = {}
    t.bus.stream(ev.FitStarted, ev.FitEnded).subscribe(
        lambda e: stamps.__setitem__(type(e), e.time)
    )
    if throttled:
        seen: list[float] = []
        t.bus.stream(ev.StepEnded).pipe(ops.throttle_first(0.5)).subscribe(
            lambda e: seen.append(float(e.loss))  # a device read, twice a second
        )
    t.fit_sync()
    # n is a multiple of log_every: the last window's read waited for the device.
    return (stamps[ev.FitEnded] - stamps[ev.FitStarted]) / n * 1e3


def ignite_run(workload: str, n: int, device: torch.device) -> float:
    from ignite.engine import Engine, Events

    model, batches, bf16 = build(workload, device)
    step = make_step(model, torch.optim.AdamW(model.parameters(), lr=1e-4), device, bf16)
    engine = Engine(lambda _e, batch: step(batch).item())  # ignite's trainers return .item()
    stamps: dict[str, float] = {}
    engine.add_event_handler(
        Events.STARTED, lambda _e: stamps.__setitem__("t0", time.perf_counter())
    )
    engine.run(steps_of(batches, n), max_epochs=1)
    torch.cuda.synchronize(device)
    return (time.perf_counter() - stamps["t0"]) / n * 1e3


def lightning_run(workload: str, n: int, device: torch.device) -> float:
    try:
        import lightning.pytorch as pl
    except ImportError:
        import pytorch_lightning as pl

    model, batches, bf16 = build(workload, device)

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch: Batch, _i: int) -> torch.Tensor:
            x, y = batch
            return F.cross_entropy(self.model(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    stamps: dict[str, float] = {}

    class Clock(pl.Callback):
        def on_train_start(self, *_: Any) -> None:
            torch.cuda.synchronize(device)
            stamps["t0"] = time.perf_counter()

        def on_train_end(self, *_: Any) -> None:
            torch.cuda.synchronize(device)
            stamps["t1"] = time.perf_counter()

    trainer = pl.Trainer(max_steps=n, accelerator="gpu", devices=[device.index or 0],
                         precision="bf16-mixed" if bf16 else "32-true", logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[Clock()],
                         log_every_n_steps=LOG_EVERY)  # fmt: skip
    # A DataLoader yielding the batches as they are: a plain list here is read by Lightning as
    # a list of loaders (each batch a "loader"), which failed every run of the first GPU run.
    loader = torch.utils.data.DataLoader(steps_of(batches, n), batch_size=None)
    trainer.fit(Module(), train_dataloaders=loader)
    return (stamps["t1"] - stamps["t0"]) / n * 1e3


def guarded(name: str, run: Callable[[], float]) -> Callable[[], float]:
    """``fit_sync``, with a failure reported once and measured as NaN (a third-party trainer that
    breaks on this host must not cost the other figures)."""
    failed: list[str] = []

    def call() -> float:
        if failed:
            return math.nan
        try:
            return run()
        except Exception as exc:
            failed.append(f"{type(exc).__name__}: {exc}")
            print(f"{name} failed, left out: {failed[0][:300]}")
            return math.nan

    return call


def installed(name: str) -> bool:
    import importlib.util

    return any(importlib.util.find_spec(m) is not None for m in name.split("|"))


# --------------------------------------------------------------------------- host syncs
def count_syncs(run: Callable[[], object]) -> int:
    """Synchronising CUDA calls during ``fit_sync()``: sync debug mode warns once per call (on any
    thread); the warnings are counted."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


# --------------------------------------------------------------------------- resume
def resume_check(device: torch.device) -> dict[str, Any]:
    """2 epochs with a checkpoint, resumed to 3, against a straight 3-epoch run."""
    from trainbus import Trainer

    def run(epochs: int, folder: Path | None, resume: str | None) -> tuple[Trainer, Any]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)).to(device)
        g = torch.Generator().manual_seed(2)
        data = [(torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g))
                for _ in range(8)]  # fmt: skip
        t = Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), data,
                    loss_fn=F.cross_entropy, max_epochs=epochs, device=device, seed=0,
                    checkpoint_dir=folder, progress=False, handle_signals=False)  # fmt: skip
        return t, t.fit_sync(resume=resume)

    torch.use_deterministic_algorithms(True)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            straight, _ = run(3, None, None)
            run(2, Path(tmp), None)
            resumed, result = run(3, Path(tmp), "latest")
        pairs = zip(straight.settings.model.parameters(), resumed.settings.model.parameters(),
                    strict=True)  # fmt: skip
        equal = all(torch.equal(a, b) for a, b in pairs)
        return {"reason": result.reason, "steps": result.steps, "equal": equal}
    except Exception as exc:  # reported, not raised: the rest of the figures still count
        return {"reason": "failed", "error": f"{type(exc).__name__}: {exc}", "equal": False}
    finally:
        torch.use_deterministic_algorithms(False)


# --------------------------------------------------------------------------- main
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="fewer steps (a smoke run)")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=150.0,
        help="no new round starts past this many seconds (>= 3 rounds)",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(
            f"gpu_step.py: no CUDA GPU here (torch {torch.__version__}, "
            "torch.cuda.is_available() is False): nothing measured. Run it on a GPU host."
        )
        return 0
    import logging

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="lightning")
    device = torch.device("cuda", torch.cuda.current_device())
    start = time.perf_counter()
    deadline = start + args.budget_s
    # Multiples of LOG_EVERY: each run ends on a window close, whose read waits for the device.
    steps = {"mlp/device": 1000, "mlp/host": 1000, "transformer": 50}
    if args.quick:
        steps = {k: max(LOG_EVERY, v // 10) for k, v in steps.items()}
    extra = {"ignite": installed("ignite"), "lightning": installed("lightning|pytorch_lightning")}
    results: dict[str, Any] = {}
    for workload, n in steps.items():
        variants: dict[str, Callable[[], float]] = {
            "plain": lambda w=workload, n=n: plain(w, n, device),
            "trainbus": lambda w=workload, n=n: trainbus_run(w, n, device),
        }
        if workload != "mlp/host":
            variants["trainbus+throttled"] = lambda w=workload, n=n: trainbus_run(
                w, n, device, throttled=True
            )
            if extra["ignite"]:
                variants["ignite"] = guarded(
                    "ignite", lambda w=workload, n=n: ignite_run(w, n, device)
                )
            if extra["lightning"]:
                variants["lightning"] = guarded(
                    "lightning", lambda w=workload, n=n: lightning_run(w, n, device)
                )
        runs = interleaved_rounds(variants, args.rounds, deadline=deadline)
        base = median(runs["plain"])
        results[workload] = {name: summary(v, base) for name, v in runs.items()}
    syncs = {}
    for workload, n in (("mlp/device", 500), ("transformer", 50)):
        for name, fn in (("plain", plain), ("trainbus", trainbus_run)):
            # Two runs, n and 2n steps: the difference is what the extra windows cost, apart
            # from what a run pays once (start, end).
            short = count_syncs(lambda fn=fn, w=workload, n=n: fn(w, n, device))
            long = count_syncs(lambda fn=fn, w=workload, n=n: fn(w, 2 * n, device))
            syncs[f"{workload} {name}"] = {"syncs": long, "steps": 2 * n,
                                           "per_window": (long - short) / (n / LOG_EVERY),
                                           "per_run": 2 * short - long}  # fmt: skip
    resume = resume_check(device)
    elapsed = time.perf_counter() - start
    report(results, syncs, resume, device, elapsed)
    write_json(RESULTS_DIR / "gpu_step.json",
               {"machine": machine_info(), "gpu": torch.cuda.get_device_name(device),
                "torch": torch.__version__, "cuda": torch.version.cuda, "steps": steps,
                "log_every": LOG_EVERY, "results": results, "syncs": syncs, "resume": resume,
                "elapsed_s": elapsed})  # fmt: skip
    return 0


def summary(values: list[float], base: float) -> dict[str, Any]:
    """Median ms per step, spread (max - min over the median) and ratio to ``base``."""
    med = median(values)
    ok = [v for v in values if not math.isnan(v)]
    spread = (max(ok) - min(ok)) / med if ok else math.nan
    return {"median_ms": med, "spread": spread, "ratio": med / base, "rounds": values}


def report(results: dict[str, Any], syncs: dict[str, Any], resume: dict[str, Any],
           device: torch.device, elapsed: float) -> None:  # fmt: skip
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, "
          f"CUDA {torch.version.cuda}, {elapsed:.0f} s")  # fmt: skip
    print(f"{'workload':<12} {'variant':<19} {'ms/step':>8} {'spread':>7} {'x plain':>8}")
    for workload, variants in results.items():
        for name, r in variants.items():
            print(f"{workload:<12} {name:<19} {r['median_ms']:8.3f} {r['spread']:7.1%} "
                  f"{r['ratio']:8.3f}")  # fmt: skip
    mlp, tf = results["mlp/device"], results["transformer"]
    ignite_ratio = mlp.get("ignite", {}).get("ratio")
    if ignite_ratio is not None and math.isnan(ignite_ratio):
        ignite_ratio = None
    targets = [
        ("transformer trainbus <= 1.01x plain", tf["trainbus"]["ratio"] <= 1.01),
        ("mlp/device trainbus <= ignite's ratio",
         None if ignite_ratio is None else mlp["trainbus"]["ratio"] <= ignite_ratio),
        ("mlp/device trainbus+throttled <= 1.05x", mlp["trainbus+throttled"]["ratio"] <= 1.05),
    ]  # fmt: skip
    for key, s in syncs.items():
        print(
            f"host syncs {key:<22} {s['syncs']:4d} in {s['steps']} steps: "
            f"{s['per_window']:.2f} per {LOG_EVERY}-step window + {s['per_run']} per run"
        )
        if key.endswith("trainbus"):
            targets.append((f"{key}: <= 1 device read per window", s["per_window"] <= 1.0))
    print(f"CUDA resume: {resume}")
    targets.append(("CUDA resume equals a straight run", bool(resume.get("equal"))))
    for text, ok in targets:
        print(
            f"target {text}: {'n/a (not installed)' if ok is None else 'met' if ok else 'MISSED'}"
        )


if __name__ == "__main__":
    sys.exit(main())

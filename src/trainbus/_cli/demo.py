"""``trainbus demo``: the digits MLP with the default kit, a run folder per run."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

__all__ = ["run_demo"]


def _digits_loaders(seed: int, batch_size: int = 64) -> tuple[Any, Any]:
    import torch
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    from sklearn.preprocessing import StandardScaler
    from torch.utils.data import DataLoader, TensorDataset

    x, y = load_digits(return_X_y=True)
    x_train, x_val, y_train, y_val = train_test_split(
        x, y, test_size=0.2, random_state=seed, stratify=y
    )
    scaler = StandardScaler().fit(x_train)  # fitted on the training split only

    def dataset(xs: Any, ys: Any) -> TensorDataset:
        return TensorDataset(
            torch.tensor(scaler.transform(xs), dtype=torch.float32),
            torch.tensor(ys, dtype=torch.long),
        )

    gen = torch.Generator().manual_seed(seed)
    train = DataLoader(
        dataset(x_train, y_train), batch_size=batch_size, shuffle=True, generator=gen
    )
    val = DataLoader(dataset(x_val, y_val), batch_size=256)
    return train, val


def _accuracy(outputs: Any, targets: Any) -> Any:
    return (outputs.argmax(dim=1) == targets).float().mean()


def run_demo(args: argparse.Namespace) -> int:
    """Train the digits MLP with the default kit; return the exit code."""
    import structlog
    import torch
    import torch.nn.functional as F

    from .. import Trainer, seed_everything
    from ..callbacks import (
        Checkpointing,
        CurvePlot,
        EarlyStopping,
        JsonlEventLog,
        MetricsLogger,
        Progress,
    )
    from ..events import Ending

    log = structlog.get_logger("trainbus._cli")
    from .._replay import new_run_dir

    run_dir: Path = args.run_dir or new_run_dir(Path("runs") / "demo")
    seed_everything(args.seed)  # first: the model's initial weights
    train, val = _digits_loaders(args.seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(128, 10)
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    trainer = Trainer(
        model,
        optimizer,
        train,
        loss_fn=F.cross_entropy,
        eval_data=val,
        max_epochs=args.epochs,
        checkpoint_dir=run_dir / "checkpoints",
        seed=args.seed,
        metrics={"acc": _accuracy},
        device="cpu",
        log_every=10,
        progress=False if args.json_logs else None,
        callbacks=[
            # A terminal gets the Trainer's default bar (progress=None); a log gets no bar,
            # JSON logs get progress lines.
            *([Progress(bar=False)] if args.json_logs else []),
            MetricsLogger(every_s=2.0),
            JsonlEventLog(run_dir / "events.jsonl"),
            Checkpointing(every_epochs=5, monitor="val_loss", keep_last=2, keep_best=2),
            EarlyStopping(monitor="val_loss", patience=3),
            CurvePlot(run_dir / "curves.png", title="trainbus demo: digits MLP"),
        ],
    )
    log.info("demo_started", run_dir=str(run_dir), max_epochs=args.epochs, seed=args.seed)
    try:
        result = trainer.fit_sync()
    except KeyboardInterrupt:  # Ctrl-C: after the graceful stop (on_signal="raise"), or aborted
        stopped = trainer.result
        if stopped is not None and stopped.ending is Ending.SIGNAL:
            print(
                f"stopped by Ctrl-C after {stopped.steps} steps; checkpoint: "
                f"{stopped.last_checkpoint}; run folder: {run_dir}",
                file=sys.stderr,
            )
        else:
            print(f"aborted; run folder: {run_dir}", file=sys.stderr)
        return 130
    except Exception as exc:
        log.error("demo_failed", error=repr(exc), run_dir=str(run_dir))
        return 1
    acc = result.eval_metrics.get("val_acc")
    print(f"run folder: {run_dir}")
    print(
        f"ended: {result.ending} after {result.steps} steps ({result.epochs} epochs)"
        + (f" - {result.stop_reason}" if result.stop_reason else "")
    )
    print("final val accuracy: " + (f"{acc:.2%}" if acc is not None else "n/a"))
    return 0 if result.reason in ("completed", "stopped") else 1

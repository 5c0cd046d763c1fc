"""An Optuna trial trained under torchrun with 2 gloo ranks (tests/distributed/test_optuna_ddp.py).

    optuna_worker.py OUT

Rank 0 owns the study (SQLite in OUT) and runs ``study.optimize``; rank 1 runs the same
objective with ``OptunaPruning(None, ...)`` (the trial lives on rank 0). The pruner prunes at
the first report at or after step 6. Each rank writes ``OUT/rank<r>.json``: the steps each
rank trained, its FitResult's ending, whether its ``run()`` raised ``TrialPruned``; rank 0
adds the trial as the storage has it (state, reported steps).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import optuna
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import trainbus
from trainbus import EvalSchedule
from trainbus.integrations.optuna import OptunaPruning

OUT = Path(sys.argv[1])
RANK = int(os.environ["RANK"])
PRUNE_FROM = 6


class FromStep(optuna.pruners.BasePruner):
    """Prunes at the first report at or after ``PRUNE_FROM``."""

    def prune(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> bool:
        step = trial.last_step
        return step is not None and step >= PRUNE_FROM


def objective(trial: optuna.Trial | None) -> float:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 8, generator=g), torch.randint(0, 3, (64,), generator=g)
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    trainer = trainbus.Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True),
        loss_fn=F.cross_entropy,
        eval_data=DataLoader(TensorDataset(x, y), batch_size=16),
        eval_schedule=EvalSchedule(every_steps=2),
        max_steps=40,
        seed=0,
        progress=False,
        on_signal=None,
        callbacks=[OptunaPruning(trial, "val_loss")],
    )
    steps: list[int] = []
    trainer.add_hook("after_optimizer_step", lambda ctx: steps.append(ctx.step))
    out: dict[str, Any] = {"rank": RANK, "raised": None}
    try:
        trainer.fit_sync()
    except optuna.TrialPruned as exc:
        out["raised"] = type(exc).__name__
        raise
    finally:
        result = trainer.result
        assert result is not None
        out.update(steps=steps, result_steps=result.steps, ending=result.ending.value)
        (OUT / f"rank{RANK}.json").write_text(json.dumps(out))
    return float(result.eval_metrics["val_loss"])


def main() -> None:
    if RANK == 0:
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        storage = f"sqlite:///{OUT / 'study.db'}"
        study = optuna.create_study(storage=storage, study_name="ddp", pruner=FromStep())
        study.optimize(objective, n_trials=1)
        (frozen,) = optuna.load_study(study_name="ddp", storage=storage).trials
        stored = {"state": frozen.state.name, "reported": sorted(frozen.intermediate_values)}
        (OUT / "trial.json").write_text(json.dumps(stored))
    else:
        objective(None)


if __name__ == "__main__":
    main()

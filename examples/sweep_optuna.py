"""An Optuna sweep with trainbus as the engine: pruning with no code in the objective.

Four trials of a small MLP, two at a time (``n_jobs=2``), in Optuna's in-memory storage
(with SQLite and ``n_jobs > 1``, Optuna 5.0 may hand one enqueued trial to both threads:
``ValueError: Cannot tell a COMPLETE trial``; docs/sweeps.md shows SQLite with ``n_jobs=1``).
Each trial evaluates every 10 steps; :class:`~trainbus.integrations.optuna.OptunaPruning` reports
``val_loss`` at the trainbus step, asks the study's ``MedianPruner``, and stops a hopeless
trial through the bus at that very step. ``fit_sync()`` then raises ``optuna.TrialPruned`` and the
study stores the trial PRUNED. ``Trainer(seed=)`` gives each trial a data order of its own
(the other thread's draws cannot change it), and ``CheckpointDir(path, skip_final={"pruned"})``
keeps pruned trials from writing a checkpoint nobody will resume.

The first two configurations are good (the pruner's reference), the other two have a learning
rate far too small: they are pruned at their first evaluation.

Run: ``python examples/sweep_optuna.py`` (needs ``pip install 'trainbus[optuna]'``)
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import optuna
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from trainbus import CheckpointDir, EvalSchedule, Trainer
from trainbus.integrations.optuna import OptunaPruning
from trainbus.testing import tiny_loader, tiny_model

optuna.logging.set_verbosity(optuna.logging.WARNING)

RUNS = Path(tempfile.mkdtemp(prefix="sweep_runs-"))  # removed at the end


def loaders() -> tuple[DataLoader[Any], list[Any]]:
    batches = tiny_loader(18, 16)  # one data set: 16 batches to train on, 2 held out
    x, y = (torch.cat(t) for t in zip(*batches[:16], strict=True))
    return DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True), batches[16:]


def objective(trial: optuna.Trial) -> float:
    lr = trial.suggest_float("lr", 1e-5, 1.0, log=True)
    model = tiny_model(seed=0)  # built from its own generator: the same start for every trial
    train, val = loaders()
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=lr),
        train,
        loss_fn=F.cross_entropy,
        eval_data=val,
        eval_schedule=EvalSchedule(every_steps=10),
        max_steps=30,
        seed=trial.number,
        progress=False,
        checkpoint_dir=CheckpointDir(RUNS / f"trial-{trial.number}", skip_final={"pruned"}),
        callbacks=[OptunaPruning(trial, "val_loss")],
    )
    return trainer.fit_sync().eval_metrics["val_loss"]  # a pruned trial raises TrialPruned here


def main() -> None:
    study = optuna.create_study(
        study_name="trainbus-example",
        sampler=optuna.samplers.TPESampler(seed=0),
        pruner=optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=10),
    )  # fmt: skip
    for lr in (0.3, 0.1, 1e-5, 2e-5):
        study.enqueue_trial({"lr": lr})
    study.optimize(objective, n_trials=4, n_jobs=2)
    states = [t.state for t in study.trials]
    pruned = states.count(optuna.trial.TrialState.PRUNED)
    complete = states.count(optuna.trial.TrialState.COMPLETE)
    kept = sorted(p.parent.name for p in RUNS.glob("trial-*/*-final.pt"))
    print(f"optuna sweep: {len(states)} trials, {pruned} pruned, {complete} complete; "
          f"best val_loss {study.best_value:.3f} at lr {study.best_params['lr']:g}; "
          f"final checkpoints of {len(kept)} trials (none of the pruned ones)")  # fmt: skip
    shutil.rmtree(RUNS)


if __name__ == "__main__":
    main()

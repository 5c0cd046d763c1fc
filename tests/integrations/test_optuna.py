"""trainbus.integrations.optuna with Optuna for real: trials end PRUNED in the study's storage
with no code in the objective, at the step the pruner decided, with n_jobs=2, evaluation every
N steps or every epoch, training metrics, and a resumed trial; bad input fails clearly."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from trainbus import CheckpointDir, ConfigError, EvalSchedule, EventBus, MissingExtraError, Trainer
from trainbus import commands as cmd
from trainbus import events as ev
from trainbus.events import Ending
from trainbus.testing import EventRecorder, tiny_loader, tiny_model

optuna = pytest.importorskip("optuna")
from trainbus.integrations.optuna import OptunaPruning, PrunerError  # noqa: E402

optuna.logging.set_verbosity(optuna.logging.WARNING)


def trainer_for(trial: Any, tmp: Path | CheckpointDir | None = None, *, monitor: str = "val_loss",
                model: torch.nn.Module | None = None, train: Any = None,
                **kw: Any) -> Trainer:  # fmt: skip
    model = model if model is not None else tiny_model(seed=trial.number)
    args: dict[str, Any] = dict(
        loss_fn=F.cross_entropy,
        eval_data=tiny_loader(2, seed=1),
        eval_schedule=EvalSchedule(every_steps=4),
        max_steps=24,
        progress=False,
        checkpoint_dir=tmp,
        on_signal=None,
        callbacks=[OptunaPruning(trial, monitor)],
    )
    args.update(kw)
    lr = trial.suggest_float("lr", 1e-3, 1.0, log=True)
    train = train if train is not None else tiny_loader(8)
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=lr), train, **args)


class Prune:
    """A pruner that prunes at the first report at or after ``at`` (deterministic)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def prune(self, study: Any, trial: Any) -> bool:
        step = trial.last_step
        return step is not None and step >= self.at


def study(pruner: Any, tmp_path: Path | None = None) -> Any:
    storage = None if tmp_path is None else f"sqlite:///{tmp_path / 'study.db'}"
    return optuna.create_study(sampler=optuna.samplers.TPESampler(seed=0), pruner=pruner,
                               storage=storage)  # fmt: skip


def pruner_at(at: int) -> Any:
    # A BasePruner subclass around Prune (Optuna calls pruner.prune(study, trial)).
    class _P(optuna.pruners.BasePruner):
        def prune(self, study: Any, trial: Any) -> bool:
            return Prune(at).prune(study, trial)

    return _P()


def test_a_pruned_trial_is_stored_pruned_with_no_code_in_the_objective(tmp_path: Path) -> None:
    stops: dict[int, Any] = {}

    def objective(trial: Any) -> float:
        trainer = trainer_for(trial, tmp_path / f"t{trial.number}")
        stops[trial.number] = trainer
        return trainer.fit_sync().eval_metrics["val_loss"]  # nothing about pruning here

    s = study(pruner_at(8), tmp_path)
    s.optimize(objective, n_trials=2)
    for t in s.get_trials():
        assert t.state == optuna.trial.TrialState.PRUNED
        assert sorted(t.intermediate_values) == [4, 8]  # reported at the trainbus steps
        result = stops[t.number].result
        assert result is not None and result.ending is Ending.PRUNED
        assert result.steps == 8  # stopped at the step the pruner decided, exactly
        assert result.last_checkpoint is not None and result.last_checkpoint.endswith("-final.pt")


def test_an_unpruned_trial_completes_with_its_value(tmp_path: Path) -> None:
    s = study(optuna.pruners.NopPruner(), tmp_path)
    s.optimize(lambda trial: trainer_for(trial).fit_sync().eval_metrics["val_loss"], n_trials=1)
    (t,) = s.get_trials()
    assert t.state == optuna.trial.TrialState.COMPLETE
    assert sorted(t.intermediate_values) == [4, 8, 12, 16, 20, 24]
    assert t.value == pytest.approx(t.intermediate_values[24])


def test_pruned_trials_can_skip_their_final_checkpoint(tmp_path: Path) -> None:
    def objective(trial: Any) -> float:
        trainer = trainer_for(trial, CheckpointDir(tmp_path / "ckpt", skip_final={"pruned"}))
        return trainer.fit_sync().eval_metrics["val_loss"]

    s = study(pruner_at(4))
    s.optimize(objective, n_trials=1)
    assert s.trials[0].state == optuna.trial.TrialState.PRUNED
    assert not (tmp_path / "ckpt").exists()


def test_every_epoch_evaluation_reports_at_epoch_ends() -> None:
    def objective(trial: Any) -> float:
        # 8 batches an epoch, no eval_every: one evaluation per epoch (steps 8, 16, 24).
        return (
            trainer_for(trial, eval_schedule=EvalSchedule(every_steps=None))
            .fit_sync()
            .eval_metrics["val_loss"]
        )

    s = study(pruner_at(16))
    s.optimize(objective, n_trials=1)
    (t,) = s.get_trials()
    assert t.state == optuna.trial.TrialState.PRUNED
    assert sorted(t.intermediate_values) == [8, 16]


def test_a_training_metric_is_reported_at_each_log_window_and_pruned_there() -> None:
    seen: list[Any] = []

    def objective(trial: Any) -> float:
        trainer = trainer_for(trial, monitor="loss", log_every=5, eval_data=None,
                              eval_schedule=EvalSchedule(every_steps=None))  # fmt: skip
        seen.append(EventRecorder(trainer.bus))
        return trainer.fit_sync().train_metrics["loss"]

    s = study(pruner_at(10))
    s.optimize(objective, n_trials=1)
    (t,) = s.get_trials()
    assert t.state == optuna.trial.TrialState.PRUNED
    assert sorted(t.intermediate_values) == [5, 10]
    # The log step is a decision step: the stop decided at step 10 took effect at step 10.
    (end,) = seen[0].of_type(ev.FitEnded)
    assert end.step == 10 and end.ending is Ending.PRUNED


def losses_by_params(n_jobs: int, tmp_path: Path) -> dict[float, tuple[str, dict[int, float]]]:
    class BigSteps(optuna.pruners.BasePruner):
        """Prunes the trials with lr > 0.1 at step 8: a split that does not hang on values."""

        def prune(self, study: Any, trial: Any) -> bool:
            return trial.params["lr"] > 0.1 and (trial.last_step or 0) >= 8

    def objective(trial: Any) -> float:
        # A shuffling DataLoader with no generator of its own: with seed= its order is the
        # run's own, whatever the other trial's thread draws meanwhile.
        data = TensorDataset(*(torch.cat(t) for t in zip(*tiny_loader(8, 16), strict=True)))
        trainer = trainer_for(trial, seed=7, model=tiny_model(seed=0),
                              train=DataLoader(data, batch_size=16, shuffle=True))  # fmt: skip
        return trainer.fit_sync().eval_metrics["val_loss"]

    # In memory: with SQLite and n_jobs=2, Optuna 5.0 may give one enqueued trial to both
    # threads ("Cannot tell a COMPLETE trial"), a race of its own.
    s = study(BigSteps())
    for lr in (0.001, 0.01, 0.05, 0.2, 0.5, 1.0):
        s.enqueue_trial({"lr": lr})
    s.optimize(objective, n_trials=6, n_jobs=n_jobs)
    return {t.params["lr"]: (t.state.name, dict(t.intermediate_values)) for t in s.trials}


def test_n_jobs_2_gives_the_trials_of_n_jobs_1(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    one = losses_by_params(1, tmp_path / "a")
    two = losses_by_params(2, tmp_path / "b")
    assert two == one  # same states, same values at the same steps
    states = {state for state, _ in one.values()}
    assert states == {"PRUNED", "COMPLETE"}, one  # the threshold splits them


def test_a_trial_interrupted_then_resumed_from_its_checkpoint(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"

    def interrupted(trial: Any) -> float:
        # Preempted at step 10: the run stops with its checkpoint, the objective fails.
        trainer = trainer_for(trial, ckpt, max_steps=24)
        trainer.add_hook("after_optimizer_step", lambda ctx: ctx.step == 10 and trainer.bus.send(
            cmd.StopTraining(reason="preempted")))  # fmt: skip
        trainer.fit_sync()
        raise RuntimeError("preempted")

    s = study(optuna.pruners.NopPruner(), tmp_path)
    s.optimize(interrupted, n_trials=1, catch=(RuntimeError,))
    failed = s.trials[0]
    assert failed.state == optuna.trial.TrialState.FAIL
    assert sorted(failed.intermediate_values) == [4, 8]

    # The same configuration again, resumed from the checkpoint: it reports from there on.
    s.enqueue_trial(failed.params)
    s.optimize(
        lambda trial: trainer_for(trial, ckpt).fit_sync(resume="latest").eval_metrics["val_loss"],
        n_trials=1,
    )
    resumed = s.trials[1]
    assert resumed.state == optuna.trial.TrialState.COMPLETE
    assert sorted(resumed.intermediate_values) == [12, 16, 20, 24]

    # ...with the value of a run that was never interrupted (exact resume).
    fresh = study(optuna.pruners.NopPruner())
    fresh.enqueue_trial(failed.params)
    fresh.optimize(lambda trial: trainer_for(trial).fit_sync().eval_metrics["val_loss"], n_trials=1)
    assert resumed.value == fresh.trials[0].value
    assert resumed.intermediate_values == {k: v for k, v in fresh.trials[0].intermediate_values
                                           .items() if k > 10}  # fmt: skip


# ----------------------------------------------------------------------------- bad input
def test_a_metric_that_never_appears_fails_at_the_first_evaluation_naming_those_that_do() -> None:
    def objective(trial: Any) -> float:
        return (
            trainer_for(trial, monitor="val_los", log_every=4).fit_sync().eval_metrics["val_loss"]
        )

    s = study(optuna.pruners.NopPruner())
    with pytest.raises(ConfigError) as info:
        s.optimize(objective, n_trials=1, catch=())
    message = str(info.value)
    assert "OptunaPruning.monitor='val_los'" in message and "step 4" in message
    assert "val_loss" in message and "loss" in message  # the metrics that exist
    assert s.trials[0].state == optuna.trial.TrialState.FAIL


def test_a_metric_logged_after_the_first_evaluation_is_not_taken_for_missing() -> None:
    """``ctx.log`` values first come with a log window; one closing after the first
    evaluation (``log_every > eval_every``) still counts: the trial reports and completes."""

    def objective(trial: Any) -> float:
        trainer = trainer_for(
            trial, monitor="train_acc", eval_schedule=EvalSchedule(every_steps=2), log_every=4
        )
        trainer.add_hook("after_optimizer_step", lambda ctx: ctx.log("train_acc", 0.5))
        return trainer.fit_sync().eval_metrics["val_loss"]

    s = study(optuna.pruners.NopPruner())
    s.optimize(objective, n_trials=1, catch=())
    trial = s.trials[0]
    assert trial.state == optuna.trial.TrialState.COMPLETE
    assert sorted(trial.intermediate_values) == [4, 8, 12, 16, 20, 24]


def test_a_metric_that_never_appears_in_a_run_without_evaluations_fails_at_its_end() -> None:
    """No evaluation, no log window carrying ``monitor``: nothing could ever be reported, so
    the trial fails when the run ends instead of completing as if pruning had been on."""

    def objective(trial: Any) -> float:
        result = trainer_for(
            trial, eval_data=None, eval_schedule=EvalSchedule(every_steps=None)
        ).fit_sync()
        return result.eval_metrics.get("loss", 0.0)

    s = study(optuna.pruners.NopPruner())
    with pytest.raises(ConfigError, match=r"OptunaPruning\.monitor='val_loss'.*the whole run"):
        s.optimize(objective, n_trials=1, catch=())
    assert s.trials[0].state == optuna.trial.TrialState.FAIL


def test_a_pruner_that_raises_fails_the_trial_clearly() -> None:
    class Broken(optuna.pruners.BasePruner):
        def prune(self, study: Any, trial: Any) -> bool:
            raise ZeroDivisionError("bad pruner")

    s = study(Broken())
    with pytest.raises(PrunerError, match=r"reporting val_loss=.* at step 4 .*ZeroDivisionError"):
        s.optimize(lambda trial: trainer_for(trial).fit_sync().eval_metrics["val_loss"], n_trials=1)
    assert s.trials[0].state == optuna.trial.TrialState.FAIL


@pytest.mark.parametrize("trial", [None, "trial", object()])
def test_not_an_optuna_trial_is_refused(trial: object) -> None:
    with pytest.raises(ConfigError, match=r"trial.*an optuna\.Trial"):
        OptunaPruning(trial)


@pytest.mark.parametrize("rank", [None, "0"])
def test_no_trial_is_refused_on_rank_0(monkeypatch: pytest.MonkeyPatch, rank: str | None) -> None:
    if rank is None:
        monkeypatch.delenv("RANK", raising=False)
    else:
        monkeypatch.setenv("RANK", rank)
    with pytest.raises(ConfigError, match=r"None only on the ranks other than 0"):
        OptunaPruning(None)


def test_no_trial_on_another_rank_is_accepted_and_its_run_returns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Rank 1 of a torchrun job: the trial lives on rank 0, where the callback decides; here
    # its subscribers do not run, and the end of the run neither prunes nor calls the metric
    # missing (it was never looked for on this rank).
    monkeypatch.setenv("RANK", "1")
    callback = OptunaPruning(None, "val_loss")
    monkeypatch.delenv("RANK")
    model = tiny_model()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_loader(4),
                      loss_fn=F.cross_entropy, max_steps=4, progress=False,
                      on_signal=None, bus=EventBus(rank=1),
                      callbacks=[callback])  # fmt: skip
    result = trainer.fit_sync()
    assert result.ending is Ending.COMPLETED and callback.pruned_at is None


def test_a_bad_monitor_is_refused() -> None:
    s = study(optuna.pruners.NopPruner())
    with pytest.raises(ConfigError, match="monitor"):
        OptunaPruning(s.ask(), "")


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@pytest.mark.parametrize("budget", [0.0, -5.0])
def test_a_zero_or_negative_budget_cancels_the_fit_and_the_objective_goes_on(
    budget: float, backend: str
) -> None:
    seen: list[Any] = []

    def objective(trial: Any) -> float:
        trainer = trainer_for(trial)

        async def within_budget() -> None:
            with anyio.move_on_after(budget) as scope:  # "the time left" of a study's budget
                await trainer.fit()
            seen.append(scope.cancelled_caught)

        anyio.run(within_budget, backend=backend)
        result = trainer.result
        if result is None or result.ending is Ending.CANCELLED:  # never started, or cut short
            raise optuna.TrialPruned(f"no time left (budget {budget} s)")
        return result.eval_metrics["val_loss"]

    s = study(optuna.pruners.NopPruner())
    s.optimize(objective, n_trials=2)
    assert seen == [True, True]  # the cancellation, as anyio expects: no crash, no result
    assert [t.state for t in s.trials] == [optuna.trial.TrialState.PRUNED] * 2


def test_without_optuna_the_error_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "optuna", None)  # `import optuna` raises ImportError
    with pytest.raises(MissingExtraError, match=r"pip install 'trainbus\[optuna\]'"):
        OptunaPruning(object())

"""Resume from a checkpoint written at an evaluation step, as a user's program meets it.

A step's checkpoint holds the state after that step's evaluation (docs/reliability.md): a run
resumed from it starts after the evaluation, never repeats it, and ends exactly as the run that
was not interrupted (parameters, optimizer state, the evaluations, checkpoints, early-stopping
decision and ``FitEnded`` after the checkpoint's step). Evaluation never moves the training's
random generators, and a step is evaluated once however many cadences ask for it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from trainbus import EvalSchedule, PerEpoch, Trainer
from trainbus import commands as cmd
from trainbus import events as ev
from trainbus.callbacks import Checkpointing, EarlyStopping
from trainbus.checkpoint import read_checkpoint
from trainbus.testing import EventRecorder

_X = torch.randn(64, 4, generator=torch.Generator().manual_seed(3))
_Y = (_X[:, 0] > 0).long()


class _Stream(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    """Training data of unknown length: the epoch's end is found by a fetch that comes up
    empty, after the last step's evaluation."""

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for i in range(0, 64, 8):
            yield _X[i : i + 8], _Y[i : i + 8]


def _trainer(
    folder: Path,
    *,
    eval_shuffle: bool = False,
    stream: bool = False,
    callbacks: list[Any] | None = None,
    eval_data: bool = True,
    **options: Any,
) -> tuple[Trainer, nn.Module, EventRecorder]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 2))
    train: Any = (
        _Stream() if stream else DataLoader(TensorDataset(_X, _Y), batch_size=8, shuffle=True)
    )
    val = DataLoader(TensorDataset(_X[:24], _Y[:24]), batch_size=8, shuffle=eval_shuffle)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    options.setdefault("max_steps", 8)
    trainer = Trainer(
        model, optimizer, train, loss_fn=nn.functional.cross_entropy,
        eval_data=val if eval_data else None, checkpoint_dir=folder,
        callbacks=[Checkpointing(every_steps=4)] if callbacks is None else callbacks, **options,
    )  # fmt: skip
    return trainer, model, EventRecorder(trainer.bus)


def _same_weights(a: nn.Module, b: nn.Module) -> None:
    for (name, x), y in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(x, y), name


def _same_optimizer(a: Trainer, b: Trainer) -> None:
    sa, sb = a.settings.optimizer.state_dict()["state"], b.settings.optimizer.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for key in sa:
        for name in sa[key]:
            assert torch.equal(torch.as_tensor(sa[key][name]), torch.as_tensor(sb[key][name]))


def _after(rec: EventRecorder, step: int) -> dict[str, Any]:
    """What a run published after ``step``: its evaluations, checkpoints and end."""
    return {
        "evaluations": [(e.step, e.triggers, dict(e.metrics))
                        for e in rec.of_type(ev.EvaluationEnded) if e.step > step],
        "saved": [(e.step, e.tag, Path(e.path).name)
                  for e in rec.of_type(ev.CheckpointSaved) if e.step > step],
        "stopped": [e.command.reason for e in rec.of_type(ev.CommandApplied)
                    if isinstance(e.command, cmd.StopTraining) and e.step > step],
        "end": [(e.step, e.epoch, e.reason, e.stop_reason) for e in rec.of_type(ev.FitEnded)],
    }  # fmt: skip


@pytest.mark.parametrize("eval_shuffle", [False, True], ids=["eval-in-order", "eval-shuffled"])
def test_a_checkpoint_written_at_an_evaluation_step_resumes_exactly(
    tmp_path: Path, eval_shuffle: bool
) -> None:
    """8 steps, an evaluation and a save every 4, dropout, a DataLoader to evaluate on: the
    run resumed from step 4's file does not evaluate step 4 again and ends as the run that
    went through."""
    whole, model, rec = _trainer(
        tmp_path / "whole", eval_shuffle=eval_shuffle, eval_schedule=EvalSchedule(every_steps=4)
    )
    whole.fit_sync()
    assert [e.step for e in rec.of_type(ev.EvaluationEnded)] == [4, 8]
    saved = {e.step: e for e in rec.of_type(ev.CheckpointSaved)}
    # The step's checkpoint was written after the step's evaluation and carries its metrics.
    assert dict(saved[4].metrics) == dict(rec.of_type(ev.EvaluationEnded)[0].metrics)

    resumed, again, rec2 = _trainer(tmp_path / "resumed", eval_shuffle=eval_shuffle,
                                    eval_schedule=EvalSchedule(every_steps=4))  # fmt: skip
    resumed.fit_sync(resume=saved[4].path)
    assert [e.step for e in rec2.of_type(ev.EvaluationEnded)] == [8]
    _same_weights(model, again)
    _same_optimizer(whole, resumed)
    assert _after(rec2, 4) == _after(rec, 4)


@pytest.mark.parametrize("every", [2, 4])
def test_early_stopping_and_keep_best_come_out_the_same_from_every_checkpoint(
    tmp_path: Path, every: int
) -> None:
    """EarlyStopping's patience and Checkpointing's best tracking saved with each checkpoint:
    resumed from any file the run wrote, the same evaluations, the same best and step files,
    the same stop at the same step."""

    def kit() -> list[Any]:
        return [Checkpointing(every_steps=every, monitor="val_loss", keep_best=20),
                EarlyStopping("val_loss", patience=2, min_delta=0.02)]  # fmt: skip

    whole, model, rec = _trainer(
        tmp_path / "whole",
        eval_schedule=EvalSchedule(every_steps=2),
        max_steps=40,
        eval_shuffle=True,
        callbacks=kit(),
    )
    whole.fit_sync()
    assert whole.result is not None and whole.result.reason == "stopped"  # early stopping fired
    stopped_at = whole.result.steps
    written = [e for e in rec.of_type(ev.CheckpointSaved) if e.tag != "final"]
    assert any(e.tag == "best" for e in written) and any(e.tag is None for e in written)
    # Files written at the stopping step too: resumed from them, the run stops at once.
    assert any(e.step == stopped_at for e in written)
    for saved in written:
        folder = tmp_path / f"from-{saved.step}-{saved.tag}"
        resumed, again, rec2 = _trainer(
            folder,
            eval_schedule=EvalSchedule(every_steps=2),
            max_steps=40,
            eval_shuffle=True,
            callbacks=kit(),
        )
        resumed.fit_sync(resume=saved.path)
        _same_weights(model, again)
        _same_optimizer(whole, resumed)
        assert _after(rec2, saved.step) == _after(rec, saved.step), saved.path


def test_a_save_at_the_last_step_of_an_epoch_resumes_after_its_end_work(tmp_path: Path) -> None:
    """The step that ends an epoch (8 batches) is evaluated (steps and epoch at once), steps an
    epoch scheduler and saves after both: the resumed run starts the next epoch with the same
    learning rate and evaluates nothing twice."""
    whole, model, rec = _epoch_scheduled(tmp_path / "whole")
    whole.fit_sync()
    ended = rec.of_type(ev.EvaluationEnded)
    assert [(e.step, e.triggers) for e in ended] == [
        (4, ("steps",)), (8, ("steps", "epoch")), (12, ("steps",)), (16, ("steps", "epoch", "end"))
    ]  # fmt: skip
    at_8 = next(e for e in rec.of_type(ev.CheckpointSaved) if e.step == 8)
    resumed, again, rec2 = _epoch_scheduled(tmp_path / "resumed")
    resumed.fit_sync(resume=at_8.path)
    assert [e.step for e in rec2.of_type(ev.EvaluationEnded)] == [12, 16]
    lr = [t.settings.optimizer.param_groups[0]["lr"] for t in (whole, resumed)]
    assert lr[0] == lr[1] == 0.05 * 0.5**2
    _same_weights(model, again)
    _same_optimizer(whole, resumed)
    assert _after(rec2, 8) == _after(rec, 8)


def _epoch_scheduled(folder: Path, **options: Any) -> tuple[Trainer, nn.Module, EventRecorder]:
    """Two epochs of 8 steps, an evaluation and a save every 4, an epoch scheduler."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 2))
    train = DataLoader(TensorDataset(_X, _Y), batch_size=8, shuffle=True)
    val = DataLoader(TensorDataset(_X[:24], _Y[:24]), batch_size=8, shuffle=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    trainer = Trainer(
        model,
        optimizer,
        train,
        loss_fn=nn.functional.cross_entropy,
        eval_data=val,
        eval_schedule=EvalSchedule(every_steps=4),
        max_epochs=2,
        checkpoint_dir=folder,
        scheduler=PerEpoch(scheduler),
        callbacks=[Checkpointing(every_steps=4)],
        **options,
    )
    return trainer, model, EventRecorder(trainer.bus)


def test_data_of_unknown_length_does_not_evaluate_the_last_step_twice(tmp_path: Path) -> None:
    """An iterable dataset's epoch end is found after its last step was evaluated: the epoch's
    evaluation is that one, also in a run resumed from the step's checkpoint."""
    whole, model, rec = _trainer(
        tmp_path / "whole",
        stream=True,
        eval_schedule=EvalSchedule(every_steps=4),
        max_steps=None,
        max_epochs=2,
    )
    whole.fit_sync()
    assert [e.step for e in rec.of_type(ev.EvaluationEnded)] == [4, 8, 12, 16]
    at_8 = next(e for e in rec.of_type(ev.CheckpointSaved) if e.step == 8)
    resumed, again, rec2 = _trainer(
        tmp_path / "resumed",
        stream=True,
        eval_schedule=EvalSchedule(every_steps=4),
        max_steps=None,
        max_epochs=2,
    )
    resumed.fit_sync(resume=at_8.path)
    assert [e.step for e in rec2.of_type(ev.EvaluationEnded)] == [12, 16]
    _same_weights(model, again)
    assert _after(rec2, 8) == _after(rec, 8)


def test_evaluation_never_moves_the_training_generators(tmp_path: Path) -> None:
    """Dropout and a shuffled training loader draw from torch's generator; evaluating on a
    shuffled DataLoader every 2 steps trains exactly as the same run without evaluation."""
    with_eval, a, _ = _trainer(
        tmp_path / "a", eval_schedule=EvalSchedule(every_steps=2), eval_shuffle=True, callbacks=[]
    )
    with_eval.fit_sync()
    without, b, _ = _trainer(tmp_path / "b", eval_data=False, callbacks=[])
    without.fit_sync()
    _same_weights(a, b)


def test_one_evaluation_per_step_whatever_asks_for_it(tmp_path: Path) -> None:
    """eval_every=4 over an 8-step epoch, two epochs: step 8 ends the epoch and step 16 the
    run; each is evaluated once, the event naming every cadence it stands for. An Evaluate
    command at an evaluated step is answered with that evaluation."""
    trainer, _, rec = _trainer(
        tmp_path,
        eval_schedule=EvalSchedule(every_steps=4),
        max_steps=None,
        max_epochs=2,
        callbacks=[],
    )
    trainer.add_hook(  # sent before the step's poll: applied there
        "after_optimizer_step",
        lambda ctx: trainer.bus.send(cmd.Evaluate()) if ctx.step in (8, 10) else None,
    )
    trainer.fit_sync()
    rounds = rec.of_type(ev.EvaluationRoundEnded)
    assert [(e.step, e.trigger, e.triggers) for e in rounds] == [
        (4, "steps", ("steps",)),
        (8, "steps", ("steps", "epoch")),
        (10, "command", ("command",)),
        (12, "steps", ("steps",)),
        (16, "steps", ("steps", "epoch", "end")),
    ]
    started = rec.of_type(ev.EvaluationStarted)
    assert [e.triggers for e in started] == [e.triggers for e in rounds]
    acks = [a for a in rec.of_type(ev.CommandApplied) if isinstance(a.command, cmd.Evaluate)]
    assert [a.step for a in acks] == [8, 10]
    evaluated = {e.step: e for e in rec.of_type(ev.EvaluationEnded)}
    assert acks[0].result is evaluated[8] and acks[1].result is evaluated[10]


def test_resuming_with_another_configuration_says_what_exactness_is_lost(
    tmp_path: Path,
) -> None:
    """A checkpoint written with eval_every=4 and no accumulation, resumed with eval_every=2
    and accumulation 2: a warning names both and what each costs; the run goes on."""
    whole, _, rec = _trainer(tmp_path / "whole", eval_schedule=EvalSchedule(every_steps=4))
    whole.fit_sync()
    at_4 = next(e for e in rec.of_type(ev.CheckpointSaved) if e.step == 4)
    resumed, _, _ = _trainer(
        tmp_path / "resumed", eval_schedule=EvalSchedule(every_steps=2), accumulate=2
    )
    with structlog.testing.capture_logs() as logs:
        resumed.fit_sync(resume=at_4.path)
    warned = [e for e in logs if e["event"] == "resume_config_differs"]
    assert len(warned) == 1 and warned[0]["log_level"] == "warning"
    differences = warned[0]["differences"]
    assert [d.split(" ")[0] for d in differences] == ["EvalSchedule.every_steps", "accumulate"]
    assert "4" in differences[0] and "2" in differences[0] and "early stopping" in differences[0]
    assert "weights differ" in differences[1]
    assert resumed.result is not None and resumed.result.reason == "completed"

    same, _, _ = _trainer(tmp_path / "same", eval_schedule=EvalSchedule(every_steps=4))
    with structlog.testing.capture_logs() as logs:
        same.fit_sync(resume=at_4.path)
    assert not [e for e in logs if e["event"] == "resume_config_differs"]


def test_a_save_at_the_end_of_an_epoch_of_unknown_length_resumes_at_the_next(
    tmp_path: Path,
) -> None:
    """Data without a length, an epoch scheduler, a save every 4 steps and at each EpochEnded:
    step 8's file is written again at EpochEnded (the epoch's end work changed the state since
    its StepEnded save) and says the epoch's end work ran, so the resumed run starts the next
    epoch without stepping the scheduler or evaluating again, and ends as the uninterrupted
    run."""

    def run(folder: Path, mid: bool = False) -> tuple[Trainer, nn.Module, EventRecorder]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 2))
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
        trainer = Trainer(
            model, optimizer, _Stream(), loss_fn=nn.functional.cross_entropy,
            eval_data=DataLoader(TensorDataset(_X[:24], _Y[:24]), batch_size=8, shuffle=True),
            max_epochs=3, checkpoint_dir=folder, callbacks=[Checkpointing(every_steps=4)],
            scheduler=PerEpoch(torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)),
            )  # fmt: skip
        if mid:  # a tagged save at the epoch's last step, before its end is found
            trainer.add_hook("after_optimizer_step", lambda ctx: trainer.bus.send(
                cmd.SaveCheckpoint(tag="mid")) if ctx.step == 8 else None)  # fmt: skip
        return trainer, model, EventRecorder(trainer.bus)

    whole, model, rec = run(tmp_path / "whole", mid=True)
    whole.fit_sync()
    assert [(e.step, e.triggers) for e in rec.of_type(ev.EvaluationEnded)] == [
        (8, ("epoch",)), (16, ("epoch",)), (24, ("epoch", "end"))
    ]  # fmt: skip
    at_8 = [e for e in rec.of_type(ev.CheckpointSaved) if e.step == 8 and e.tag is None]
    assert len(at_8) == 2 and at_8[0].path == at_8[1].path
    assert read_checkpoint(at_8[1].path).state.closed_epoch == 0
    resumed, again, rec2 = run(tmp_path / "resumed")
    resumed.fit_sync(resume=at_8[1].path)
    assert [e.epoch for e in rec2.of_type(ev.EpochStarted)] == [1, 2]
    assert [e.step for e in rec2.of_type(ev.EvaluationEnded)] == [16, 24]
    lr = [t.settings.optimizer.param_groups[0]["lr"] for t in (whole, resumed)]
    assert lr[0] == lr[1] == 0.05 * 0.5**3
    _same_weights(model, again)
    assert _after(rec2, 8) == _after(rec, 8)

    # The tagged file holds the state before the epoch's end: the resumed run replays the
    # epoch, finds its end, evaluates it and steps the scheduler (before any optimizer step
    # of its own: no torch warning, which this suite would turn into an error).
    (mid,) = [e for e in rec.of_type(ev.CheckpointSaved) if e.tag == "mid"]
    assert read_checkpoint(mid.path).state.closed_epoch == -1
    replayed, again, rec3 = run(tmp_path / "replayed")
    replayed.fit_sync(resume=mid.path)
    assert [e.step for e in rec3.of_type(ev.EvaluationEnded)] == [8, 16, 24]
    _same_weights(model, again)
    assert _after(rec3, 8) == _after(rec, 8)


def test_resuming_past_this_runs_end_says_nothing_is_left_to_train(tmp_path: Path) -> None:
    """A checkpoint at step 8 resumed with max_steps=5: the run trains nothing, and says so."""
    import torch.nn.functional as F
    from structlog.testing import capture_logs

    from trainbus.testing import tiny_loader, tiny_model

    def trainer(max_steps: int) -> Trainer:
        model = tiny_model()
        return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_loader(8),
                       loss_fn=F.cross_entropy, max_steps=max_steps, checkpoint_dir=tmp_path,
                       progress=False)  # fmt: skip

    assert trainer(8).fit_sync().steps == 8
    with capture_logs() as logs:
        result = trainer(5).fit_sync(resume="latest")
    assert result.steps == 8
    (said,) = [x for x in logs if x["event"] == "resume_past_the_end"]
    assert (said["step"], said["max_steps"], said["log_level"]) == (8, 5, "warning")
    assert "raise max_steps" in said["action"]

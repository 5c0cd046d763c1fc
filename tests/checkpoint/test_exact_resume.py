"""Exact resume: an interrupted run, resumed, ends bit-identical to an uninterrupted one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import structlog
import torch
import torch.nn.functional as F
from reactivex import operators as ops

import trainbus
from trainbus import CheckpointError, ConfigError, EventBus, Trainer
from trainbus import commands as cmd
from trainbus import events as ev
from trainbus.callbacks import Checkpointing, EarlyStopping, ReduceLROnPlateau
from trainbus.checkpoint import CheckpointStore, read_checkpoint
from trainbus.checkpoint._store import TEMP_SUFFIX
from trainbus.testing import EventRecorder, tiny_loader, tiny_model

from ._resume_child import KILLED_EPOCHS, build

CHILD = Path(__file__).with_name("_resume_child.py")
SRC = str(Path(trainbus.__file__).resolve().parents[1])
BARRIERS = (ev.StepEnded, ev.EvaluationEnded, ev.EpochEnded)


def _params(trainer: Trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.settings.model.parameters()]


def _stop_at(trainer: Trainer, step: int) -> None:
    # A pipeline decides the stop; StepEnded is a barrier in the interrupted runs, so the stop
    # lands at exactly that step.
    bus = trainer.bus
    bus.stream(ev.StepEnded).pipe(
        ops.filter(lambda e: e.step == step),
        ops.map(lambda _: cmd.StopTraining(reason=f"interrupted at {step}")),
    ).subscribe(bus.commands, name="interrupt")


@pytest.mark.parametrize("generator", [True, False], ids=["generator", "global-rng"])
def test_interrupted_mid_epoch_and_mid_accumulation_resumes_bit_identical(
    tmp_path: Path, generator: bool
) -> None:
    reference = build(None, generator=generator)
    full = reference.fit_sync()
    assert full.steps == 12  # 3 epochs of 4 steps: steps of 3, 3, 3 and 1 batches

    # 2: mid-epoch; 4: the epoch's last (1-batch) step; 5 and 7: mid-epoch of a resumed run.
    for k in (2, 4, 5, 7):
        run = build(tmp_path, generator=generator, bus=EventBus(barriers=BARRIERS))
        _stop_at(run, k)
        result = run.fit_sync(resume="latest")
        assert (result.reason, result.steps) == ("stopped", k)
    last = build(tmp_path, generator=generator)
    fetched: list[int] = []
    last.add_hook("batch", lambda ctx: fetched.append(ctx.batch_index))
    result = last.fit_sync(resume="latest")
    assert (result.reason, result.steps) == ("completed", 12)
    # Saved after step 7 = batch 9 of epoch 1: the resumed epoch goes on with its batch 9.
    assert fetched[:2] == [9, 0]
    final = read_checkpoint(result.last_checkpoint or "")
    assert final.state.samples_seen == 3 * 38
    for got, want in zip(_params(last), _params(reference), strict=True):
        assert torch.equal(got, want)


def test_without_the_data_order_a_shuffled_resume_diverges(tmp_path: Path) -> None:
    # The control: the same interruption resumed by a fresh iterator (a loader whose state is
    # not replayed) differs, so the test above can fail.
    reference = build(None, generator=True)
    reference.fit_sync()
    first = build(tmp_path, generator=True, bus=EventBus(barriers=BARRIERS))
    _stop_at(first, 2)
    first.fit_sync()
    second = build(None, generator=True)
    path = tmp_path / "step-00000002-final.pt"
    checkpoint = read_checkpoint(path)
    checkpoint.restore(model=second.settings.model, optimizer=second.settings.optimizer,
                       scheduler=second.settings.scheduler, scaler=None)  # fmt: skip
    # Start a fresh run from the restored weights: the epoch order is drawn anew.
    second.fit_sync()
    assert any(
        not torch.equal(a, b) for a, b in zip(_params(second), _params(reference), strict=True)
    )


# Where each child SIGKILLs itself (optimizer step, moment in it): three kinds of moment, at
# the start, middle and end of epochs, mid-step only where a step has a second batch.
KILLS = [(2, "mid-step"), (3, "mid-write"), (4, "after-step"), (6, "mid-write"),
         (9, "mid-step"), (12, "after-step"), (13, "mid-write"), (18, "mid-step")]  # fmt: skip


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "fork"), reason="the training children are forked")
def test_sigkill_at_chosen_moments_then_resume_is_bit_identical(tmp_path: Path) -> None:
    reference = build(None, generator=True, max_epochs=KILLED_EPOCHS)
    reference.fit_sync()
    out, folder = tmp_path / "final.pt", tmp_path / "ck"
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    zygote = subprocess.Popen([sys.executable, str(CHILD), str(folder), str(out)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env=env)  # fmt: skip
    assert zygote.stdin is not None and zygote.stdout is not None

    def go(line: str) -> int:
        assert zygote.stdin is not None and zygote.stdout is not None
        zygote.stdin.write(line + "\n")
        zygote.stdin.flush()
        assert zygote.stdout.readline().split()[0] == "child"
        word, _, status = zygote.stdout.readline().split()
        assert word == "reaped"
        return int(status)

    try:
        for step, where in KILLS:
            status = go(f"go {step} {where}")
            # Each child died where it was told to, not by finishing first.
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (step, where)
            names = sorted(p.name for p in folder.iterdir())
            left = [n for n in names if n.endswith(TEMP_SUFFIX)]
            # A kill inside the write leaves its temp file (removed by the next start), and only
            # that kill does; at every kill point the newest complete checkpoint is the step
            # before the killed one, so the next child redoes the killed step from there.
            assert len(left) == (where == "mid-write"), (step, where, names)
            latest = CheckpointStore(folder, clean=False).latest_valid()
            assert latest is not None and read_checkpoint(latest).state.step == step - 1
        assert go("go") == 0
    finally:
        zygote.stdin.close()
        zygote.wait(timeout=60)
        zygote.stdout.close()
    got = torch.load(out, weights_only=True)
    for a, b in zip(got, _params(reference), strict=True):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------- callback state


class _Script:
    """An evaluation metric that returns scripted values, one per evaluation."""

    def __init__(self, values: list[float]) -> None:
        self.values = list(values)

    def __call__(self, outputs: Any, targets: Any) -> float:
        return self.values.pop(0)


def _scored(values: list[float], callbacks: list[Any], tmp_path: Path, epochs: int) -> Trainer:
    model = tiny_model(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return Trainer(model, opt, tiny_loader(2, 4), loss_fn=F.cross_entropy,
                   eval_data=tiny_loader(1, 4), metrics={"score": _Script(values)},
                   max_epochs=epochs, checkpoint_dir=tmp_path, callbacks=callbacks,
                   on_signal=None)  # fmt: skip


def _callbacks() -> list[Any]:
    return [
        Checkpointing(every_epochs=1, monitor="val_score"),
        EarlyStopping("val_score", patience=3),
        ReduceLROnPlateau("val_score", patience=1, factor=0.5, max_reductions=1),
    ]


def test_callback_states_survive_a_resume(tmp_path: Path) -> None:
    first = _scored([1.0, 2.0, 2.0], _callbacks(), tmp_path, epochs=3)
    rec1 = EventRecorder(first.bus)
    assert first.fit_sync().reason == "completed"
    assert [s.tag for s in rec1.of_type(ev.CheckpointSaved)] == ["best", None, None, None]
    reductions = [a for a in rec1.of_type(ev.CommandApplied)
                  if isinstance(a.command, cmd.ScaleLearningRate)]  # fmt: skip
    assert len(reductions) == 1  # after the second evaluation; max_reductions=1 is spent
    saved = read_checkpoint(first.result.last_checkpoint if first.result else "")
    assert saved.callbacks["Checkpointing"]["best"] == 1.0
    assert saved.callbacks["EarlyStopping"]["bad"] == 2

    cbs = _callbacks()
    second = _scored([1.5, 2.0, 2.0], cbs, tmp_path, epochs=6)
    rec2 = EventRecorder(second.bus)
    result = second.fit_sync(resume="latest")
    # 1.5 is no better than the restored best 1.0: not tagged best; the restored patience
    # counter reaches 3 at the resumed run's first evaluation; no second LR reduction.
    assert "best" not in [s.tag for s in rec2.of_type(ev.CheckpointSaved)]
    assert result.reason == "stopped" and (result.stop_reason or "").startswith("early stop")
    assert (result.epochs, result.steps) == (4, 8)  # at its first evaluation
    assert not [a for a in rec2.of_type(ev.CommandApplied)
                if isinstance(a.command, cmd.ScaleLearningRate)]  # fmt: skip
    assert cbs[1].state_dict()["bad"] == 3


def test_a_fresh_run_does_not_carry_that_state(tmp_path: Path) -> None:
    # The control for the test above: without the resume, the same scores never stop the run.
    result = _scored([1.5, 2.0, 2.0], _callbacks(), tmp_path, epochs=3).fit_sync()
    assert result.reason == "completed"


def test_a_saved_state_without_its_callback_is_a_warning(tmp_path: Path) -> None:
    first = _scored([1.0], [EarlyStopping("val_score", state_key="stopper")], tmp_path, 1)
    first.fit_sync()
    second = _scored([1.0], [], tmp_path, 2)
    with structlog.testing.capture_logs() as logs:
        assert second.fit_sync(resume="latest").reason == "completed"
    unmatched = [e for e in logs if e["event"] == "callback_state_unmatched"]
    assert [(e["name"], e["log_level"]) for e in unmatched] == [("stopper", "warning")]


def test_two_stateful_callbacks_with_one_key_are_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="state_key") as info:
        _scored([], [EarlyStopping("val_score"), EarlyStopping("val_loss")], tmp_path, 1)
    assert "EarlyStopping" in str(info.value)
    trainer = _scored([], [EarlyStopping("val_score"), EarlyStopping("val_loss", state_key="b")],
                      tmp_path, 1)  # fmt: skip
    assert len(trainer.callbacks) == 2
    with pytest.raises(ConfigError, match="state_key"):
        EarlyStopping(state_key="")


# ---------------------------------------------------------------------------- bad resumes


def _saved(tmp_path: Path) -> Path:
    model = tiny_model(seed=0)
    run = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_loader(2, 4),
                  loss_fn=F.cross_entropy, max_steps=1, checkpoint_dir=tmp_path,
                  on_signal=None)  # fmt: skip
    return Path(run.fit_sync().last_checkpoint or "")


def test_resume_into_another_model_shape_or_optimizer_says_what_differs(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    wide = tiny_model(8, 32, 4)
    trainer = Trainer(wide, torch.optim.SGD(wide.parameters(), lr=0.1), tiny_loader(2, 4),
                      loss_fn=F.cross_entropy, max_steps=2, on_signal=None)  # fmt: skip
    with pytest.raises(CheckpointError, match="shape") as info:
        trainer.fit_sync(resume=path)
    assert str(path) in str(info.value)
    model = tiny_model(seed=0)
    trainer = Trainer(model, torch.optim.Adam(model.parameters()), tiny_loader(2, 4),
                      loss_fn=F.cross_entropy, max_steps=2, on_signal=None)  # fmt: skip
    with pytest.raises(CheckpointError, match="optimizer is SGD in the checkpoint but Adam"):
        trainer.fit_sync(resume=path)


@pytest.mark.parametrize(
    ("resume", "checkpoint_dir"),
    [("missing.pt", None), (5, None), ("latest", None), ("", None)],
    ids=["missing-file", "not-a-path", "latest-without-dir", "empty"],
)
def test_a_bad_resume_argument_is_a_config_error_naming_it(
    tmp_path: Path, resume: Any, checkpoint_dir: Any
) -> None:
    model = tiny_model()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_loader(2, 4),
                      loss_fn=F.cross_entropy, max_steps=1, checkpoint_dir=checkpoint_dir,
                      on_signal=None)  # fmt: skip
    if resume == "missing.pt":
        resume = tmp_path / resume
    with pytest.raises(ConfigError, match="resume"):
        trainer.fit_sync(resume=resume)
    assert trainer.result is None  # nothing ran


def test_checkpoint_dir_under_a_file_is_refused_up_front(tmp_path: Path) -> None:
    (tmp_path / "a_file").write_text("")
    model = tiny_model()
    with pytest.raises(ConfigError, match="checkpoint_dir"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_loader(2, 4),
                max_steps=1, checkpoint_dir=tmp_path / "a_file" / "sub")  # fmt: skip

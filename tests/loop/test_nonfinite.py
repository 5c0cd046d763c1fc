"""Non-finite losses: checked every step, always before a checkpoint, never saved.

Each run has a NaN loss at chosen steps of a run shorter than ``log_every`` (the case that used
to end ``completed`` with NaN weights in ``-final.pt``). The accelerator path (losses read at
the next sync: log step, checkpoint write, end of run) is exercised on the CPU by turning the
guard's per-step read off, which is exactly what it is on CUDA under "raise" / "stop".
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from trainbus import CheckpointError, NonFiniteLossError, StepContext, Trainer
from trainbus import commands as cmd
from trainbus import events as ev
from trainbus._loop import nonfinite
from trainbus.checkpoint import load_checkpoint
from trainbus.testing import EventRecorder, NaNLossAt, tiny_loader, tiny_model


def _trainer(tmp_path: Path, loss_fn: Any, *, max_steps: int = 20, **kwargs: Any) -> Trainer:
    model = tiny_model()
    kwargs.setdefault("log_every", 50)
    # The per-step read is the CPU's (the "mode" fixture adds the accelerator's read at the
    # window close): pinned, so a GPU host tests the same paths.
    kwargs.setdefault("device", "cpu")
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_loader(8, 8),
                   loss_fn=loss_fn, max_steps=max_steps, checkpoint_dir=tmp_path / "ckpt",
                   on_signal=None, **kwargs)  # fmt: skip


def _save_at(trainer: Trainer, *steps: int) -> None:
    def hook(ctx: StepContext) -> None:
        if ctx.step in steps:
            trainer.bus.send(cmd.SaveCheckpoint())

    trainer.add_hook("after_optimizer_step", hook)


def _files(tmp_path: Path) -> list[str]:
    folder = tmp_path / "ckpt"
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def _all_finite(path: Path) -> bool:
    model = tiny_model()
    load_checkpoint(path, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                    scheduler=None, scaler=None, restore_rng=False)  # fmt: skip
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


@pytest.fixture(params=["per_step", "at_sync"])
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Run each test with the CPU's per-step read and with the accelerator's read-at-sync."""
    if request.param == "at_sync":
        init = nonfinite.NonFiniteGuard.__init__

        def lazy(self: nonfinite.NonFiniteGuard, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **kwargs)
            if self.policy != "skip":  # "skip" reads every step on any device
                self.per_step = False

        monkeypatch.setattr(nonfinite.NonFiniteGuard, "__init__", lazy)
    yield request.param


def test_raise_fails_the_run_naming_the_step_in_a_short_run(tmp_path: Path, mode: str) -> None:
    trainer = _trainer(tmp_path, NaNLossAt(3), on_nonfinite="raise")
    rec = EventRecorder(trainer.bus)
    with pytest.raises(NonFiniteLossError, match="at step 3 "):
        trainer.fit_sync()
    assert trainer.result is not None and trainer.result.reason == "failed"
    (ended,) = rec.of_type(ev.FitEnded)
    assert ended.reason == "failed" and isinstance(ended.error, NonFiniteLossError)
    assert _files(tmp_path) == []  # no final checkpoint of the NaN state
    # Per step, the bad update is never applied; at a sync, the run went on until the end.
    assert trainer.result.steps == (2 if mode == "per_step" else 20)


def test_raise_is_found_before_a_checkpoint_write(tmp_path: Path, mode: str) -> None:
    trainer = _trainer(tmp_path, NaNLossAt(3), on_nonfinite="raise")
    _save_at(trainer, 1, 5)
    with pytest.raises(NonFiniteLossError, match=r"at step 3 ") as info:
        trainer.fit_sync()
    assert any(note.endswith("step-00000001.pt") for note in info.value.__notes__), (
        "the error names the last checkpoint written"
    )
    assert _files(tmp_path) == ["step-00000001.pt"]
    assert trainer.result is not None
    assert trainer.result.steps == (2 if mode == "per_step" else 5)


def test_stop_keeps_the_last_good_checkpoint_and_writes_no_bad_state(
    tmp_path: Path, mode: str
) -> None:
    trainer = _trainer(tmp_path, NaNLossAt(3), on_nonfinite="stop")
    _save_at(trainer, 1, 5)
    rec = EventRecorder(trainer.bus)
    result = trainer.fit_sync()
    assert result.reason == "stopped"
    assert result.stop_reason is not None and "non-finite loss at step 3" in result.stop_reason
    assert _files(tmp_path) == ["step-00000001.pt"]
    assert result.last_checkpoint == str(tmp_path / "ckpt" / "step-00000001.pt")
    assert [e.step for e in rec.of_type(ev.CheckpointSaved)] == [1]
    (ended,) = rec.of_type(ev.FitEnded)
    assert ended.reason == "stopped"
    if mode == "at_sync":  # the step-5 save found the NaN: refused, acknowledged, run stopped
        refused = [a for a in rec.of_type(ev.CommandApplied) if a.error is not None]
        assert len(refused) == 1 and isinstance(refused[0].error, CheckpointError)
        assert result.steps == 5
    else:
        assert result.steps == 2


def test_the_last_partial_log_window_is_checked(tmp_path: Path, mode: str) -> None:
    # log_every=8 over 10 steps: the NaN at step 10 is in a window no log step closes.
    trainer = _trainer(tmp_path, NaNLossAt(10), max_steps=10, log_every=8, on_nonfinite="stop")
    result = trainer.fit_sync()
    assert result.reason == "stopped" and "step 10" in (result.stop_reason or "")
    assert _files(tmp_path) == []


def test_a_nan_at_a_log_step_is_found_by_the_window(tmp_path: Path, mode: str) -> None:
    trainer = _trainer(tmp_path, NaNLossAt(6), max_steps=20, log_every=4, on_nonfinite="raise")
    with pytest.raises(NonFiniteLossError, match="at step 6 "):
        trainer.fit_sync()
    assert trainer.result is not None
    assert trainer.result.steps == (5 if mode == "per_step" else 8)  # at_sync: the log step


def test_skip_skips_the_update_counts_it_and_finishes(tmp_path: Path, mode: str) -> None:
    trainer = _trainer(tmp_path, NaNLossAt(3, 7), max_steps=10, log_every=5, on_nonfinite="skip")
    rec = EventRecorder(trainer.bus)
    seen: list[int] = []
    trainer.add_hook("after_optimizer_step", lambda ctx: seen.append(ctx.step))
    result = trainer.fit_sync()
    assert result.reason == "completed" and result.steps == 10
    assert result.skipped_nonfinite == 2
    assert seen == list(range(1, 11))  # the skipped batches made no optimizer step
    assert [e.metrics["skipped_nonfinite"] for e in rec.of_type(ev.MetricsLogged)] == [1.0, 2.0]
    assert [e.step for e in rec.of_type(ev.StepEnded)] == list(range(1, 11))
    assert all(torch.isfinite(e.loss) for e in rec.of_type(ev.StepEnded))
    (final,) = _files(tmp_path)
    assert final == "step-00000010-final.pt" and _all_finite(tmp_path / "ckpt" / final)


def test_skip_gives_up_after_too_many_in_a_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(nonfinite, "MAX_CONSECUTIVE_SKIPS", 4)
    trainer = _trainer(tmp_path, NaNLossAt(*range(2, 100)), on_nonfinite="skip")
    with pytest.raises(NonFiniteLossError, match="4 non-finite losses in a row"):
        trainer.fit_sync()
    assert trainer.result is not None and trainer.result.skipped_nonfinite == 4


def test_no_checkpoint_ever_holds_nonfinite_weights(tmp_path: Path) -> None:
    # "ignore" lets the NaN into the weights; the writer still refuses to save them.
    trainer = _trainer(tmp_path, NaNLossAt(3), max_steps=6, on_nonfinite="ignore")
    _save_at(trainer, 2, 4)
    rec = EventRecorder(trainer.bus)
    result = trainer.fit_sync()
    assert result.reason == "completed"
    assert _files(tmp_path) == ["step-00000002.pt"]
    assert _all_finite(tmp_path / "ckpt" / "step-00000002.pt")
    refused = [a for a in rec.of_type(ev.CommandApplied) if a.error is not None]
    assert len(refused) == 1 and "non-finite values in parameter" in str(refused[0].error)
    assert result.last_checkpoint == str(tmp_path / "ckpt" / "step-00000002.pt")


def test_ignore_runs_to_the_end_with_no_check(tmp_path: Path) -> None:
    result = _trainer(tmp_path, NaNLossAt(2), max_steps=4, on_nonfinite="ignore").fit_sync()
    assert result.reason == "completed" and result.steps == 4 and result.skipped_nonfinite == 0


@pytest.mark.cuda
@pytest.mark.parametrize("policy", ["raise", "stop", "skip"])
def test_cuda_paths(tmp_path: Path, policy: str) -> None:
    model = tiny_model()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_loader(8, 8),
                      loss_fn=NaNLossAt(3), max_steps=10, device="cuda", on_nonfinite=policy,
                      checkpoint_dir=tmp_path / "ckpt", on_signal=None)  # fmt: skip
    if policy == "raise":
        with pytest.raises(NonFiniteLossError, match="at step 3 "):
            trainer.fit_sync()
        assert _files(tmp_path) == []
    elif policy == "stop":
        assert trainer.fit_sync().reason == "stopped" and _files(tmp_path) == []
    else:
        result = trainer.fit_sync()
        assert result.skipped_nonfinite == 1 and result.steps == 10


@pytest.mark.parametrize("kwargs", [{"log_every": 2}, {"accumulate": 2}])
def test_finite_losses_whose_sum_overflows_are_finite(kwargs: dict[str, Any], mode: str) -> None:
    """Each loss finite (float64, 1e308), their sum not: no ``NonFiniteLossError``, no crash
    at the window's close, and every mean (a step's over its micro-batches, the window's loss,
    a metric of the user's) is 1e308: each value is divided before the sum. At sync (CUDA's
    read) a plain mean read inf and failed the run (the first GPU run); the window's loss read
    inf, and a metric's ``math.fsum`` raised ``OverflowError`` at the window's close."""
    model = tiny_model().double()
    data = [(x.double(), y) for x, y in tiny_loader(4, 4)]

    def huge(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(outputs, targets) * 0 + 1e308

    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), data, loss_fn=huge,
                      max_epochs=1, on_signal=None, progress=False,
                      **kwargs)  # fmt: skip
    trainer.add_hook("after_optimizer_step", lambda ctx: ctx.log("huge", 1e308))
    result = trainer.fit_sync()
    assert result.reason == "completed" and result.skipped_nonfinite == 0
    assert result.steps == 4 // kwargs.get("accumulate", 1)
    assert result.train_metrics["loss"] == 1e308
    assert result.train_metrics["huge"] == 1e308


def _custom_trainer(step_fn: Any, **kwargs: Any) -> Trainer:
    model = tiny_model()
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_loader(8, 8),
                   train_step=step_fn, max_steps=5, device="cpu", on_signal=None,
                   progress=False, **kwargs)  # fmt: skip


def _nan_at(bad: int, *, backward: bool) -> Any:
    """A custom step whose loss at step ``bad`` is NaN: the one given to ``ctx.backward`` (its
    returned loss finite), or the one it returns (the one given to ``ctx.backward`` finite)."""

    def step(ctx: Any) -> torch.Tensor:
        x, y = ctx.batch
        loss = torch.nn.functional.cross_entropy(ctx.model(x), y)
        nan = loss * float("nan") if ctx.step + 1 == bad else loss
        ctx.backward(nan if backward else loss)
        ctx.optimizer_step()
        return loss.detach() if backward else nan

    return step


@pytest.mark.parametrize("policy", ["raise", "stop"])
def test_a_non_finite_loss_given_to_ctx_backward_is_found_at_sync_too(
    tmp_path: Path, mode: str, policy: str
) -> None:
    """A custom step gives ``ctx.backward`` a NaN at step 2 and returns a finite loss. Read at
    sync (CUDA, or several ranks), the window keeps what ``ctx.backward`` was given as well:
    before, only the returned loss was read, and the run completed with NaN weights (found by
    a new-user trial)."""
    trainer = _custom_trainer(_nan_at(2, backward=True), on_nonfinite=policy, log_every=50,
                              checkpoint_dir=tmp_path / "ckpt")  # fmt: skip
    if policy == "raise":
        with pytest.raises(NonFiniteLossError, match="at step 2 "):
            trainer.fit_sync()
        return
    result = trainer.fit_sync()
    assert (result.reason, result.stop_reason) == ("stopped", "non-finite loss at step 2 (epoch 0)")
    assert _files(tmp_path) == []  # no final checkpoint of the bad state


def test_skip_with_a_non_finite_returned_loss_neither_stops_nor_skips(mode: str) -> None:
    """Under ``"skip"`` a custom step's update was taken on finite ``ctx.backward`` losses; a
    NaN it returns is logged (the window's loss is NaN) and the run goes on. Before, the
    window's close tripped the guard and stopped the run, but only when a log step came after
    it (``log_every=2`` here; a new-user trial)."""
    trainer = _custom_trainer(_nan_at(2, backward=False), on_nonfinite="skip", log_every=2)
    result = trainer.fit_sync()
    assert (result.reason, result.steps, result.skipped_nonfinite) == ("completed", 5, 0)


@pytest.mark.parametrize("policy", ["raise", "skip", "ignore"])
@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_one_element_loss_of_shape_1_is_a_scalar(policy: str, accumulate: int) -> None:
    """``loss_fn`` returning shape ``(1,)`` (one element, as the docs' "scalar" allows): every
    policy and window reads it as one value, a short last step (5 batches, steps of 2)
    beside means included; the logged loss is the mean of the steps' losses."""
    model = tiny_model()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_loader(5, 4),
                      loss_fn=lambda o, y: torch.nn.functional.cross_entropy(o, y).reshape(1),
                      max_epochs=1, accumulate=accumulate, on_nonfinite=policy, log_every=10,
                      on_signal=None, progress=False)  # fmt: skip
    ended: list[ev.StepEnded] = []
    trainer.bus.stream(ev.StepEnded).subscribe(ended.append)  # "ignore": the window holds them
    result = trainer.fit_sync()
    assert result.reason == "completed"
    losses = [float(e.loss.reshape(())) for e in ended]
    assert len(losses) == result.steps == (5 if accumulate == 1 else 3)
    assert result.train_metrics["loss"] == pytest.approx(sum(losses) / len(losses))

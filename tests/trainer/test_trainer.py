"""The Trainer trains correctly: both loss conventions, accumulation, clipping, schedulers,
evaluation metrics, limits, seeding, precision, demand-driven events and the loss checks."""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from trainbus import (
    EvalSchedule,
    NonFiniteLossError,
    PerEpoch,
    StepContext,
    TrainbusError,
    Trainer,
    TrainingError,
)
from trainbus import commands as cmd
from trainbus import events as ev
from trainbus.testing import EventRecorder, tiny_loader, tiny_model

# ---------------------------------------------------------------------------- helpers


def _params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor], **tol: float) -> bool:
    return all(torch.allclose(x, y, **tol) for x, y in zip(a, b, strict=True))


def _trainer(
    model: torch.nn.Module | None = None,
    data: Any = None,
    *,
    lr: float = 0.1,
    **kwargs: Any,
) -> Trainer:
    model = model if model is not None else tiny_model()
    kwargs.setdefault("on_signal", None)
    kwargs.setdefault("device", "cpu")  # tests compare with CPU copies: same on a GPU host
    if "loss_fn" not in kwargs:
        kwargs["loss_fn"] = F.cross_entropy
    elif kwargs["loss_fn"] is None:
        del kwargs["loss_fn"]
    if "max_steps" not in kwargs and "max_epochs" not in kwargs:
        kwargs["max_steps"] = 2
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    return Trainer(model, optimizer, data if data is not None else tiny_loader(4, 8), **kwargs)


def _send_at(trainer: Trainer, step: int, command: cmd.Command) -> None:
    """Send ``command`` from the training thread after optimizer step ``step``."""

    def hook(ctx: StepContext) -> None:
        if ctx.step == step:
            trainer.bus.send(command)

    trainer.add_hook("after_optimizer_step", hook)


# ---------------------------------------------------------------------------- loss conventions


def test_loss_fn_mode_trains_like_plain_pytorch() -> None:
    data = tiny_loader(3, 8)
    ref = tiny_model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x, y in data:
        opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        opt.step()

    model = tiny_model()
    before = _params(model)
    trainer = _trainer(model, data, max_steps=3)
    rec = EventRecorder(trainer.bus)
    result = trainer.fit_sync()
    assert result.reason == "completed"
    assert result.steps == 3
    assert not _same(_params(model), before)
    assert _same(_params(model), _params(ref), atol=1e-6)
    losses = [float(e.loss) for e in rec.of_type(ev.StepEnded)]
    with torch.no_grad():
        expected = F.cross_entropy(tiny_model()(data[0][0]), data[0][1]).item()
    assert losses[0] == pytest.approx(expected, rel=1e-5)


class _LossModel(torch.nn.Module):
    """Computes its own loss from a batch; returns it in one of the HF-style shapes."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.net = tiny_model()
        self.mode = mode
        self.calls: list[str] = []

    def forward(self, batch: Any = None, *, x: Any = None, y: Any = None) -> Any:
        if batch is not None:
            self.calls.append("positional")
            x, y = batch
        else:
            self.calls.append("kwargs")
        logits = self.net(x)
        loss = F.cross_entropy(logits, y)
        if self.mode == "tensor":
            return loss
        if self.mode in ("dict", "kwargs"):
            return {"loss": loss, "logits": logits}
        return SimpleNamespace(loss=loss, logits=logits)


@pytest.mark.parametrize("mode", ["tensor", "dict", "object", "kwargs"])
def test_model_returns_loss_mode(mode: str) -> None:
    data: list[Any] = tiny_loader(3, 8)
    if mode == "kwargs":
        data = [{"x": x, "y": y} for x, y in data]
    model = _LossModel(mode)
    before = _params(model)
    trainer = _trainer(model, data, loss_fn=None, max_steps=3)
    rec = EventRecorder(trainer.bus)
    result = trainer.fit_sync()
    assert result.reason == "completed" and result.steps == 3
    assert set(model.calls) == {"kwargs" if mode == "kwargs" else "positional"}
    assert not _same(_params(model), before)
    steps = rec.of_type(ev.StepEnded)
    assert [e.step for e in steps] == [1, 2, 3]
    with torch.no_grad():
        first = _LossModel("tensor")
        first.net.load_state_dict(tiny_model().state_dict())
        expected = first(tiny_loader(3, 8)[0]).item()
    assert float(steps[0].loss) == pytest.approx(expected, rel=1e-5)


# ---------------------------------------------------------------------------- accumulation


def test_gradient_accumulation_equals_one_big_batch() -> None:
    ((x, y),) = tiny_loader(1, 32, seed=3)
    halves = [(x[:16], y[:16]), (x[16:], y[16:])]

    accumulated = tiny_model()
    t1 = _trainer(accumulated, halves, lr=0.5, max_steps=1, accumulate=2, trace={"backward"})
    rec = EventRecorder(t1.bus)
    r1 = t1.fit_sync()
    big = tiny_model()
    r2 = _trainer(big, [(x, y)], lr=0.5, max_steps=1).fit_sync()

    assert r1.steps == r2.steps == 1
    assert not _same(_params(big), _params(tiny_model()))
    assert _same(_params(accumulated), _params(big), atol=1e-6)
    backwards = rec.of_type(ev.SpanTraced)
    assert [(e.span, e.micro_batch, e.batch_index) for e in backwards] == [
        ("backward", 0, 0), ("backward", 1, 1),
    ]  # fmt: skip
    (step,) = rec.of_type(ev.StepEnded)
    assert step.samples == 32


# ---------------------------------------------------------------------------- clipping


def test_clip_grad_norm_reports_pre_clip_norm_and_clips() -> None:
    data = tiny_loader(1, 8)
    clip = 0.01
    ref = tiny_model()
    F.cross_entropy(ref(data[0][0]), data[0][1]).backward()
    pre_clip = torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(p.grad) for p in ref.parameters()])
    ).item()
    assert pre_clip > 10 * clip  # the test is meaningful only if clipping bites

    model = tiny_model()
    before = _params(model)
    trainer = _trainer(model, data, lr=1.0, max_steps=1, clip_grad_norm=clip)
    rec = EventRecorder(trainer.bus)
    trainer.fit_sync()
    (step,) = rec.of_type(ev.StepEnded)
    assert step.grad_norm is not None
    assert float(step.grad_norm) == pytest.approx(pre_clip, rel=1e-4)
    # SGD(lr=1): the update is the clipped gradient, so its total norm is at most `clip`.
    delta = torch.linalg.vector_norm(
        torch.cat([(a - b).flatten() for a, b in zip(_params(model), before, strict=True)])
    ).item()
    assert 0 < delta <= clip * 1.001


def test_no_clip_reports_no_grad_norm() -> None:
    trainer = _trainer(max_steps=1)
    rec = EventRecorder(trainer.bus)
    trainer.fit_sync()
    (step,) = rec.of_type(ev.StepEnded)
    assert step.grad_norm is None


# ---------------------------------------------------------------------------- LR scheduler


def _expected_lrs(n: int) -> list[float]:
    opt = torch.optim.SGD(tiny_model().parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    out = []
    for _ in range(n):
        opt.step()
        sched.step()
        out.append(sched.get_last_lr()[0])
    return out


def test_scheduler_stepped_every_step() -> None:
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    trainer = Trainer(model, opt, tiny_loader(3, 8), loss_fn=F.cross_entropy, max_steps=5,
                      scheduler=sched, on_signal=None)  # fmt: skip
    rec = EventRecorder(trainer.bus)
    trainer.fit_sync()
    stepped = rec.of_type(ev.SchedulerStepped)
    assert [e.step for e in stepped] == [1, 2, 3, 4, 5]
    assert [e.lr for e in stepped] == pytest.approx(_expected_lrs(5))
    assert opt.param_groups[0]["lr"] == pytest.approx(_expected_lrs(5)[-1])


def test_scheduler_stepped_every_epoch() -> None:
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    trainer = Trainer(model, opt, tiny_loader(2, 8), loss_fn=F.cross_entropy, max_epochs=3,
                      scheduler=PerEpoch(sched), on_signal=None)  # fmt: skip
    rec = EventRecorder(trainer.bus)
    trainer.fit_sync()
    stepped = rec.of_type(ev.SchedulerStepped)
    assert [(e.step, e.epoch) for e in stepped] == [(2, 0), (4, 1), (6, 2)]
    assert [e.lr for e in stepped] == pytest.approx(_expected_lrs(3))
    # Within an epoch the lr is constant: the scheduler did not step per optimizer step.
    lrs = [(e.epoch, e.lr) for e in rec.of_type(ev.StepEnded)]
    assert lrs == [(0, 0.1), (0, 0.1), (1, 0.1), (1, 0.1), (2, 0.05), (2, 0.05)]


# ---------------------------------------------------------------------------- evaluation


def _accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return (outputs.argmax(dim=1) == targets).float().mean()


def test_eval_every_and_metrics_match_a_hand_computation() -> None:
    ((xe, ye),) = tiny_loader(1, 8, seed=7)
    eval_data = [(xe[:5], ye[:5]), (xe[5:], ye[5:])]  # unequal sizes: averages are per sample
    model = tiny_model()
    trainer = _trainer(
        model,
        tiny_loader(4, 8),
        max_steps=4,
        eval_data=eval_data,
        eval_schedule=EvalSchedule(every_steps=2, epoch_end=False),
        metrics={"acc": _accuracy},
    )
    rec = EventRecorder(trainer.bus)
    result = trainer.fit_sync()

    ended = rec.of_type(ev.EvaluationEnded)
    assert [(e.step, e.trigger) for e in ended] == [(2, "steps"), (4, "steps")]
    assert [(e.step, e.trigger) for e in rec.of_type(ev.EvaluationStarted)] == [
        (2, "steps"),
        (4, "steps"),
    ]
    assert len(rec.of_type(ev.EvalBatchEnded)) == 4
    last = ended[-1].metrics
    assert set(last) == {"val_loss", "val_acc"}
    assert dict(result.eval_metrics) == dict(last)
    with torch.no_grad():
        logits = model(xe)
        acc = (logits.argmax(1) == ye).float().mean().item()
        loss = F.cross_entropy(logits, ye).item()
    assert last["val_acc"] == pytest.approx(acc, abs=1e-6)
    assert last["val_loss"] == pytest.approx(loss, rel=1e-5)
    assert model.training  # evaluation restored train mode


def test_eval_at_epoch_end() -> None:
    trainer = _trainer(max_epochs=2, data=tiny_loader(2, 8), eval_data=tiny_loader(1, 8))
    rec = EventRecorder(trainer.bus)
    result = trainer.fit_sync()
    ended = rec.of_type(ev.EvaluationEnded)
    assert [(e.step, e.epoch, e.trigger) for e in ended] == [(2, 0, "epoch"), (4, 1, "epoch")]
    assert "val_loss" in result.eval_metrics


# ---------------------------------------------------------------------------- limits


@pytest.mark.parametrize(
    ("max_epochs", "max_steps", "steps", "epochs_started"),
    [
        (2, None, 6, 2),
        (None, 4, 4, 2),
        (None, 7, 7, 3),
        (1, 100, 3, 1),
        (5, 4, 4, 2),
        (2, 6, 6, 2),
    ],
)
def test_max_steps_and_max_epochs(
    max_epochs: int | None, max_steps: int | None, steps: int, epochs_started: int
) -> None:
    trainer = _trainer(data=tiny_loader(3, 4), max_epochs=max_epochs, max_steps=max_steps)
    rec = EventRecorder(trainer.bus)
    result = trainer.fit_sync()
    assert result.reason == "completed"
    assert result.steps == steps
    assert len(rec.of_type(ev.StepEnded)) == steps
    assert len(rec.of_type(ev.EpochStarted)) == epochs_started
    assert [e.step for e in rec.of_type(ev.StepEnded)] == list(range(1, steps + 1))


# ---------------------------------------------------------------------------- seeding


def _seeded_run(seed: int) -> list[torch.Tensor]:
    model = torch.nn.Sequential(tiny_model(), torch.nn.Dropout(0.5))
    x = torch.cat([b[0] for b in tiny_loader(4, 8)])
    y = torch.cat([b[1] for b in tiny_loader(4, 8)])
    loader = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)
    _trainer(model, loader, max_steps=6, seed=seed).fit_sync()
    return _params(model)


def test_same_seed_gives_identical_parameters() -> None:
    a, b = _seeded_run(123), _seeded_run(123)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    c = _seeded_run(124)  # control: the seed does drive shuffling and dropout
    assert not all(torch.equal(x, y) for x, y in zip(a, c, strict=True))


# ---------------------------------------------------------------------------- precision, device


class _AutocastProbe(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = tiny_model()
        self.seen: list[tuple[bool, torch.dtype]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        return self.net(x)


def test_bf16_runs_on_cpu_under_autocast_and_trains() -> None:
    model = _AutocastProbe()
    before = _params(model)
    trainer = _trainer(model, tiny_loader(4, 16), max_steps=8, precision="bf16", device="cpu",
                       lr=0.5, log_every=1)  # fmt: skip
    rec = EventRecorder(trainer.bus)
    result = trainer.fit_sync()
    assert result.reason == "completed"
    assert model.seen and all(on and dt == torch.bfloat16 for on, dt in model.seen)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # master weights stay fp32
    assert not _same(_params(model), before)
    losses = [float(e.loss) for e in rec.of_type(ev.StepEnded)]
    assert all(math.isfinite(v) for v in losses)
    assert sum(losses[-2:]) < sum(losses[:2])


def test_full_precision_has_no_autocast() -> None:
    model = _AutocastProbe()
    _trainer(model, max_steps=1).fit_sync()
    assert model.seen == [(False, model.seen[0][1])]


def test_device_auto_resolves_to_cpu_here() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA available")
    trainer = _trainer(device="auto", max_steps=1)
    rec = EventRecorder(trainer.bus)
    assert trainer.settings.device == torch.device("cpu")
    trainer.fit_sync()
    (started,) = rec.of_type(ev.FitStarted)
    assert started.device == "cpu"


# ---------------------------------------------------------------------------- demand


def test_unwanted_step_events_are_never_built(monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[int] = []
    original = ev.StepEnded.__init__

    def counting(self: Any, *args: Any, **kwargs: Any) -> None:
        built.append(kwargs.get("step", -1))
        original(self, *args, **kwargs)

    monkeypatch.setattr(ev.StepEnded, "__init__", counting)

    trainer = _trainer(data=tiny_loader(3, 4), max_steps=6)
    result = trainer.fit_sync()
    assert result.steps == 6
    assert built == []
    # Only the unconditional events: TrainerBuilt, FitStarted, 2 x (EpochStarted, EpochEnded),
    # FitEnded.
    assert result.statistics.published == 7

    # Control: with one subscriber to StepEnded, one is built per step.
    trainer = _trainer(data=tiny_loader(3, 4), max_steps=6)
    got: list[ev.StepEnded] = []
    trainer.bus.subscribe(trainer.bus.stream(ev.StepEnded), got.append)
    trainer.fit_sync()
    assert built == [1, 2, 3, 4, 5, 6]
    assert [e.step for e in got] == built


# ---------------------------------------------------------------------------- payloads


def _walk(value: Any) -> list[Any]:
    out = [value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            out.extend(_walk(getattr(value, f.name)))
    elif isinstance(value, Mapping):
        for v in value.values():
            out.extend(_walk(v))
    elif isinstance(value, list | tuple):
        for v in value:
            out.extend(_walk(v))
    return out


def test_events_carry_detached_tensors_and_never_the_model(tmp_path: Path) -> None:
    model = tiny_model()
    trainer = _trainer(model, tiny_loader(2, 8), max_epochs=2, eval_data=tiny_loader(1, 8),
                       clip_grad_norm=1.0, log_every=1, checkpoint_dir=tmp_path)  # fmt: skip
    _send_at(trainer, 1, cmd.Evaluate())
    rec = EventRecorder(trainer.bus)
    trainer.fit_sync()
    kinds = {type(e) for e in rec.items}
    assert {ev.StepEnded, ev.EvalBatchEnded, ev.CommandApplied,
            ev.CheckpointSaved, ev.MetricsLogged} <= kinds  # fmt: skip
    tensors = 0
    for event in rec.items:
        for value in _walk(event):
            assert not isinstance(value, torch.nn.Module | torch.optim.Optimizer | DataLoader), (
                type(event).__name__
            )
            assert value is not trainer.settings.train_data
            if isinstance(value, torch.Tensor):
                tensors += 1
                assert not value.requires_grad, type(event).__name__
                assert value.grad_fn is None
    assert tensors > 0
    for step in rec.of_type(ev.StepEnded):
        assert isinstance(step.loss, torch.Tensor) and not step.loss.requires_grad


# ---------------------------------------------------------------------------- loss checks


class _NoLossModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = tiny_model()

    def forward(self, batch: Any) -> dict[str, torch.Tensor]:
        return {"logits": self.net(batch[0])}


def test_model_output_without_loss_is_a_training_error() -> None:
    trainer = _trainer(_NoLossModel(), loss_fn=None)
    rec = EventRecorder(trainer.bus)
    with pytest.raises(TrainingError, match="loss"):
        trainer.fit_sync()
    assert trainer.result is not None and trainer.result.reason == "failed"
    (ended,) = rec.of_type(ev.FitEnded)
    assert ended.reason == "failed" and isinstance(ended.error, TrainingError)


def test_non_scalar_loss_names_step_and_batch() -> None:
    def per_sample(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(outputs, targets, reduction="none")

    trainer = _trainer(loss_fn=per_sample)
    with pytest.raises(TrainingError) as info:
        trainer.fit_sync()
    message = str(info.value)
    assert "scalar" in message and "step 0" in message and "batch 0" in message
    assert "(8,)" in message


class _NaNAfter:
    """A loss_fn that turns NaN from its ``n``-th call on."""

    def __init__(self, n: int) -> None:
        self.n, self.calls = n, 0

    def __call__(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        loss = F.cross_entropy(outputs, targets)
        return loss * float("nan") if self.calls >= self.n else loss


def test_nonfinite_raise(tmp_path: Path) -> None:
    trainer = _trainer(loss_fn=_NaNAfter(3), max_steps=10, log_every=1, on_nonfinite="raise",
                       checkpoint_dir=tmp_path / "ckpt")  # fmt: skip
    with pytest.raises(NonFiniteLossError):
        trainer.fit_sync()
    assert trainer.result is not None
    # Checked before the update on the CPU: the NaN step (3) is never applied.
    assert trainer.result.reason == "failed" and trainer.result.steps == 2
    assert not (tmp_path / "ckpt").exists()


def test_nonfinite_stop_writes_no_checkpoint_of_the_nan_state(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    trainer = _trainer(loss_fn=_NaNAfter(3), max_steps=10, log_every=1, on_nonfinite="stop",
                       checkpoint_dir=ckpt)  # fmt: skip
    _send_at(trainer, 1, cmd.SaveCheckpoint())
    rec = EventRecorder(trainer.bus)
    result = trainer.fit_sync()
    assert result.reason == "stopped"
    assert result.steps == 2
    assert result.stop_reason is not None and "non-finite" in result.stop_reason
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-00000001.pt"]
    assert result.last_checkpoint == str(ckpt / "step-00000001.pt")
    assert [e.step for e in rec.of_type(ev.CheckpointSaved)] == [1]
    (ended,) = rec.of_type(ev.FitEnded)
    assert ended.reason == "stopped"


def test_nonfinite_ignore_runs_to_the_end() -> None:
    trainer = _trainer(loss_fn=_NaNAfter(2), max_steps=4, log_every=1, on_nonfinite="ignore")
    result = trainer.fit_sync()
    assert result.reason == "completed" and result.steps == 4


# ---------------------------------------------------------------------------- running


def test_fit_runs_once() -> None:
    trainer = _trainer(max_steps=1)
    trainer.fit_sync()
    with pytest.raises(TrainbusError, match=r"ran on this Trainer already.*resume="):
        trainer.fit_sync()


def test_run_on_trio() -> None:
    model = tiny_model()
    before = _params(model)
    trainer = _trainer(
        model,
        max_steps=3,
        eval_data=tiny_loader(1, 8),
        eval_schedule=EvalSchedule(every_steps=3, epoch_end=False),
        on_signal="raise",
    )
    rec = EventRecorder(trainer.bus)
    result = trainer.fit_sync(backend="trio")  # signal handling: pytest runs on the main thread
    assert result.reason == "completed" and result.steps == 3
    assert [e.step for e in rec.of_type(ev.StepEnded)] == [1, 2, 3]
    assert rec.names()[:2] == ["TrainerBuilt", "FitStarted"] and rec.names()[-1] == "FitEnded"
    assert "val_loss" in result.eval_metrics
    assert not rec.completed  # suspended: the same streams serve the trainer's next call
    trainer.close()  # completes them, in a trio portal like the run's
    assert rec.completed
    assert not _same(_params(model), before)


@pytest.mark.asyncio
async def test_fit_is_awaitable_and_keeps_the_result() -> None:
    trainer = _trainer(max_steps=2)
    result = await trainer.fit()
    assert trainer.result is result
    assert result.reason == "completed" and result.steps == 2 and result.error is None


def test_training_reduces_the_loss() -> None:
    model = copy.deepcopy(tiny_model())
    trainer = _trainer(model, tiny_loader(8, 32), max_epochs=4, lr=0.5, log_every=8)
    rec = EventRecorder(trainer.bus)
    result = trainer.fit_sync()
    logged = rec.of_type(ev.MetricsLogged)
    assert len(logged) == 4
    assert logged[-1].metrics["loss"] < logged[0].metrics["loss"] * 0.8
    assert result.train_metrics["loss"] == logged[-1].metrics["loss"]

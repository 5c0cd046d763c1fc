"""Commands steer the loop: each is applied at a poll point and acknowledged by CommandApplied.

Commands are sent from an ``after_optimizer_step`` hook (training thread) so they are applied
deterministically at the poll point of that very step; ``bus.request`` is exercised from async
subscribers on the event loop.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest
import torch
import torch.nn.functional as F

from trainbus import ConfigError, EvalSchedule, EventBus, StepContext, Trainer
from trainbus import commands as cmd
from trainbus import events as ev
from trainbus.bus import CommandError
from trainbus.testing import EventRecorder, tiny_loader, tiny_model

BACKSTOP = 50_000  # steps: a run waiting for an async request ends long before this
# Requests from async subscribers run without barriers, so these tests cannot stall on one (a
# barrier subscriber awaiting a request is tested on its own at the end).
NO_BARRIERS: tuple[type[ev.BaseEvent], ...] = ()


def _trainer(
    *, model: torch.nn.Module | None = None, groups: bool = False, **kwargs: Any
) -> Trainer:
    model = model if model is not None else tiny_model()
    if groups:
        params: Any = [
            {"params": model[0].parameters()},  # type: ignore[index]
            {"params": model[2].parameters(), "lr": 0.2},  # type: ignore[index]
        ]
    else:
        params = model.parameters()
    optimizer = torch.optim.SGD(params, lr=0.1)
    kwargs.setdefault("on_signal", None)
    kwargs.setdefault("loss_fn", F.cross_entropy)
    if "max_steps" not in kwargs and "max_epochs" not in kwargs:
        kwargs["max_steps"] = 4
    data = kwargs.pop("data", tiny_loader(4, 8))
    return Trainer(model, optimizer, data, **kwargs)


def _send_at(trainer: Trainer, step: int, *commands: cmd.Command) -> None:
    def hook(ctx: StepContext) -> None:
        if ctx.step == step:
            for c in commands:
                trainer.bus.send(c)

    trainer.add_hook("after_optimizer_step", hook)


def _ack(rec: EventRecorder, command: cmd.Command) -> ev.CommandApplied:
    acks = [e for e in rec.of_type(ev.CommandApplied) if e.command is command]
    assert len(acks) == 1, acks
    return acks[0]


# ---------------------------------------------------------------------------- learning rate


def test_set_learning_rate_all_groups() -> None:
    trainer = _trainer(groups=True)
    command = cmd.SetLearningRate(lr=0.01)
    _send_at(trainer, 2, command)
    rec = EventRecorder(trainer.bus)
    result = trainer.fit_sync()
    assert result.reason == "completed" and result.steps == 4
    ack = _ack(rec, command)
    assert ack.step == 2 and ack.error is None
    opt = trainer.settings.optimizer
    assert [g["lr"] for g in opt.param_groups] == [0.01, 0.01]
    assert [e.lr for e in rec.of_type(ev.StepEnded)] == [0.1, 0.1, 0.01, 0.01]


def test_set_learning_rate_one_group() -> None:
    trainer = _trainer(groups=True)
    command = cmd.SetLearningRate(lr=0.05, param_group=1)
    _send_at(trainer, 1, command)
    rec = EventRecorder(trainer.bus)
    trainer.fit_sync()
    assert _ack(rec, command).error is None
    assert [g["lr"] for g in trainer.settings.optimizer.param_groups] == [0.1, 0.05]


def test_scale_learning_rate() -> None:
    trainer = _trainer(groups=True)
    both = cmd.ScaleLearningRate(factor=0.5)
    second = cmd.ScaleLearningRate(factor=0.1, param_group=1)
    _send_at(trainer, 1, both)
    _send_at(trainer, 3, second)
    rec = EventRecorder(trainer.bus)
    trainer.fit_sync()
    assert _ack(rec, both).step == 1 and _ack(rec, second).step == 3
    assert [g["lr"] for g in trainer.settings.optimizer.param_groups] == pytest.approx([0.05, 0.01])
    assert [e.lr for e in rec.of_type(ev.StepEnded)] == pytest.approx([0.1, 0.05, 0.05, 0.05])


def test_learning_rate_change_takes_effect_on_the_next_update() -> None:
    """After SetLearningRate(0) at step 2, the parameters stop moving."""
    model = tiny_model()
    trainer = _trainer(model=model, max_steps=4)
    snapshots: dict[int, list[torch.Tensor]] = {}

    def snapshot(ctx: StepContext) -> None:
        snapshots[ctx.step] = [p.detach().clone() for p in model.parameters()]

    trainer.add_hook("after_optimizer_step", snapshot)
    _send_at(trainer, 2, cmd.SetLearningRate(lr=0.0))
    trainer.fit_sync()
    assert not all(torch.equal(a, b) for a, b in zip(snapshots[1], snapshots[2], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(snapshots[2], snapshots[4], strict=True))


def test_bad_param_group_is_refused_and_the_run_goes_on() -> None:
    trainer = _trainer(groups=True)
    command = cmd.SetLearningRate(lr=0.5, param_group=5)
    _send_at(trainer, 1, command)
    rec = EventRecorder(trainer.bus)
    result = trainer.fit_sync()
    assert result.reason == "completed" and result.steps == 4
    ack = _ack(rec, command)
    assert isinstance(ack.error, ConfigError) and "param_group" in str(ack.error)
    assert [g["lr"] for g in trainer.settings.optimizer.param_groups] == [0.1, 0.2]


# ---------------------------------------------------------------------------- stop


def test_stop_epoch_ends_the_epoch_only() -> None:
    trainer = _trainer(max_epochs=2)
    command = cmd.StopEpoch()
    _send_at(trainer, 1, command)
    rec = EventRecorder(trainer.bus)
    result = trainer.fit_sync()
    assert result.reason == "completed"
    assert _ack(rec, command).step == 1
    assert [(e.epoch, e.batches) for e in rec.of_type(ev.EpochEnded)] == [(0, 1), (1, 4)]
    assert result.steps == 5


def test_stop_training_stops_after_the_step() -> None:
    trainer = _trainer(max_steps=10)
    command = cmd.StopTraining(reason="enough")
    _send_at(trainer, 3, command)
    rec = EventRecorder(trainer.bus)
    result = trainer.fit_sync()
    assert _ack(rec, command).step == 3
    assert result.reason == "stopped" and result.stop_reason == "enough" and result.steps == 3
    (ended,) = rec.of_type(ev.FitEnded)
    assert (ended.reason, ended.stop_reason) == ("stopped", "enough")


# ---------------------------------------------------------------------------- checkpoints


def test_save_checkpoint_writes_atomically_named_files(tmp_path: Path) -> None:
    trainer = _trainer(checkpoint_dir=tmp_path / "ckpt")
    tagged, plain = cmd.SaveCheckpoint(tag="best"), cmd.SaveCheckpoint()
    _send_at(trainer, 2, tagged)
    _send_at(trainer, 3, plain)
    rec = EventRecorder(trainer.bus)
    result = trainer.fit_sync()
    saved = rec.of_type(ev.CheckpointSaved)
    by_step = {(e.step, e.tag): e for e in saved}
    assert by_step[(2, "best")].path == str(tmp_path / "ckpt" / "step-00000002-best.pt")
    assert by_step[(3, None)].path == str(tmp_path / "ckpt" / "step-00000003.pt")
    ack = _ack(rec, tagged)
    assert ack.result is by_step[(2, "best")] and ack.error is None
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert names == ["step-00000002-best.pt", "step-00000003.pt", "step-00000004-final.pt"]
    assert not any(n.endswith(".tmp") for n in names)
    assert result.last_checkpoint == str(tmp_path / "ckpt" / "step-00000004-final.pt")
    payload = torch.load(by_step[(2, "best")].path, weights_only=False)
    assert payload["state"]["step"] == 2


def test_save_checkpoint_without_dir_is_refused_and_the_run_goes_on() -> None:
    trainer = _trainer()
    command = cmd.SaveCheckpoint()
    _send_at(trainer, 1, command)
    rec = EventRecorder(trainer.bus)
    result = trainer.fit_sync()
    assert result.reason == "completed" and result.steps == 4
    ack = _ack(rec, command)
    assert isinstance(ack.error, ConfigError) and "checkpoint_dir" in str(ack.error)
    assert ack.result is None


def test_evaluate_command_applied_at_the_poll_point() -> None:
    trainer = _trainer(eval_data=tiny_loader(1, 8), eval_schedule=EvalSchedule(epoch_end=False))
    command = cmd.Evaluate()
    _send_at(trainer, 2, command)
    rec = EventRecorder(trainer.bus)
    trainer.fit_sync()
    (ended,) = rec.of_type(ev.EvaluationEnded)
    assert (ended.step, ended.trigger) == (2, "command") and "val_loss" in ended.metrics
    assert _ack(rec, command).result is ended


# ---------------------------------------------------------------------------- bus.request


async def _request_then_stop(trainer: Trainer, command: cmd.Command, box: dict[str, Any]) -> None:
    """Subscribe an async subscriber that requests ``command`` on the first step, stores the
    outcome, then lets a few more steps pass and stops the run."""
    bus = trainer.bus

    async def on_step(event: ev.StepEnded) -> None:
        if "started" in box:
            return
        box["started"] = event.step
        try:
            box["result"] = await bus.request(command)
        except CommandError as exc:
            box["error"] = exc
        box["answered_at"] = box.get("last_step", 0)

    def watch(event: ev.StepEnded) -> None:
        box["last_step"] = event.step
        if "answered_at" in box and event.step > box["answered_at"] + 2 and "stop" not in box:
            box["stop"] = event.step
            bus.send(cmd.StopTraining(reason="done"))

    bus.subscribe_async(bus.stream(ev.StepEnded), on_step, overflow="latest")
    bus.subscribe(bus.stream(ev.StepEnded), watch)


@pytest.mark.asyncio
async def test_request_save_checkpoint_returns_checkpoint_saved(tmp_path: Path) -> None:
    trainer = _trainer(
        checkpoint_dir=tmp_path, max_steps=BACKSTOP, bus=EventBus(barriers=NO_BARRIERS)
    )
    box: dict[str, Any] = {}
    await _request_then_stop(trainer, cmd.SaveCheckpoint(tag="req"), box)
    rec = EventRecorder(trainer.bus)
    result = await trainer.fit()
    assert result.reason == "stopped" and result.stop_reason == "done"
    saved = box["result"]
    assert isinstance(saved, ev.CheckpointSaved)
    assert saved.tag == "req" and saved in rec.of_type(ev.CheckpointSaved)
    assert saved.path == str(tmp_path / f"step-{saved.step:08d}-req.pt")
    files = await anyio.to_thread.run_sync(lambda: sorted(p.name for p in tmp_path.iterdir()))
    assert Path(saved.path).name in files
    assert not any(name.endswith(".tmp") for name in files)


@pytest.mark.asyncio
async def test_request_evaluate_returns_evaluation_ended() -> None:
    trainer = _trainer(
        eval_data=tiny_loader(1, 8),
        eval_schedule=EvalSchedule(epoch_end=False),
        max_steps=BACKSTOP,
        bus=EventBus(barriers=NO_BARRIERS),
    )
    box: dict[str, Any] = {}
    await _request_then_stop(trainer, cmd.Evaluate(), box)
    result = await trainer.fit()
    assert result.reason == "stopped"
    ended = box["result"]
    assert isinstance(ended, ev.EvaluationEnded)
    assert ended.trigger == "command" and "val_loss" in ended.metrics


@pytest.mark.asyncio
async def test_request_save_without_dir_raises_command_error_and_the_run_goes_on() -> None:
    trainer = _trainer(max_steps=BACKSTOP, bus=EventBus(barriers=NO_BARRIERS))
    box: dict[str, Any] = {}
    await _request_then_stop(trainer, cmd.SaveCheckpoint(), box)
    rec = EventRecorder(trainer.bus)
    result = await trainer.fit()
    assert isinstance(box.get("error"), CommandError)
    assert isinstance(box["error"].__cause__, ConfigError)
    assert "result" not in box
    assert result.reason == "stopped" and result.stop_reason == "done" and result.error is None
    refused = [e for e in rec.of_type(ev.CommandApplied) if e.error is not None]
    assert len(refused) == 1
    assert result.steps > refused[0].step  # training went on after the refusal


@pytest.mark.asyncio
async def test_request_evaluate_without_eval_data_raises_command_error_and_run_goes_on() -> None:
    trainer = _trainer(max_steps=BACKSTOP, bus=EventBus(barriers=NO_BARRIERS))
    box: dict[str, Any] = {}
    await _request_then_stop(trainer, cmd.Evaluate(), box)
    rec = EventRecorder(trainer.bus)
    result = await trainer.fit()
    assert isinstance(box.get("error"), CommandError)
    assert "eval_data" in str(box["error"].__cause__)
    assert result.reason == "stopped" and result.stop_reason == "done"
    assert not rec.of_type(ev.EvaluationStarted)
    refused = [e for e in rec.of_type(ev.CommandApplied) if e.error is not None]
    assert len(refused) == 1 and result.steps > refused[0].step


# ---------------------------------------------------------------------------- barriers


def _recordwait_barriers(trainer: Trainer) -> list[bool]:
    """Wrap the port's ``wait_barrier`` (what the loop calls at a barrier): True = the wait
    ended without timing out ("done", or interrupted by a request to apply), False = it timed
    out."""
    port = trainer.bus.port()
    original = port.wait_barrier
    results: list[bool] = []

    async def wrapped(*args: Any, **kwargs: Any) -> str:
        status = await original(*args, **kwargs)
        results.append(status != "timeout")
        return status

    port.wait_barrier = wrapped  # type: ignore[method-assign]
    return results


@pytest.mark.asyncio
async def test_request_from_a_barrier_subscriber_does_not_stall_the_barrier(tmp_path: Path) -> None:
    trainer = _trainer(max_epochs=2, data=tiny_loader(2, 8), checkpoint_dir=tmp_path,
                       bus=EventBus(barrier_timeout=1.0))  # fmt: skip
    waits = _recordwait_barriers(trainer)
    saved: list[ev.BaseEvent] = []

    async def on_epoch_ended(event: ev.EpochEnded) -> None:
        saved.append(await trainer.bus.request(cmd.SaveCheckpoint(tag=f"epoch{event.epoch}")))

    trainer.bus.subscribe_async(trainer.bus.stream(ev.EpochEnded), on_epoch_ended, decides=True)
    result = await trainer.fit()
    assert result.reason == "completed"
    assert [e.step for e in saved] == [2, 4]  # each applied right after its epoch
    assert waits and all(waits), waits


@pytest.mark.asyncio
async def test_barrier_does_not_wait_for_subscribers_of_other_events() -> None:
    """A slow async StepEnded subscriber (a remote logger that is down) never stalls a barrier:
    the barrier waits only for the barrier event's own subscribers."""
    from trainbus import EventBus

    release = __import__("anyio").Event()
    bus = EventBus(flush_interval=10.0, close_timeout=0.1, barrier_timeout=1.0)  # only
    # barriers and the close deliver
    trainer = _trainer(max_epochs=2, data=tiny_loader(2, 8), bus=bus)
    waits = _recordwait_barriers(trainer)

    async def slow_logger(event: ev.StepEnded) -> None:
        await release.wait()  # e.g. a remote logger that is down

    bus.subscribe_async(bus.stream(ev.StepEnded), slow_logger)
    bus.subscribe(bus.stream(ev.FitEnded), lambda e: release.set())
    result = await trainer.fit()
    assert result.reason == "completed"
    assert waits and all(waits), waits

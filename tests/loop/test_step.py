"""The one step: observing it (subscribers on every per-phase event, a no-op hook at every
point) changes nothing but what is published.

Each configuration runs twice: with nobody observing the step (the step's event and hook
branches all skipped, which a counting ``publish`` proves) and with every per-phase event
subscribed and a no-op hook at every training point (every branch taken). Both runs must
publish the same other events with the same fields (times aside), end with bit-identical
weights and return the same result: accumulation, clipping, a scheduler, mixed precision,
evaluations, checkpoints, decision steps and every non-finite policy included.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from reactivex import operators as ops

from trainbus import EvalSchedule, Trainer
from trainbus import commands as cmd
from trainbus import events as ev
from trainbus import operators as tbops
from trainbus._hookpoints import HOOK_POINTS
from trainbus._trainer import options as trainer_options
from trainbus.testing import EventRecorder, NaNLossAt, tiny_loader, tiny_model

# The events of the step's own branches: published only when traced and someone wants them.
_PER_PHASE = {ev.SpanTraced}
_RECORDED = tuple(
    c for c in vars(ev).values()
    if isinstance(c, type) and issubclass(c, ev.BaseEvent) and c is not ev.BaseEvent
    and c not in _PER_PHASE
)  # fmt: skip
_TIMING = {"time", "duration_s", "data_wait_s", "elapsed_s", "remaining_s", "steps_per_s"}
_RATES = {"steps_per_s", "samples_per_s"}


class DictModel(torch.nn.Module):
    """A model that takes a mapping batch and returns ``{"loss": ...}`` (no ``loss_fn``)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = tiny_model()

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": F.cross_entropy(self.net(x), labels)}


def _value(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return _value(v.tolist())
    if isinstance(v, list | tuple):
        return [_value(x) for x in v]
    if isinstance(v, ev.BaseEvent):
        return _transcript([v])[0]
    if isinstance(v, BaseException):
        return (type(v).__name__, str(v))
    if isinstance(v, Mapping):
        return {k: _value(x) for k, x in v.items() if k not in _RATES}
    if isinstance(v, float) and math.isnan(v):
        return "nan"
    if isinstance(v, str) and ("/" in v or "\\" in v):
        return Path(v).name  # checkpoint paths: each run has its own folder
    return v


def _transcript(events: list[ev.BaseEvent]) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for e in events:
        fields = {
            f.name: _value(getattr(e, f.name))
            for f in dataclasses.fields(e)
            if f.name not in _TIMING
        }
        out.append((type(e).__name__, fields))
    return out


def _run(
    tmp_path: Path, make: Callable[[Path], Trainer], *, observed: bool, mp: pytest.MonkeyPatch
) -> tuple[list[Any], list[torch.Tensor], Any, int]:
    """One run; returns the transcript, the weights, the result and how many per-phase
    events were published."""
    per_phase = [0]
    with mp.context() as m:
        if observed:  # every case's Trainer built with trace=True
            m.setitem(trainer_options.CHECKS, "trace", lambda name, value: frozenset(
                ev.TRACED_SPANS))  # fmt: skip
        trainer = make(tmp_path / ("observed" if observed else "plain"))
        bus = trainer.bus
        port = bus.port()  # the loop publishes through the bus' loop face
        real_publish = port.publish

        def counting(event: ev.BaseEvent) -> None:
            if type(event) in _PER_PHASE:
                per_phase[0] += 1
            real_publish(event)

        m.setattr(port, "publish", counting)
        if observed:
            bus.stream(*_PER_PHASE).subscribe(lambda e: None)
            for point in HOOK_POINTS:
                trainer.add_hook(point, lambda ctx: None)
        rec = EventRecorder(bus, bus.stream(*_RECORDED))
        error: BaseException | None = None
        try:
            trainer.fit_sync()
        except Exception as exc:  # the NaN "raise" case: compared like the rest
            error = exc
    result = trainer.result
    assert result is not None
    summary = (result.reason, result.stop_reason, result.steps, result.epochs,
               _value(result.eval_metrics), _value(result.train_metrics), result.skipped_nonfinite,
               None if result.last_checkpoint is None else Path(result.last_checkpoint).name,
               None if error is None else (type(error).__name__, str(error)))  # fmt: skip
    weights = [p.detach().clone() for p in trainer.settings.model.parameters()]
    return _transcript(rec.items), weights, summary, per_phase[0]


def _sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _plain(folder: Path, **kwargs: Any) -> Trainer:
    model = tiny_model()
    kwargs.setdefault("loss_fn", F.cross_entropy)
    kwargs.setdefault("max_epochs", 2)
    return Trainer(model, _sgd(model), tiny_loader(24, 8), on_signal=None, progress=False,
                   **kwargs)  # fmt: skip


def _subscribed(folder: Path, **kwargs: Any) -> Trainer:
    trainer = _plain(folder, **kwargs)
    trainer.bus.stream(ev.StepEnded).subscribe(lambda e: None)
    trainer.bus.stream(ev.MetricsLogged).subscribe(lambda e: None)
    return trainer


def _scheduled(folder: Path) -> Trainer:
    model = tiny_model()
    opt = _sgd(model)
    trainer = Trainer(model, opt, tiny_loader(24, 8), loss_fn=F.cross_entropy, max_epochs=2,
                      scheduler=torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.7),
                      clip_grad_norm=0.05, log_every=9,
                      on_signal=None, progress=False)  # fmt: skip
    trainer.bus.stream(ev.StepEnded, ev.SchedulerStepped).subscribe(lambda e: None)
    return trainer


def _accumulated(folder: Path, **kwargs: Any) -> Trainer:
    """Steps of 3 micro-batches, the epoch's last one shorter (20 batches), clipped."""
    model = tiny_model()
    kwargs.setdefault("loss_fn", F.cross_entropy)
    return Trainer(model, _sgd(model), tiny_loader(20, 8),
                   max_epochs=2, accumulate=3, clip_grad_norm=0.1, log_every=4,
                   on_signal=None, progress=False, **kwargs)  # fmt: skip


def _evaluated(folder: Path) -> Trainer:
    return _plain(
        folder,
        eval_data=tiny_loader(3, 8, seed=1),
        eval_schedule=EvalSchedule(every_steps=7),
        log_every=5,
        checkpoint_dir=folder,
        max_epochs=3,
    )


def _decided(folder: Path) -> Trainer:
    trainer = _plain(folder, checkpoint_dir=folder, log_every=50)
    trainer.bus.stream(ev.StepEnded).pipe(tbops.every(6)).subscribe(
        lambda e: trainer.bus.send(cmd.SaveCheckpoint()) if e.step % 12 == 0 else None
    )
    return trainer


def _stopped_at_a_decision(folder: Path) -> Trainer:
    trainer = _plain(folder, log_every=50)
    trainer.bus.stream(ev.StepEnded).pipe(tbops.once(at=17)).subscribe(
        lambda e: trainer.bus.send(cmd.StopTraining(reason="enough"))
    )
    return trainer


def _mapping(folder: Path) -> Trainer:
    model = DictModel()
    data = [{"x": x, "labels": y} for x, y in tiny_loader(20, 8)]
    return Trainer(model, _sgd(model), data, max_steps=33, log_every=6, on_signal=None,
                   progress=False)  # fmt: skip


def _shuffled(folder: Path) -> Trainer:
    model = tiny_model()
    xs = torch.randn(96, 32, generator=torch.Generator().manual_seed(3))
    ys = torch.randint(0, 10, (96,), generator=torch.Generator().manual_seed(4))
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(xs, ys), batch_size=8, shuffle=True,
        generator=torch.Generator().manual_seed(5),
    )  # fmt: skip
    return Trainer(model, _sgd(model), loader, loss_fn=F.cross_entropy, max_epochs=3,
                   log_every=4, checkpoint_dir=folder, on_signal=None,
                   progress=False)  # fmt: skip


CASES: dict[str, Callable[[Path], Trainer]] = {
    "defaults": lambda f: _plain(f),
    "max_steps_off_the_log_grid": lambda f: _plain(f, max_steps=37, log_every=10),
    "step_subscribers": lambda f: _subscribed(f, log_every=7, max_steps=30),
    "scheduler_and_clipping": _scheduled,
    "evaluation_and_checkpoints": _evaluated,
    "decision_steps": _decided,
    "stop_at_a_decision_step": _stopped_at_a_decision,
    "mapping_batches_no_loss_fn": _mapping,
    "shuffled_loader": _shuffled,
    "accumulation_and_clipping": _accumulated,
    "accumulation_bf16": lambda f: _accumulated(f, precision="bf16"),
    "accumulation_nan_skip": lambda f: _accumulated(
        f, loss_fn=NaNLossAt(5, 9), on_nonfinite="skip"
    ),
    "nan_skip": lambda f: _plain(f, loss_fn=NaNLossAt(5, 9, 30), on_nonfinite="skip"),
    "nan_stop": lambda f: _subscribed(f, loss_fn=NaNLossAt(12), on_nonfinite="stop"),
    "nan_raise": lambda f: _plain(f, loss_fn=NaNLossAt(27), on_nonfinite="raise", log_every=10),
    "nan_ignore": lambda f: _subscribed(f, loss_fn=NaNLossAt(8), on_nonfinite="ignore"),
    "ignore_nothing_subscribed": lambda f: _plain(f, on_nonfinite="ignore", log_every=6),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_observing_the_step_changes_nothing_but_what_is_published(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    make = CASES[case]
    events, weights, result, published = _run(tmp_path, make, observed=False, mp=monkeypatch)
    ref_events, ref_weights, ref_result, ref_published = _run(
        tmp_path, make, observed=True, mp=monkeypatch
    )
    assert published == 0, "a step nobody observes built a per-phase event"
    assert ref_published > 0, "the observed run took no event branch: the case tests nothing"
    assert result == ref_result
    assert events == ref_events
    for a, b in zip(weights, ref_weights, strict=True):  # bit-identical (NaN where both are)
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def _one_long_epoch(batches: int) -> Trainer:
    """One epoch with no log, decision or evaluation step inside it."""
    model = tiny_model()
    return Trainer(model, _sgd(model), tiny_loader(batches, 8), loss_fn=F.cross_entropy,
                   max_epochs=1, log_every=10_000, on_signal=None,
                   progress=False)  # fmt: skip


def test_a_command_sent_from_a_thread_is_heard_after_a_plain_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The poll point after a plain step reads the bus' doorbell: a command sent from another
    thread is applied within a few steps, not at the next log step (there is none)."""
    started = threading.Event()

    def make(folder: Path) -> Trainer:
        trainer = _one_long_epoch(2000)
        trainer.bus.stream(ev.StepEnded).pipe(ops.filter(lambda e: e.step == 50)).subscribe(
            lambda e: started.set()
        )

        def stop_soon() -> None:
            started.wait(30)
            trainer.bus.send(cmd.StopTraining(reason="from a thread"))

        threading.Thread(target=stop_soon, daemon=True).start()
        return trainer

    _, _, result, _ = _run(Path("."), make, observed=False, mp=monkeypatch)
    assert result[0] == "stopped" and result[1] == "from a thread"
    assert 50 < result[2] < 2000


def test_a_hook_added_mid_run_runs_from_the_next_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """A hook added mid-run (here by a subscriber) runs on every step from then on, not from
    the next log step (there is none in this run)."""
    ran_at: list[int] = []

    def make(folder: Path) -> Trainer:
        trainer = _one_long_epoch(600)
        # A plain filter, not tbops.once(at=20): that would make step 20 a decision step.
        trainer.bus.stream(ev.StepEnded).pipe(ops.filter(lambda e: e.step == 20)).subscribe(
            lambda e: trainer.add_hook("after_optimizer_step", lambda ctx: ran_at.append(ctx.step))
        )
        return trainer

    _, _, result, _ = _run(Path("."), make, observed=False, mp=monkeypatch)
    assert result[2] == 600
    assert ran_at, "the hook never ran"
    assert ran_at == list(range(ran_at[0], 601))  # every step from the first on


def test_a_subscription_made_mid_run_gets_every_step_from_the_next_one() -> None:
    """The steps between two the loop must look after run back to back with the wanted events
    read once; a subscription rings the doorbell, which ends that run after its step, so a
    ``StepEnded`` subscriber added at step 20 (no log step, decision step or evaluation in
    this run) gets step 21 and every later one."""
    trainer = _one_long_epoch(300)
    got: list[int] = []
    subscribed: list[Any] = []

    def subscribe_once(ctx: Any) -> None:
        if ctx.step == 20 and not subscribed:
            stream = trainer.bus.stream(ev.StepEnded)
            subscribed.append(stream.subscribe(lambda e: got.append(e.step)))

    trainer.add_hook("after_optimizer_step", subscribe_once)
    result = trainer.fit_sync()
    assert result.steps == 300 and subscribed
    assert got == list(range(21, 301))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["hook", "thread"])
def test_an_async_subscription_made_off_the_event_loop_mid_run_works(where: str) -> None:
    """``subscribe_async`` from the training thread (a hook) or from a user's thread while the
    run goes: its workers start on the event loop, it gets every step from the next one, and
    the run ends (it raised anyio's ``NoEventLoopError`` and left a subscription whose close
    waited forever)."""
    trainer = _one_long_epoch(300)
    got: list[int] = []
    subscribed: list[Any] = []

    async def record(e: ev.StepEnded) -> None:
        got.append(e.step)

    def subscribe() -> None:
        # A buffer for every step: a loaded machine may run all 280 before the workers start,
        # and what this pins is the subscription, not the default buffer's drops.
        subscribed.append(trainer.bus.subscribe_async(trainer.bus.stream(ev.StepEnded), record,
                                                      buffer=400))  # fmt: skip

    def at_step_20(ctx: Any) -> None:
        if ctx.step == 20 and not subscribed:
            if where == "hook":
                subscribe()
            else:
                thread = threading.Thread(target=subscribe)
                thread.start()
                thread.join()

    trainer.add_hook("after_optimizer_step", at_step_20)
    result = trainer.fit_sync()
    assert result.steps == 300 and result.reason == "completed" and subscribed
    assert sorted(got) == list(range(21, 301))
    assert subscribed[0].statistics().failed == 0


def test_a_stop_inside_a_custom_step_ends_the_run_at_that_step() -> None:
    """A non-finite loss under ``on_nonfinite="stop"`` returned by a ``train_step`` (the loss it
    stepped on was finite: the update is taken) stops the run after that step, though the
    steps around it run back to back: the stop rings the doorbell."""
    calls: list[int] = []

    def nan_at_5(ctx: Any) -> torch.Tensor:
        calls.append(ctx.step)
        x, y = ctx.batch
        loss = F.cross_entropy(ctx.model(x), y)
        ctx.backward(loss)
        ctx.optimizer_step()
        return loss * float("nan") if ctx.step == 4 else loss

    model = tiny_model()
    trainer = Trainer(model, _sgd(model), tiny_loader(100, 8), train_step=nan_at_5,
                      max_epochs=1, log_every=10_000, on_nonfinite="stop", device="cpu",
                      on_signal=None, progress=False)  # fmt: skip
    # device="cpu": the per-step read (a GPU reads at the next sync, here the run's end).
    result = trainer.fit_sync()
    assert result.reason == "stopped" and "non-finite loss at step 5" in str(result.stop_reason)
    assert result.steps == 5 and calls == [0, 1, 2, 3, 4]


def test_a_forward_nobody_observes_fails_with_the_same_note() -> None:
    """The step calls the forward itself when nothing observes it: an exception from the model
    still carries the note naming the phase, step, epoch and batch, as under observation."""
    boom = ValueError("boom")
    model = tiny_model()
    calls = [0]

    def fail_at_4(module: Any, args: Any) -> None:
        calls[0] += 1
        if calls[0] == 5:
            raise boom

    model.register_forward_pre_hook(fail_at_4)
    trainer = Trainer(model, _sgd(model), tiny_loader(8, 8), loss_fn=F.cross_entropy,
                      max_epochs=1, on_signal=None, progress=False)  # fmt: skip
    with pytest.raises(ValueError) as caught:
        trainer.fit_sync()
    assert caught.value is boom
    assert "trainbus: raised in forward at step 4, epoch 0, batch 4" in caught.value.__notes__

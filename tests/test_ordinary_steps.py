"""Ordinary steps run back to back (``trainbus.loop.ordinary``) change nothing but the speed.

Each configuration runs twice: as it ships (stretches of ordinary steps in one tight loop) and
with every step taken by ``Step.run`` (``loop/step.py``). Both runs must publish the same
events with the same fields (times aside), end with bit-identical weights and return the same
result. A counter proves the stretches really ran, so no case passes by never taking the tight
loop.
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

from trainbus import Trainer
from trainbus import commands as cmd
from trainbus import events as ev
from trainbus import operators as tbops
from trainbus.loop import ordinary
from trainbus.testing import EventRecorder, NaNLossAt, tiny_loader, tiny_model

# Everything but the per-phase events and the step's extras: wanting any of those makes every
# step take Step.run (their events are published from the instrumented phases).
_PER_PHASE = {
    ev.BatchFetched, ev.ForwardStarted, ev.ForwardEnded, ev.LossComputed, ev.BackwardStarted,
    ev.BackwardEnded, ev.OptimizerStepStarted, ev.OptimizerStepEnded, ev.MicroBatchEnded,
    ev.ZeroGradStarted, ev.ZeroGradEnded, ev.StepBegan, ev.DataWaitStarted, ev.DataWaitEnded,
}  # fmt: skip
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
    tmp_path: Path, make: Callable[[Path], Trainer], *, tight: bool, mp: pytest.MonkeyPatch
) -> tuple[list[Any], list[torch.Tensor], Any, int]:
    """One run; returns the transcript, the weights, the result and the steps the tight loop
    ran."""
    ran = [0]
    real_run = ordinary.OrdinarySteps.run

    def counting(self: ordinary.OrdinarySteps, it: Any, limit: int) -> int:
        n = real_run(self, it, limit)
        ran[0] += n
        return n

    with mp.context() as m:
        m.setattr(ordinary.OrdinarySteps, "run", counting)
        if not tight:
            m.setattr(ordinary.OrdinarySteps, "possible", lambda self: False)
        trainer = make(tmp_path / ("tight" if tight else "step"))
        rec = EventRecorder(trainer.bus, trainer.bus.stream(*_RECORDED))
        error: BaseException | None = None
        try:
            trainer.run()
        except Exception as exc:  # the NaN "raise" case: compared like the rest
            error = exc
    result = trainer.result
    assert result is not None
    summary = (result.reason, result.stop_reason, result.steps, result.epochs,
               _value(result.metrics), _value(result.train_metrics), result.skipped_nonfinite,
               None if result.checkpoint is None else Path(result.checkpoint).name,
               None if error is None else (type(error).__name__, str(error)))  # fmt: skip
    weights = [p.detach().clone() for p in trainer.settings.model.parameters()]
    return _transcript(rec.items), weights, summary, ran[0]


def _sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _plain(folder: Path, **kwargs: Any) -> Trainer:
    model = tiny_model()
    kwargs.setdefault("loss_fn", F.cross_entropy)
    kwargs.setdefault("max_epochs", 2)
    return Trainer(model, _sgd(model), tiny_loader(24, 8), handle_signals=False, progress=False,
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
                      scheduler_interval="step", clip_grad_norm=0.05, log_every=9,
                      handle_signals=False, progress=False)  # fmt: skip
    trainer.bus.stream(ev.StepEnded, ev.SchedulerStepped).subscribe(lambda e: None)
    return trainer


def _evaluated(folder: Path) -> Trainer:
    return _plain(folder, eval_data=tiny_loader(3, 8, seed=1), eval_every=7, log_every=5,
                  checkpoint_dir=folder, max_epochs=3)  # fmt: skip


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
    return Trainer(model, _sgd(model), data, max_steps=33, log_every=6, handle_signals=False,
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
                   log_every=4, checkpoint_dir=folder, handle_signals=False,
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
    "nan_skip": lambda f: _plain(f, loss_fn=NaNLossAt(5, 9, 30), on_nonfinite="skip"),
    "nan_stop": lambda f: _subscribed(f, loss_fn=NaNLossAt(12), on_nonfinite="stop"),
    "nan_raise": lambda f: _plain(f, loss_fn=NaNLossAt(27), on_nonfinite="raise", log_every=10),
    "nan_ignore": lambda f: _subscribed(f, loss_fn=NaNLossAt(8), on_nonfinite="ignore"),
    "ignore_nothing_subscribed": lambda f: _plain(f, on_nonfinite="ignore", log_every=6),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_tight_loop_publishes_and_trains_exactly_like_the_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    make = CASES[case]
    events, weights, result, ran = _run(tmp_path, make, tight=True, mp=monkeypatch)
    ref_events, ref_weights, ref_result, ref_ran = _run(tmp_path, make, tight=False, mp=monkeypatch)
    assert ref_ran == 0
    assert ran > 0, "the tight loop never ran: the case tests nothing"
    assert result == ref_result
    assert events == ref_events
    for a, b in zip(weights, ref_weights, strict=True):  # bit-identical (NaN where both are)
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def test_most_steps_of_a_plain_run_are_ordinary(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the first step (its loss is checked), the log steps and the epoch's edges leave
    the tight loop."""
    _, _, result, ran = _run(Path("."), lambda f: _plain(f, log_every=10), tight=True,
                             mp=monkeypatch)  # fmt: skip
    assert result[2] == 48
    assert ran == 48 - 1 - 4  # the first step; the log steps 10, 20, 30, 40


def _one_long_stretch(batches: int) -> Trainer:
    """One epoch with no log step inside it: the whole run is one stretch after the first
    step, unless something ends it."""
    model = tiny_model()
    return Trainer(model, _sgd(model), tiny_loader(batches, 8), loss_fn=F.cross_entropy,
                   max_epochs=1, log_every=10_000, handle_signals=False,
                   progress=False)  # fmt: skip


def test_a_command_sent_during_a_stretch_ends_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stretch looks at the bus after every step: a command sent from another thread is
    applied within a few steps, not at the next log step."""
    started = threading.Event()

    def make(folder: Path) -> Trainer:
        trainer = _one_long_stretch(2000)
        trainer.bus.stream(ev.StepEnded).pipe(ops.filter(lambda e: e.step == 50)).subscribe(
            lambda e: started.set()
        )

        def stop_soon() -> None:
            started.wait(30)
            trainer.bus.send(cmd.StopTraining(reason="from a thread"))

        threading.Thread(target=stop_soon, daemon=True).start()
        return trainer

    _, _, result, ran = _run(Path("."), make, tight=True, mp=monkeypatch)
    assert result[0] == "stopped" and result[1] == "from a thread"
    assert 50 < result[2] < 2000 and ran > 40


def test_a_hook_added_during_a_stretch_runs_from_the_next_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A hook added mid-run (here by a subscriber) ends the stretch: it runs on every step
    from then on, not from the next log step (there is none in this run)."""
    ran_at: list[int] = []

    def make(folder: Path) -> Trainer:
        trainer = _one_long_stretch(600)
        # A plain filter, not tbops.once(at=20): that would make step 20 a decision step,
        # taken by Step.run, and the hook would be there before the next stretch begins.
        trainer.bus.stream(ev.StepEnded).pipe(ops.filter(lambda e: e.step == 20)).subscribe(
            lambda e: trainer.add_hook("after_optimizer_step", lambda ctx: ran_at.append(ctx.step))
        )
        return trainer

    _, _, result, ran = _run(Path("."), make, tight=True, mp=monkeypatch)
    assert result[2] == 600 and ran > 0
    assert ran_at, "the hook never ran"
    assert ran_at == list(range(ran_at[0], 601))  # every step from the first on

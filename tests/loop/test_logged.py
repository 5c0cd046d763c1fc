"""Metrics from anywhere: a hook's or custom step's ``ctx.log``, a subscriber's ``LogMetric``,
averaged over the log window into ``MetricsLogged``, ``FitResult.train_metrics`` and the
loggers; and ``Callback.on_<snake_case>`` for a user's own event class."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from reactivex import operators as ops
from structlog.testing import capture_logs

from trainbus import (
    Callback,
    ConfigError,
    EvalSchedule,
    EventBus,
    StepContext,
    Trainer,
    TrainingError,
)
from trainbus import commands as cmd
from trainbus import events as ev
from trainbus.callbacks import JsonlEventLog
from trainbus.testing import EventRecorder, tiny_loader, tiny_model


def trainer(**kw: Any) -> Trainer:
    model = tiny_model()
    kw.setdefault("max_steps", 8)
    kw.setdefault("log_every", 4)
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05), tiny_loader(8),
                   loss_fn=F.cross_entropy, progress=False, **kw)  # fmt: skip


def test_a_hooks_values_are_averaged_over_the_log_window() -> None:
    t = trainer()
    rec = EventRecorder(t.bus)
    # steps 0..3 log 0..3 in the first window (mean 1.5), steps 4..7 in the second (5.5)
    t.add_hook("after_optimizer_step", lambda ctx: ctx.log("step_seen", float(ctx.step - 1)))
    # a tensor stays on its device until the window closes
    t.add_hook("loss", lambda ctx: ctx.log("loss_x2", ctx.loss.detach() * 2))
    result = t.fit_sync()
    logged = rec.of_type(ev.MetricsLogged)
    assert [m.metrics["step_seen"] for m in logged] == [1.5, 5.5]
    assert result.train_metrics["step_seen"] == 5.5
    for m in logged:  # the loss of the window, twice
        assert m.metrics["loss_x2"] == pytest.approx(2 * m.metrics["loss"], rel=1e-6)


def test_a_subscribers_log_metric_lands_in_the_window_it_is_applied_in() -> None:
    # StepEnded as a barrier: the subscriber's command is applied right after its step
    t = trainer(log_every=1, max_steps=4, bus=EventBus(barriers=(ev.StepEnded,)))
    rec = EventRecorder(t.bus)
    t.bus.stream(ev.StepEnded).subscribe(
        lambda e: t.bus.send(cmd.LogMetric(name="from_sub", value=10.0 * e.step))
    )
    t.fit_sync()
    by_step = {m.step: m.metrics.get("from_sub") for m in rec.of_type(ev.MetricsLogged)}
    # applied at step k's poll point: in the window that closes at step k + 1
    assert by_step == {1: None, 2: 10.0, 3: 20.0, 4: 30.0}
    applied = [a for a in rec.of_type(ev.CommandApplied) if isinstance(a.command, cmd.LogMetric)]
    assert len(applied) == 4 and all(a.error is None for a in applied)


def test_logged_values_reach_the_loggers(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    t = trainer(callbacks=[JsonlEventLog(path, events=[ev.MetricsLogged])])
    t.add_hook("after_backward", lambda ctx: ctx.log("backward_seen", 1.0))
    t.fit_sync()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    logged = [r for r in records if r.get("type", r.get("event")) == "MetricsLogged"]
    assert logged, records[:3]
    assert all(r["metrics"]["backward_seen"] == 1.0 for r in logged)


@pytest.mark.parametrize(
    ("name", "value", "match"),
    [
        ("loss", 1.0, r"other than the window's own metrics"),
        ("lr/g", 1.0, r"lr/<optimizer>"),
        ("", 1.0, r"a non-empty string"),
        ("x", torch.ones(3), r"a tensor of shape \(3,\).*one-element tensor"),
        ("x", "1.0", r"a number or a one-element tensor"),
    ],
)
def test_bad_names_and_values_are_refused(name: str, value: Any, match: str) -> None:
    t = trainer(max_steps=1)
    t.add_hook("batch", lambda ctx: ctx.log(name, value))
    with pytest.raises(ConfigError, match=match):
        t.fit_sync()


def test_log_metric_commands_are_checked_when_built() -> None:
    with pytest.raises(ConfigError, match="name"):
        cmd.LogMetric(name="", value=1.0)
    with pytest.raises(ConfigError, match="value"):
        cmd.LogMetric(name="x", value="high")  # type: ignore[arg-type]


def test_an_evaluation_hook_cannot_log() -> None:
    t = trainer(max_steps=1, eval_data=tiny_loader(1), eval_schedule=EvalSchedule(every_steps=1))
    t.add_hook("eval_batch", lambda ctx: ctx.log("x", 1.0))
    with pytest.raises(TrainingError, match=r"ctx.log\('x', \.\.\.\) in a hook of phase 'eval'"):
        t.fit_sync()


# ------------------------------------------------------------------------------ own events
@dataclass(frozen=True, slots=True, kw_only=True)
class LayerStats(ev.BaseEvent):
    """A user's own event: per-layer weight norms."""

    norms: tuple[float, ...]


def test_a_callback_method_receives_a_users_own_event_class() -> None:
    class StatsCallback(Callback):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[LayerStats] = []

        def setup(self, bus: Any) -> None:
            self._bus = bus

        def hook_after_optimizer_step(self, ctx: StepContext) -> None:
            norms = tuple(float(p.detach().norm()) for p in ctx.model.parameters())
            self._bus.publish(LayerStats(step=ctx.step, epoch=ctx.epoch, norms=norms))

        def on_layer_stats(self, e: LayerStats) -> None:
            self.seen.append(e)

    cb = StatsCallback()
    trainer(max_steps=3, callbacks=[cb]).fit_sync()
    assert [e.step for e in cb.seen] == [1, 2, 3]
    assert len(cb.seen[0].norms) == 4


def test_an_on_method_naming_no_event_class_is_still_refused() -> None:
    class Typo(Callback):
        def on_layer_stat(self, e: Any) -> None: ...

    with pytest.raises(ConfigError, match=r"Typo\.on_layer_stat.*your own event class"):
        trainer(callbacks=[Typo()])


def test_an_on_method_naming_two_event_classes_is_refused() -> None:
    @dataclass(frozen=True, slots=True, kw_only=True)
    class LayerStats(ev.BaseEvent):  # the same name as the module's, in another scope
        pass

    class Stats(Callback):
        def on_layer_stats(self, e: Any) -> None: ...

    with pytest.raises(ConfigError, match=r"several match: .*LayerStats.*LayerStats"):
        trainer(callbacks=[Stats()])


# ------------------------------------------------------------------ the partial last window
@pytest.mark.parametrize(
    ("steps", "log_every", "stop_at", "logged_at"),
    [
        (48, 50, None, [48]),  # a short fine-tune: fewer steps than log_every
        (24, 10, None, [10, 20, 24]),
        (30, 10, None, [10, 20, 30]),  # no partial window: nothing twice
        (40, 10, 23, [10, 20, 23]),  # a stop (what SIGTERM sends) mid-window
        (40, 1, 5, [1, 2, 3, 4, 5]),
    ],
)
def test_the_partial_last_window_reaches_the_loggers(
    tmp_path: Path, steps: int, log_every: int, stop_at: int | None, logged_at: list[int]
) -> None:
    """The steps after the last multiple of ``log_every`` (and a ``ctx.log`` in them) reach a
    logger as one more ``MetricsLogged`` when the run completes or stops; the JSONL log has
    it too, before ``FitEnded``."""
    model = tiny_model()
    t = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05), tiny_loader(steps),
                loss_fn=F.cross_entropy, progress=False, on_signal=None, max_epochs=1,
                log_every=log_every,
                callbacks=[JsonlEventLog(tmp_path / "events.jsonl")])  # fmt: skip
    t.add_hook("loss", lambda ctx: ctx.log("marker", float(ctx.step)))
    if stop_at is not None:  # declared: the stop lands on the step it was decided for
        t.bus.stream(ev.StepEnded).pipe(ops.filter(lambda e: e.step == stop_at)).subscribe(
            lambda _: t.bus.send(cmd.StopTraining(reason="budget"))
        )
        t.bus.declare_decision_steps(at=stop_at)
    logged: list[ev.MetricsLogged] = []
    t.bus.stream(ev.MetricsLogged).subscribe(logged.append)
    # A loss-threshold stopper that fires on the partial window: no step is left to stop.
    t.bus.stream(ev.MetricsLogged).pipe(ops.filter(lambda e: e.step % log_every != 0)).subscribe(
        lambda _: t.bus.send(cmd.StopTraining(reason="threshold"))
    )
    ended: list[ev.StepEnded] = []
    t.bus.stream(ev.StepEnded).subscribe(ended.append)
    result = t.fit_sync()
    assert result.steps == (stop_at or steps)
    assert result.reason == ("completed" if stop_at is None else "stopped")
    assert [e.step for e in logged] == logged_at
    last = logged[-1]
    assert last.epoch == ended[-1].epoch == 0  # the epoch of its steps, not the next one
    assert last.metrics == result.train_metrics  # what FitResult holds, a logger has too
    first_in_window = logged_at[-2] if len(logged_at) > 1 else 0
    # The window's steps only: the hook ran at steps first..last-1 (ctx.step before update).
    assert last.metrics["marker"] == pytest.approx(
        sum(range(first_in_window, last.step)) / (last.step - first_in_window)
    )
    lines = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    names = [x["type"] for x in lines]
    assert names.count("MetricsLogged") == len(logged_at)
    assert names.index("FitEnded") > max(i for i, n in enumerate(names) if n == "MetricsLogged")


def test_the_partial_last_window_of_a_run_of_several_epochs_is_of_its_last_epoch() -> None:
    """The run ends past its last epoch's end (the state counts the next one): the partial
    window is stamped with the epoch of its steps, not one past the run's last."""
    model = tiny_model()
    t = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05), tiny_loader(7),
                loss_fn=F.cross_entropy, progress=False, on_signal=None, max_epochs=3,
                log_every=5)  # fmt: skip
    logged: list[ev.MetricsLogged] = []
    t.bus.stream(ev.MetricsLogged).subscribe(logged.append)
    result = t.fit_sync()
    assert (result.reason, result.steps) == ("completed", 21)
    assert [(e.step, e.epoch) for e in logged] == [(5, 0), (10, 1), (15, 2), (20, 2), (21, 2)]


def test_a_save_decided_on_the_partial_last_window_is_dropped_and_the_final_checkpoint_holds_it(
    tmp_path: Path,
) -> None:
    """Keeping checkpoints by the training loss (a pipeline on ``MetricsLogged``, docs/callbacks/
    checkpointing.md): the saves decided on whole windows land on their steps; the one decided
    on the last, partial window comes after the last poll point and is dropped, named, and the
    final checkpoint holds the run's last weights."""
    model = tiny_model()
    t = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.05),
        tiny_loader(47),
        loss_fn=F.cross_entropy,
        progress=False,
        on_signal=None,
        max_epochs=1,
        log_every=10,
        checkpoint_dir=tmp_path,
    )
    t.bus.stream(ev.MetricsLogged).pipe(
        ops.map(lambda e: cmd.SaveCheckpoint(tag="best"))
    ).subscribe(t.bus.commands)
    t.bus.declare_decision_steps(every=10)
    with capture_logs() as logs:
        result = t.fit_sync()
    assert result.steps == 47
    saved = sorted(p.name for p in tmp_path.glob("step-*.pt"))
    assert saved == [f"step-{s:08d}-best.pt" for s in (10, 20, 30, 40)] + ["step-00000047-final.pt"]
    dropped = [x for x in logs if x["event"] == "commands_not_applied"]
    assert len(dropped) == 1 and "SaveCheckpoint" in str(dropped[0]), logs
    final = torch.load(tmp_path / "step-00000047-final.pt", weights_only=False)
    assert final["state"]["step"] == 47

"""MetricsLogger (structlog lines, throttled) and JsonlEventLog (batched JSON lines, lossless)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from structlog.testing import capture_logs

from trainbus import ConfigError, EventBus
from trainbus import commands as cmd
from trainbus import events as ev
from trainbus._wire import record as event_record
from trainbus.callbacks import JsonlEventLog, MetricsLogger
from trainbus.testing import EventRecorder, VirtualTimeScheduler


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# ----------------------------------------------------------------------------- MetricsLogger
@pytest.mark.parametrize("every_s", [0, -1, float("nan"), "1s", True])
def test_metrics_logger_rejects_bad_every_s(every_s: Any) -> None:
    with pytest.raises(ConfigError, match=r"^every_s="):
        MetricsLogger(every_s=every_s)


def test_metrics_logger_logs_each_fact_with_event_field_names(vbus: EventBus) -> None:
    MetricsLogger().setup(vbus)
    with capture_logs() as logs:
        vbus.publish(ev.MetricsLogged(step=10, epoch=0, metrics={"loss": 0.5, "lr": 0.1}))
        vbus.publish(ev.EvaluationEnded(step=10, epoch=0, metrics={"val_loss": 0.7, "step": 3.0}))
        vbus.publish(ev.CheckpointSaved(step=10, epoch=0, path="r/step-10.pt", tag="best",
                                        metrics={"val_loss": 0.7}))  # fmt: skip
        vbus.publish(ev.FitEnded(step=12, epoch=1, reason="stopped", stop_reason="early"))
        vbus.flush()
    assert [x["event"] for x in logs] == [
        "metrics_logged", "evaluation_ended", "checkpoint_saved", "fit_ended"
    ]  # fmt: skip
    metrics, evaluation, saved, ended = logs
    assert metrics == {"event": "metrics_logged", "log_level": "info", "step": 10, "epoch": 0,
                       "loss": 0.5, "lr": 0.1}  # fmt: skip
    # A metric called "step" must not overwrite the event's step.
    assert evaluation["step"] == 10 and evaluation["metric_step"] == 3.0
    assert evaluation["val_loss"] == 0.7 and evaluation["trigger"] == "epoch"
    assert saved["path"] == "r/step-10.pt" and saved["tag"] == "best" and saved["val_loss"] == 0.7
    assert ended["reason"] == "stopped" and ended["stop_reason"] == "early"
    assert ended["log_level"] == "info" and ended["error"] is None


def test_metrics_logger_logs_failures_at_error_level(vbus: EventBus) -> None:
    MetricsLogger().setup(vbus)
    with capture_logs() as logs:
        vbus.publish(ev.EvaluationEnded(step=3, epoch=0, error=RuntimeError("eval broke")))
        vbus.publish(ev.FitEnded(step=3, epoch=0, reason="failed", error=ValueError("boom")))
        vbus.flush()
    assert [(x["event"], x["log_level"]) for x in logs] == [
        ("evaluation_ended", "error"), ("fit_ended", "error")
    ]  # fmt: skip
    assert logs[0]["error"] == "RuntimeError('eval broke')"
    assert logs[1]["error"] == "ValueError('boom')"


def test_metrics_logger_every_s_throttles_metric_lines_only(
    vbus: EventBus, vts: VirtualTimeScheduler
) -> None:
    MetricsLogger(every_s=1.0).setup(vbus)

    def burst(first: int) -> None:
        for s in range(first, first + 5):
            vbus.publish(ev.MetricsLogged(step=s, epoch=0, metrics={"loss": 1.0}))
        vbus.publish(ev.EvaluationEnded(step=first, epoch=0, metrics={"val_loss": 1.0}))
        vbus.flush()

    with capture_logs() as logs:
        burst(1)
        vts.advance_by(0.5)
        burst(6)
        vts.advance_by(0.5)
        burst(11)
    assert [x["step"] for x in logs if x["event"] == "metrics_logged"] == [1, 11]
    assert [x["step"] for x in logs if x["event"] == "evaluation_ended"] == [1, 6, 11]


def test_metrics_logger_in_a_run(trainer_factory: Any) -> None:
    with capture_logs() as logs:
        result = trainer_factory([MetricsLogger()], epochs=2, batches=4, log_every=2).fit_sync()
    lines = logs
    metric_steps = [x["step"] for x in lines if x["event"] == "metrics_logged"]
    assert metric_steps == [2, 4, 6, 8]
    evals = [x for x in lines if x["event"] == "evaluation_ended"]
    assert [x["step"] for x in evals] == [4, 8] and all("val_loss" in x for x in evals)
    # The trainer logs its own fit_ended; ours is the one carrying the event's error field.
    (ended,) = [x for x in lines if x["event"] == "fit_ended" and "error" in x]
    assert ended["step"] == result.steps and ended["reason"] == "completed"


# ----------------------------------------------------------------------------- JsonlEventLog
@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"path": 3}, "path"),
        ({"path": ""}, "path"),
        ({"events": [int]}, "events"),
        ({"events": []}, "events"),
        ({"events": ["StepEnded"]}, "events"),
        ({"flush_s": 0}, "flush_s"),
        ({"flush_s": None}, "flush_s"),
        ({"append": "yes"}, "append"),
    ],
)
def test_jsonl_rejects_bad_arguments(tmp_path: Path, kwargs: dict[str, Any], name: str) -> None:
    kwargs.setdefault("path", tmp_path / "events.jsonl")
    with pytest.raises(ConfigError, match=f"^{name}="):
        JsonlEventLog(**kwargs)


def test_jsonl_rejects_a_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^path=.*not an existing directory"):
        JsonlEventLog(tmp_path)


def test_jsonl_writes_every_event_of_a_run_and_loses_nothing_at_close(
    tmp_path: Path, trainer_factory: Any
) -> None:
    path = tmp_path / "deep" / "run" / "events.jsonl"
    # flush_s far beyond the run: every line is written by the partial batch at close.
    trainer = trainer_factory([JsonlEventLog(path, flush_s=3600)], epochs=2, batches=3)
    recorder = EventRecorder(trainer.bus)
    assert not path.parent.exists()  # nothing is created before the first write
    trainer.fit_sync()
    records = read_jsonl(path)
    assert [r["type"] for r in records] == recorder.names()
    assert [r["type"] for r in records[:2]] == ["TrainerBuilt", "FitStarted"]
    assert records[-1]["type"] == "FitEnded"
    assert records[-1]["reason"] == "completed" and records[-1]["error"] is None
    step = next(r for r in records if r["type"] == "StepEnded")
    assert set(step) == {"v", "type", "step", "epoch", "time", "loss", "lr", "grad_norm", "samples",
                         "duration_s", "data_wait_s"}  # fmt: skip
    assert isinstance(step["loss"], float) and step["grad_norm"] is None
    evaluation = next(r for r in records if r["type"] == "EvaluationEnded")
    assert set(evaluation["metrics"]) == {"val_loss"}


def test_jsonl_records_only_the_chosen_events(tmp_path: Path, trainer_factory: Any) -> None:
    path = tmp_path / "events.jsonl"
    log = JsonlEventLog(path, events=[ev.StepEnded, ev.FitEnded], flush_s=0.01)
    trainer_factory([log], epochs=1, batches=5).fit_sync()
    assert [r["type"] for r in read_jsonl(path)] == ["StepEnded"] * 5 + ["FitEnded"]


@pytest.mark.asyncio
async def test_jsonl_batches_in_time_and_flushes_the_rest_at_close(
    tmp_path: Path, step_event: Any, wait_until: Any
) -> None:
    vts = VirtualTimeScheduler()
    bus = EventBus(rx_scheduler=vts, flush_interval=0.001)
    path = tmp_path / "events.jsonl"
    path.write_text("left over from an earlier run\n")
    JsonlEventLog(path, flush_s=1.0).setup(bus)
    async with bus:
        for i in (1, 2, 3):
            bus.publish(step_event(i))
        await bus.wait_delivered()
        assert path.read_text() == "left over from an earlier run\n"  # buffered, not written
        vts.advance_by(1.0)  # the window closes: one batch of three
        await wait_until(lambda: len(path.read_text().splitlines()) == 3)
        for i in (4, 5):
            bus.publish(step_event(i))
        await bus.wait_delivered()
        assert len(read_jsonl(path)) == 3
    # Closing the bus completed the stream: the partial window was written before exit.
    assert [r["step"] for r in read_jsonl(path)] == [1, 2, 3, 4, 5]
    (sub,) = bus.statistics().subscriptions
    assert sub.name == "JsonlEventLog" and sub.delivered == 2 and sub.failed == 0


@pytest.mark.asyncio
async def test_jsonl_append_keeps_what_was_there(tmp_path: Path, step_event: Any) -> None:
    path = tmp_path / "events.jsonl"
    path.write_text('{"type": "Earlier"}\n')
    bus = EventBus(flush_interval=0.001)
    JsonlEventLog(path, append=True).setup(bus)
    async with bus:
        bus.publish(step_event(1))
    assert [r["type"] for r in read_jsonl(path)] == ["Earlier", "StepEnded"]


def test_event_record_converts_every_payload() -> None:
    saved = ev.CheckpointSaved(step=4, epoch=1, path="r/step-4.pt", tag="best",
                               metrics={"val_loss": 0.25})  # fmt: skip
    applied = ev.CommandApplied(step=4, epoch=1, command=cmd.SaveCheckpoint(tag="best"),
                                result=saved, error=OSError("disk full"))  # fmt: skip
    record = event_record(applied)
    assert record["type"] == "CommandApplied"
    assert record["command"] == {"type": "SaveCheckpoint", "tag": "best", "decided_at": None}
    assert record["result"]["type"] == "CheckpointSaved"
    assert record["result"]["metrics"] == {"val_loss": 0.25}
    assert record["error"] == "OSError('disk full')"
    step = event_record(ev.StepEnded(step=1, epoch=0, loss=torch.tensor(0.5), lr=0.1,
                                     grad_norm=torch.tensor([3.0]), samples=8,
                                     duration_s=0.01))  # fmt: skip
    assert step["loss"] == 0.5 and type(step["loss"]) is float and step["grad_norm"] == 3.0
    assert json.loads(json.dumps(record)) == record  # JSON-ready

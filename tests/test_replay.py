"""trainbus.replay: a recorded run, rebuilt and replayed in virtual time."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from reactivex import operators as ops
from tests.callbacks.conftest import make_trainer

from trainbus import ConfigError, EvalSchedule, replay
from trainbus import events as ev
from trainbus import operators as tbops
from trainbus._replay import load_events
from trainbus.callbacks import JsonlEventLog
from trainbus.testing import VirtualTimeScheduler


def decide(source: Any) -> Any:
    """The pipeline under test: early-stop decisions on val_score."""
    return source.pipe(
        tbops.of_type(ev.EvaluationEnded),
        ops.filter(lambda e: e.error is None),
        tbops.patience("val_score", mode="min", patience=2),
        ops.map(repr),
    )


def test_live_and_replayed_decisions_agree(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    trainer = make_trainer(
        [JsonlEventLog(path, flush_s=0.05)],
        epochs=3,
        batches=2,
        eval_schedule=EvalSchedule(every_steps=1, epoch_end=False),
        score=[5.0, 4.0, 4.5, 4.2, 3.9, 4.0, 4.1, 4.0],
    )
    live: list[str] = []
    decide(trainer.bus.events).subscribe(live.append)
    trainer.fit_sync()
    assert live, "the live pipeline decided nothing: the test would prove nothing"

    recorded = list(load_events(path))
    scheduler = VirtualTimeScheduler()
    replayed: list[str] = []
    emitted_at: list[float] = []
    done: list[bool] = []
    source = replay(tmp_path)  # the run folder works too
    source.pipe(ops.do_action(lambda _: emitted_at.append(scheduler.seconds))).subscribe(
        lambda _: None, scheduler=scheduler
    )
    decide(replay(path)).subscribe(replayed.append, on_completed=lambda: done.append(True),
                                   scheduler=scheduler)  # fmt: skip
    assert replayed == [] and not done  # nothing before the clock moves
    scheduler.start()
    assert done and replayed == live
    # Original relative timing, on the virtual clock.
    t0 = recorded[0].time
    # (the virtual clock counts in timedelta microseconds: allow their rounding)
    assert emitted_at == pytest.approx([e.time - t0 for e in recorded], abs=1e-3)


def test_events_are_rebuilt_as_their_classes(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    make_trainer([JsonlEventLog(path, flush_s=0.05)], epochs=1, batches=2).fit_sync()
    assert all(json.loads(line)["v"] == 1 for line in path.read_text().splitlines())
    events = list(load_events(path))
    assert isinstance(events[0], ev.TrainerBuilt) and isinstance(events[-1], ev.FitEnded)
    assert isinstance(events[1], ev.FitStarted)
    steps = [e for e in events if isinstance(e, ev.StepEnded)]
    assert [e.step for e in steps] == [1, 2] and all(isinstance(e.loss, float) for e in steps)
    evals = [e for e in events if isinstance(e, ev.EvaluationEnded)]
    assert evals and "val_loss" in evals[0].metrics


def test_errors_and_unknown_versions(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    record = {"v": 1, "type": "FitEnded", "step": 3, "epoch": 0, "time": 1.0,
              "reason": "failed", "error": "RuntimeError('boom')", "stop_reason": None}  # fmt: skip
    path.write_text(json.dumps(record) + "\n")
    (ended,) = load_events(path)
    assert isinstance(ended, ev.FitEnded) and isinstance(ended.error, ev.RecordedError)
    assert "boom" in str(ended.error)
    path.write_text(json.dumps({**record, "v": 99}) + "\n")
    with pytest.raises(ConfigError, match="99"):
        list(load_events(path))
    with pytest.raises(ConfigError, match=r"^path="):
        replay(tmp_path / "missing.jsonl")


def test_a_line_that_is_not_json_is_a_config_error_naming_the_line(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    first = {"v": 1, "type": "EpochStarted", "step": 0, "epoch": 0, "time": 1.0}
    path.write_text(json.dumps(first) + "\n{truncated\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}:2: line="):
        list(load_events(path))

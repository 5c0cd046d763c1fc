"""EvaluateCheckpoints: real runs, real subprocesses, results back on the bus."""

from __future__ import annotations

import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import anyio
import pytest

from trainbus import ConfigError
from trainbus import events as ev
from trainbus.callbacks import Checkpointing, EarlyStopping, EvaluateCheckpoints, EvaluationJobError
from trainbus.testing import EventRecorder

PY = sys.executable


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"run": "python eval.py"}, "run"),
        ({"run": []}, "run"),
        ({"run": [1, 2]}, "run"),
        ({"run": lambda e: {}}, "run"),  # not async
        ({"run": ["x"], "concurrency": 0}, "concurrency"),
        ({"run": ["x"], "timeout": -1}, "timeout"),
        ({"run": ["x"], "buffer": 0}, "buffer"),
    ],
)
def test_invalid_arguments_name_the_argument(kwargs: dict[str, Any], name: str) -> None:
    with pytest.raises(ConfigError, match=f"^{name}="):
        EvaluateCheckpoints(**kwargs)


def test_command_runs_on_every_checkpoint_and_reports_on_the_bus(
    trainer_factory: Any, tmp_path: Path
) -> None:
    # The job prints a log line, then its metrics (JSON on the last line), derived from the
    # checkpoint path it was given: proof that {checkpoint} and {step} were substituted.
    script = (
        "import json, os, sys; print('loading', sys.argv[1]); "
        "print(json.dumps({'ext_size': os.path.getsize(sys.argv[1]), "
        "'ext_step': int(sys.argv[2])}))"
    )
    evaluate = EvaluateCheckpoints([PY, "-c", script, "{checkpoint}", "{step}"], concurrency=2)
    trainer = trainer_factory(
        [Checkpointing(every_epochs=1), evaluate], epochs=2, batches=3, checkpoint_dir=tmp_path
    )
    recorder = EventRecorder(trainer.bus, trainer.bus.stream(ev.CheckpointSaved))
    result = trainer.fit_sync()
    assert result.reason == "completed"
    saved = recorder.of_type(ev.CheckpointSaved)
    # Every started job ended before fit() returned (the bus drains async subscribers).
    assert sorted(r.checkpoint for r in evaluate.results) == sorted(e.path for e in saved)
    for r in evaluate.results:
        assert r.error is None
        assert r.metrics["ext_size"] == Path(r.checkpoint).stat().st_size
        assert r.metrics["ext_step"] == r.step


def test_results_are_published_while_training_goes_on(trainer_factory: Any, tmp_path: Path) -> None:
    evaluate = EvaluateCheckpoints([PY, "-c", "print('{\"ext\": 1.5}')"])
    trainer = trainer_factory(
        [Checkpointing(every_epochs=1), evaluate], epochs=4, batches=3, checkpoint_dir=tmp_path
    )
    recorder = EventRecorder(trainer.bus)
    # Training holds its last epoch (at most 60 s) until a result is delivered: whether the
    # evaluation process ends before 12 tiny steps do is not the question (on a fast GPU host
    # under load it did not); whether results reach the bus while the run goes on is.
    first = threading.Event()
    trainer.bus.stream(ev.ExternalEvaluationEnded).subscribe(lambda e: first.set())
    waited: list[bool] = []

    def hold(ctx: Any) -> None:
        if ctx.step == 10:  # checkpoints at steps 3, 6 and 9 (4 epochs of 3 steps)
            waited.append(first.wait(60))

    trainer.add_hook("after_optimizer_step", hold)
    trainer.fit_sync()
    assert waited == [True], "no result was delivered on the bus during the run"
    delivered = recorder.of_type(ev.ExternalEvaluationEnded)
    assert all(e.metrics == {"ext": 1.5} and e.error is None for e in delivered)
    names = recorder.names()
    assert names.index("ExternalEvaluationEnded") < names.index("FitEnded")


def test_failing_commands_are_reported_and_training_goes_on(
    trainer_factory: Any, tmp_path: Path
) -> None:
    failing = EvaluateCheckpoints(
        [PY, "-c", "import sys; sys.stderr.write('boom: no GPU here\\n'); sys.exit(3)"]
    )
    no_json = EvaluateCheckpoints([PY, "-c", "print('accuracy is good')"])
    trainer = trainer_factory(
        [Checkpointing(every_epochs=1), failing, no_json], epochs=2, batches=3,
        checkpoint_dir=tmp_path,
    )  # fmt: skip
    result = trainer.fit_sync()
    assert result.reason == "completed" and result.steps == 6
    assert failing.results and no_json.results
    for r in failing.results:
        assert isinstance(r.error, EvaluationJobError)
        assert r.error.returncode == 3
        assert "boom: no GPU here" in r.error.stderr and "boom: no GPU here" in str(r.error)
        assert r.metrics == {}
    for r in no_json.results:
        assert isinstance(r.error, EvaluationJobError)
        assert "no JSON" in str(r.error) and "accuracy is good" in str(r.error)


def test_timeout_kills_the_job_and_reports_it(trainer_factory: Any, tmp_path: Path) -> None:
    evaluate = EvaluateCheckpoints([PY, "-c", "import time; time.sleep(60)"], timeout=0.3)
    trainer = trainer_factory([evaluate], epochs=1, batches=2, checkpoint_dir=tmp_path)
    result = trainer.fit_sync()  # the final checkpoint starts one job; fit() waits for its timeout
    assert result.reason == "completed"
    (r,) = evaluate.results
    assert isinstance(r.error, EvaluationJobError) and "timed out" in str(r.error)


def test_async_function_job(trainer_factory: Any, tmp_path: Path) -> None:
    seen: list[str] = []

    async def score(event: ev.CheckpointSaved) -> Mapping[str, float]:
        await anyio.sleep(0.01)
        seen.append(event.path)
        return {"ext_loss": float(event.step)}

    evaluate = EvaluateCheckpoints(score)
    trainer = trainer_factory(
        [Checkpointing(every_epochs=1), evaluate], epochs=2, batches=2, checkpoint_dir=tmp_path
    )
    trainer.fit_sync()
    assert seen and [r.checkpoint for r in evaluate.results] == seen
    assert all(r.metrics == {"ext_loss": float(r.step)} for r in evaluate.results)


def test_early_stopping_acts_on_external_results(trainer_factory: Any, tmp_path: Path) -> None:
    # The job's metric never improves after the first checkpoint: EarlyStopping(patience=1)
    # stops the run on the second result, long before the 30 planned epochs end (no loop
    # evaluation: its EvaluationEnded would lack ext_loss, which fails EarlyStopping loudly).
    async def flat(event: ev.CheckpointSaved) -> Mapping[str, float]:
        return {"ext_loss": 1.0}

    trainer = trainer_factory(
        [Checkpointing(every_epochs=1), EvaluateCheckpoints(flat),
         EarlyStopping(monitor="ext_loss", patience=1)],
        epochs=30, batches=2, checkpoint_dir=tmp_path, eval_data=None,
    )  # fmt: skip
    result = trainer.fit_sync()
    assert result.reason == "stopped"
    assert result.stop_reason is not None and "ext_loss" in result.stop_reason
    assert result.steps < 60


def test_checkpointing_marks_the_evaluated_checkpoint_as_best(
    trainer_factory: Any, tmp_path: Path
) -> None:
    # The job scores each epoch's checkpoint; the best one (epoch 2 of 3) is copied as
    # step-<its step>-best.pt, byte for byte: never the weights current when the result came.
    scores = {2: 0.5, 4: 0.2, 6: 0.9}

    async def score(event: ev.CheckpointSaved) -> Mapping[str, float]:
        return {"ext_loss": scores[event.step]}

    trainer = trainer_factory(
        [Checkpointing(every_epochs=1, monitor="ext_loss"), EvaluateCheckpoints(score)],
        epochs=3, batches=2, checkpoint_dir=tmp_path, eval_data=None,
    )  # fmt: skip
    trainer.fit_sync()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [
        "step-00000002-best.pt", "step-00000002.pt", "step-00000004-best.pt",
        "step-00000004.pt", "step-00000006.pt",
    ]  # fmt: skip
    for step in (2, 4):
        best = tmp_path / f"step-{step:08d}-best.pt"
        assert best.read_bytes() == (tmp_path / f"step-{step:08d}.pt").read_bytes()

"""trainbus.operators: selection, decisions (patience, plateau) and spans, on plain Rx sources."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import reactivex
from hypothesis import given
from hypothesis import strategies as st
from reactivex import Observable
from reactivex.subject import Subject

from trainbus import ConfigError
from trainbus import commands as cmd
from trainbus import events as ev
from trainbus import operators as tbops


class Sink:
    """Observer recording items, the error and completion."""

    def __init__(self) -> None:
        self.items: list[Any] = []
        self.error: Exception | None = None
        self.completed = False

    def __call__(self, source: Observable[Any]) -> Sink:
        source.subscribe(self.items.append, self._on_error, self._on_completed)
        return self

    def _on_error(self, error: Exception) -> None:
        self.error = error

    def _on_completed(self) -> None:
        self.completed = True


def run(source: Sequence[Any], *operators: Callable[[Observable[Any]], Observable[Any]]) -> Sink:
    return Sink()(reactivex.from_iterable(source).pipe(*operators))


def evals(*values: float, key: str = "val_loss") -> list[ev.EvaluationEnded]:
    return [ev.EvaluationEnded(step=i, epoch=0, metrics={key: v}) for i, v in enumerate(values)]


def step(i: int) -> ev.StepEnded:
    return ev.StepEnded(step=i, epoch=0, loss=1.0, lr=0.1, grad_norm=None, samples=1, duration_s=0)


# ----------------------------------------------------------------------------- of_type
def test_of_type_keeps_instances_in_order() -> None:
    items = [step(1), "x", ev.EpochStarted(step=1, epoch=1), step(2), 3]
    out = run(items, tbops.of_type(ev.StepEnded))
    assert out.items == [items[0], items[3]] and out.completed
    out = run(items, tbops.of_type(ev.StepEnded, ev.EpochStarted))
    assert out.items == [items[0], items[2], items[3]]
    assert run(items, tbops.of_type(ev.BaseEvent)).items == [items[0], items[2], items[3]]


@pytest.mark.parametrize("bad", [(), (ev.StepEnded, "x"), (3,)])
def test_of_type_rejects_non_classes(bad: tuple[Any, ...]) -> None:
    with pytest.raises(ConfigError, match=r"^types="):
        tbops.of_type(*bad)


# ----------------------------------------------------------------------------- every
@given(st.lists(st.integers(min_value=0, max_value=1000)), st.integers(min_value=1, max_value=10))
def test_every_keeps_the_steps_that_are_multiples_of_n(steps: list[int], n: int) -> None:
    out = run([step(k) for k in steps], tbops.every(n))
    assert [e.step for e in out.items] == [k for k in steps if k % n == 0]
    assert out.completed


def test_every_is_step_based_not_counting_items() -> None:
    # A resumed run starts at step 7; a skipped step 9 does not shift the cadence.
    subject: Subject[Any] = Subject()
    first = Sink()(subject.pipe(tbops.every(2)))
    for k in (7, 8, 10, 11, 12):
        subject.on_next(step(k))
    assert [e.step for e in first.items] == [8, 10, 12]


def test_every_and_once_at_carry_their_decision_steps() -> None:
    from trainbus._bus.commands import At, Every

    assert tbops.every(5).decision_steps == Every(5)
    assert getattr(tbops.once(at=3), "decision_steps", None) == At(3)
    assert getattr(tbops.once(), "decision_steps", None) is None


def test_every_errors_on_an_item_without_a_step() -> None:
    out = run([1, 2], tbops.every(2))
    assert isinstance(out.error, ConfigError) and "step" in str(out.error)


@pytest.mark.parametrize("n", [0, -1, 1.5, True, "2"])
def test_every_rejects_bad_n(n: Any) -> None:
    with pytest.raises(ConfigError, match=r"^n="):
        tbops.every(n)


# ----------------------------------------------------------------------------- once
def test_once_none_takes_the_first_item() -> None:
    out = run([5, 6, 7], tbops.once())
    assert out.items == [5] and out.completed


def test_once_at_step() -> None:
    out = run([step(1), step(3), step(4), step(5)], tbops.once(at=3))
    assert [e.step for e in out.items] == [3] and out.completed
    out = run([step(1), step(7)], tbops.once(at=4))
    assert [e.step for e in out.items] == [7]


def test_once_with_predicate() -> None:
    out = run([1, 2, 3, 4], tbops.once(lambda x: x % 2 == 0))
    assert out.items == [2] and out.completed


@pytest.mark.parametrize("at", [None, 100, lambda e: False])
def test_once_without_a_match_just_completes(at: Any) -> None:
    # A run can end before the step is reached: that is not an error of the subscriber.
    source: list[Any] = [] if at is None else [step(1), step(2)]
    out = run(source, tbops.once(at))
    assert out.items == [] and out.completed and out.error is None


@pytest.mark.parametrize("at", [-1, "3", 1.5])
def test_once_rejects_bad_at(at: Any) -> None:
    with pytest.raises(ConfigError, match=r"^at="):
        tbops.once(at)


# ----------------------------------------------------------------------------- metric
def test_metric_maps_and_skips() -> None:
    items = [
        ev.EvaluationEnded(step=1, epoch=0, metrics={"loss": 2}),
        ev.MetricsLogged(step=2, epoch=0, metrics={"acc": 1.0}),
        step(3),
        ev.MetricsLogged(step=4, epoch=0, metrics={"loss": 1.0}),
    ]
    out = run(items, tbops.metric("loss"))
    assert out.items == [2.0, 1.0] and all(type(v) is float for v in out.items)


@pytest.mark.parametrize("name", ["", None, 3])
def test_metric_rejects_bad_name(name: Any) -> None:
    with pytest.raises(ConfigError, match=r"^metric="):
        tbops.metric(name)


# ----------------------------------------------------------------------------- patience
def expected_stop(
    values: Sequence[float], patience: int, mode: str, min_delta: float
) -> int | None:
    """Index of the evaluation that triggers early stopping (reference model)."""
    best: float | None = None
    bad = 0
    for i, v in enumerate(values):
        better = not math.isnan(v) and (
            best is None or (v < best - min_delta if mode == "min" else v > best + min_delta)
        )
        best, bad = (v, 0) if better else (best, bad + 1)
        if bad >= patience:
            return i
    return None


def stops(values: Sequence[float], **kwargs: Any) -> tuple[list[int], Sink]:
    out = run(evals(*values), tbops.patience("val_loss", **kwargs))
    for c in out.items:
        assert isinstance(c, cmd.StopTraining)
    return [int(c.reason.rsplit("step ", 1)[1].rstrip(")")) for c in out.items], out


def test_patience_stops_after_patience_non_improving_evaluations() -> None:
    steps, out = stops([3, 2, 2, 2, 2, 1, 1, 1], patience=3)
    assert steps == [4]  # exactly one command, on the third non-improving evaluation
    assert out.completed
    assert "val_loss" in out.items[0].reason and "3 evaluations" in out.items[0].reason


def test_patience_resets_on_improvement() -> None:
    assert stops([3, 3, 2, 2, 1, 1, 1], patience=2)[0] == [6]
    assert stops([3, 2, 1, 0], patience=1)[0] == []


def test_patience_mode_max() -> None:
    assert stops([0.5, 0.6, 0.6, 0.7, 0.7, 0.7], mode="max", patience=2)[0] == [5]
    assert stops([0.5, 0.6, 0.7], mode="max", patience=1)[0] == []


def test_patience_and_plateau_read_the_direction_from_the_metrics_name() -> None:
    """``mode="auto"`` (the default), as the monitoring callbacks: an accuracy rising then flat
    stops only after the flat evaluations; a loss rising stops at once."""
    rising = evals(0.5, 0.6, 0.7, 0.7, 0.7, key="val_acc")
    stopped = run(rising, tbops.patience("val_acc", patience=2))
    assert len(stopped.items) == 1
    assert "best 0.7 at step 2" in stopped.items[0].reason
    assert len(run(evals(1.0, 2.0, 3.0), tbops.patience("val_loss", patience=2)).items) == 1
    assert (
        run(evals(0.5, 0.6, 0.7, key="val_acc"), tbops.plateau("val_acc", patience=1)).items == []
    )


def test_patience_min_delta() -> None:
    # 0.95 improves on 1.0 by less than min_delta: it does not count.
    assert stops([1.0, 0.95, 0.92], patience=2, min_delta=0.1)[0] == [2]
    assert stops([1.0, 0.85, 0.7], patience=2, min_delta=0.1)[0] == []


def test_patience_nan_never_improves() -> None:
    assert stops([1.0, math.nan, math.nan], patience=2)[0] == [2]
    assert stops([math.nan, math.nan], patience=2)[0] == [1]
    assert stops([1.0, math.nan, 0.5, math.nan], patience=2)[0] == []


@given(
    st.lists(st.one_of(st.floats(-10, 10), st.just(math.nan)), max_size=30),
    st.integers(1, 5),
    st.sampled_from(["min", "max"]),
    st.sampled_from([0.0, 0.5]),
)
def test_patience_matches_reference(values: list[float], p: int, mode: str, delta: float) -> None:
    expected = expected_stop(values, p, mode, delta)
    got, out = stops(values, patience=p, mode=mode, min_delta=delta)
    assert got == ([] if expected is None else [expected])
    assert out.completed


def test_patience_missing_metric_errors_the_stream() -> None:
    out = run(
        [ev.EvaluationEnded(step=1, epoch=0, metrics={"acc": 1.0})], tbops.patience("val_loss")
    )
    assert isinstance(out.error, ConfigError) and "val_loss" in str(out.error)
    out = run([step(1)], tbops.patience("val_loss"))
    assert isinstance(out.error, ConfigError) and "StepEnded" in str(out.error)


def test_patience_state_is_per_subscription() -> None:
    subject: Subject[ev.EvaluationEnded] = Subject()
    pipeline = subject.pipe(tbops.patience("val_loss", patience=2))
    a = Sink()(pipeline)
    for e in evals(1.0, 1.0):
        subject.on_next(e)
    b = Sink()(pipeline)
    subject.on_next(evals(1.0)[0])
    assert len(a.items) == 1  # a saw 1, 1, 1
    assert b.items == []  # b saw only one evaluation


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"patience": 0}, "patience"),
        ({"patience": 1.5}, "patience"),
        ({"mode": "best"}, "mode"),
        ({"min_delta": -1}, "min_delta"),
        ({"min_delta": math.nan}, "min_delta"),
    ],
)
def test_patience_rejects_bad_arguments(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{field}="):
        tbops.patience("val_loss", **kwargs)
    with pytest.raises(ConfigError, match=r"^metric="):
        tbops.patience("")


# ----------------------------------------------------------------------------- plateau
def reductions(values: Sequence[float], **kwargs: Any) -> tuple[list[int], Sink]:
    subject: Subject[ev.EvaluationEnded] = Subject()
    at: list[int] = []
    out = Sink()
    current = [-1]
    subject.pipe(tbops.plateau("val_loss", **kwargs)).subscribe(
        lambda c: (out.items.append(c), at.append(current[0])),
        out._on_error,
        out._on_completed,
    )
    for i, e in enumerate(evals(*values)):
        current[0] = i
        subject.on_next(e)
    return at, out


def test_plateau_scales_the_learning_rate() -> None:
    at, out = reductions([3, 2, 2, 2, 2, 2], patience=2, factor=0.5)
    assert at == [3, 5]  # the marble diagram of the docstring
    assert out.items == [cmd.ScaleLearningRate(factor=0.5)] * 2


def test_plateau_cooldown() -> None:
    at, _ = reductions([3] * 7, patience=2, cooldown=1)
    assert at == [2, 5]
    at, _ = reductions([3] * 7, patience=2, cooldown=0)
    assert at == [2, 4, 6]


def test_plateau_improvement_during_cooldown_updates_best() -> None:
    # Reduction at index 2; index 3 falls in the cooldown but improves the best to 1, so 4 and 5
    # are the two non-improving evaluations (were the best still 3, index 4 would improve).
    at, _ = reductions([3, 3, 3, 1, 1, 1, 1], patience=2, cooldown=1)
    assert at == [2, 5]


def test_plateau_max_reductions_completes() -> None:
    at, out = reductions([3] * 10, patience=1, max_reductions=2)
    assert at == [1, 2] and out.completed


def test_plateau_mode_max_and_min_delta() -> None:
    at, _ = reductions([0.5, 0.55, 0.58], mode="max", patience=2, min_delta=0.1)
    assert at == [2]


def test_plateau_state_is_per_subscription() -> None:
    op = tbops.plateau("val_loss", patience=2)
    s1: Subject[ev.EvaluationEnded] = Subject()
    s2: Subject[ev.EvaluationEnded] = Subject()
    a, b = Sink()(s1.pipe(op)), Sink()(s2.pipe(op))
    for e in evals(1, 1, 1):
        s1.on_next(e)
    s2.on_next(evals(1)[0])
    assert len(a.items) == 1 and b.items == []


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"factor": 1.0}, "factor"),
        ({"factor": 0}, "factor"),
        ({"factor": "0.5"}, "factor"),
        ({"patience": 0}, "patience"),
        ({"cooldown": -1}, "cooldown"),
        ({"max_reductions": 0}, "max_reductions"),
        ({"mode": "up"}, "mode"),
        ({"min_delta": -0.1}, "min_delta"),
    ],
)
def test_plateau_rejects_bad_arguments(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{field}="):
        tbops.plateau("val_loss", **kwargs)


# ----------------------------------------------------------------------------- spans
def test_span_durations_pairs_start_and_end() -> None:
    items = [
        ev.EpochStarted(step=0, epoch=0, time=0.0),
        ev.EvalBatchStarted(step=0, epoch=0, batch_index=0, time=1.0),
        ev.EvalBatchEnded(step=0, epoch=0, batch_index=0, loss=1.0, samples=1, time=1.5),
        ev.EvalBatchStarted(step=1, epoch=0, batch_index=1, time=2.0),
        ev.EvalBatchEnded(step=1, epoch=0, batch_index=1, loss=1.0, samples=1, time=2.25),
        ev.EpochEnded(step=2, epoch=0, batches=2, time=3.0),
    ]
    out = run(items, tbops.span_durations(ev.EvalBatchStarted))
    assert [s.duration_s for s in out.items] == [0.5, 0.25]
    assert [(s.start, s.end) for s in out.items] == [(items[1], items[2]), (items[3], items[4])]
    assert out.completed
    out = run(items, tbops.span_durations(ev.EpochStarted))
    assert [s.duration_s for s in out.items] == [3.0]


def test_span_durations_explicit_end_and_unmatched_end() -> None:
    items = [
        step(0),  # an end with no start: ignored
        ev.EpochStarted(step=0, epoch=0, time=1.0),
        ev.StepEnded(
            step=1, epoch=0, loss=1, lr=0, grad_norm=None, samples=1, duration_s=0, time=4
        ),
    ]
    out = run(items, tbops.span_durations(ev.EpochStarted, ev.StepEnded))
    assert [s.duration_s for s in out.items] == [3.0]


def test_span_durations_rejects_bad_arguments() -> None:
    with pytest.raises(ConfigError, match=r"^start="):
        tbops.span_durations(ev.StepEnded)
    with pytest.raises(ConfigError, match=r"^end="):
        tbops.span_durations(ev.EvalBatchStarted, int)  # type: ignore[arg-type]


def test_span_durations_of_every_kind_in_virtual_time() -> None:
    from trainbus import EventBus
    from trainbus.testing import EventRecorder, VirtualTimeScheduler

    vts = VirtualTimeScheduler()
    bus = EventBus(rx_scheduler=vts)
    rec = EventRecorder(bus, bus.events.pipe(tbops.span_durations()))
    timeline = [
        (0.0, ev.EvalBatchStarted(step=0, epoch=0, batch_index=0, time=0.0)),
        (0.5, ev.EvalBatchEnded(step=0, epoch=0, batch_index=0, loss=1.0, samples=1, time=0.5)),
        (0.6, ev.PredictionStarted(step=0, epoch=0, batches=1, time=0.6)),
        (1.6, ev.PredictionEnded(step=0, epoch=0, batches=1, time=1.6)),
        (2.0, ev.PredictionEnded(step=0, epoch=0, batches=1, time=2.0)),  # no start: dropped
    ]  # fmt: skip
    for at, event in timeline:
        vts.schedule_absolute(at, lambda _s, _st, e=event: (bus.publish(e), bus.flush()))
    vts.advance_by(1.0)
    assert [(type(s.start).__name__, s.duration_s) for s in rec.items] == [
        ("EvalBatchStarted", 0.5)
    ]
    vts.advance_by(2.0)
    assert [(type(s.end).__name__, s.duration_s) for s in rec.items] == [
        ("EvalBatchEnded", 0.5),
        ("PredictionEnded", pytest.approx(1.0)),
    ]
    with pytest.raises(ConfigError, match=r"^end="):
        tbops.span_durations(None, ev.EvalBatchEnded)


def test_threshold_operator() -> None:
    items = [ev.MetricsLogged(step=i, epoch=0, metrics={"loss": v}) for i, v in
             enumerate([3.0, float("nan"), 2.0, 0.5, 0.1], 1)]  # fmt: skip
    out = run(items, tbops.threshold("loss", below=1.0))
    (stop,) = out.items
    assert stop.reason == "threshold: loss=0.5 went below 1 at step 4" and out.completed
    assert run(items, tbops.threshold("loss", above=10, below=0.01)).items == []
    missing = run(items, tbops.threshold("acc", above=0.5))
    assert isinstance(missing.error, ConfigError) and "metric='acc'" in str(missing.error)
    assert "['loss']" in str(missing.error)
    with pytest.raises(ConfigError, match=r"^above="):
        tbops.threshold("loss")


def test_tracker_keeps_the_best_values_step_across_its_state() -> None:
    tracker = tbops.Tracker()
    assert tracker.update(3.0, mode="min", min_delta=0.0, step=2)
    assert not tracker.update(4.0, mode="min", min_delta=0.0, step=4)
    assert (tracker.best, tracker.best_step, tracker.bad) == (3.0, 2, 1)
    restored = tbops.Tracker()
    restored.load_state_dict(tracker.state_dict())
    assert (restored.best, restored.best_step, restored.bad) == (3.0, 2, 1)
    # A state saved before the step was kept loads with the step unknown.
    restored.load_state_dict({"best": 1.0, "bad": 0, "cooling": 0, "reductions": 0})
    assert (restored.best, restored.best_step) == (1.0, None)


@pytest.mark.parametrize(
    ("decide", "stop_at"),
    [
        pytest.param(lambda: tbops.patience("test/score", patience=1), 4, id="patience"),
        pytest.param(lambda: tbops.threshold("test/score", below=0.5), 2, id="threshold"),
    ],
)
def test_a_named_sets_metric_in_a_users_pipeline_reads_only_that_set(
    decide: Any, stop_at: int
) -> None:
    """The README's pipeline on a run with named evaluation sets: the "val" set's evaluations,
    which lack test/score, are skipped (they were a ConfigError that killed the pipeline and
    left the run to train on), and the stop lands on the test set's evaluation."""
    import torch
    import torch.nn.functional as F

    from trainbus import EvalSchedule, Trainer
    from trainbus.testing import tiny_loader, tiny_model

    model = tiny_model()
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        tiny_loader(20),
        loss_fn=F.cross_entropy,
        eval_data={"val": tiny_loader(1, seed=1), "test": tiny_loader(1, seed=2)},
        metrics={"score": lambda outputs, targets: 0.1},
        eval_schedule=EvalSchedule(every_steps=2),
        max_steps=20,
        progress=False,
    )
    bus = trainer.bus
    bus.stream(ev.EvaluationEnded).pipe(decide()).subscribe(bus.commands)
    result = trainer.fit_sync()
    assert result.reason == "stopped", result
    assert result.steps == stop_at and result.subscriber_failures == {}

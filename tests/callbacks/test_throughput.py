"""ThroughputMonitor: steps/s, samples/s and data wait per buffer_with_time window."""

from __future__ import annotations

from typing import Any

import pytest
from structlog.testing import capture_logs

from trainbus import ConfigError, EventBus
from trainbus import events as ev
from trainbus.callbacks import ThroughputMonitor
from trainbus.testing import VirtualTimeScheduler


@pytest.mark.parametrize("window_s", [0, -2.0, float("inf"), None, "5"])
def test_rejects_bad_window(window_s: Any) -> None:
    with pytest.raises(ConfigError, match=r"^window_s="):
        ThroughputMonitor(window_s=window_s)
    with pytest.raises(ConfigError, match=r"^log="):
        ThroughputMonitor(log="yes")  # type: ignore[arg-type]


def test_figures_per_window(vbus: EventBus, vts: VirtualTimeScheduler, step_event: Any) -> None:
    monitor = ThroughputMonitor(window_s=1.0)
    monitor.setup(vbus)
    t0 = 100.0

    def steps(first: int, last: int) -> None:
        for i in range(first, last + 1):
            # Steps end every 0.1 s and each took 0.1 s, 32 samples, alternately 0.01 s and
            # 0.03 s of it waiting for data. Other events in the stream are not counted.
            vbus.publish(ev.SpanTraced(step=i - 1, epoch=0, span="data_wait", started=0.0,
                                       ended=9.0, batch_index=0))  # fmt: skip
            vbus.publish(step_event(i, time=t0 + 0.1 * i, duration_s=0.1, samples=32,
                                    data_wait_s=0.01 if i % 2 else 0.03))  # fmt: skip
        vbus.flush()

    with capture_logs() as logs:
        steps(1, 4)
        assert monitor.last is None  # the window is still open
        vts.advance_by(1.0)
        first = monitor.last
        assert first is not None
        assert (first.step, first.steps, first.samples) == (4, 4, 128)
        # From the start of step 1 (t0 + 0.1 - 0.1) to the end of step 4 (t0 + 0.4).
        assert first.elapsed_s == pytest.approx(0.4)
        assert first.steps_per_s == pytest.approx(10.0)
        assert first.samples_per_s == pytest.approx(320.0)
        assert first.data_wait_s == pytest.approx(0.02)
        assert first.data_wait_fraction == pytest.approx(0.2)
        vts.advance_by(1.0)  # an empty window: no figures, no line
        assert monitor.last is first
        steps(5, 10)
        vts.advance_by(1.0)
    second = monitor.last
    assert second is not None and second.steps == 6
    assert second.elapsed_s == pytest.approx(0.6)  # from the end of step 4
    assert second.steps_per_s == pytest.approx(10.0)
    lines = [x for x in logs if x["event"] == "throughput"]
    assert [x["step"] for x in lines] == [4, 10]
    assert lines[0]["steps_per_s"] == pytest.approx(10.0)
    assert set(lines[0]) >= {"step", "epoch", "steps_per_s", "samples_per_s", "data_wait_s"}


def test_in_a_run_every_step_is_counted_once(trainer_factory: Any) -> None:
    monitor = ThroughputMonitor(window_s=0.05)
    with capture_logs() as logs:
        result = trainer_factory([monitor], epochs=3, batches=5).fit_sync()
    windows = [x for x in logs if x["event"] == "throughput"]
    # The last, partial window is emitted when the bus completes at the end of the run.
    assert sum(x["steps"] for x in windows) == result.steps == 15
    assert windows[-1]["step"] == 15
    assert monitor.last is not None and monitor.last.step == 15 and monitor.last.steps_per_s > 0
    # Every window reports the data wait its steps carried (a list loader waits ~0 s).
    assert all(0 <= x["data_wait_s"] and 0 <= x["data_wait_fraction"] < 1 for x in windows)

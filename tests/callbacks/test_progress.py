"""Progress: throttled display on the loop thread, set to the event's step, tqdm or log lines."""

from __future__ import annotations

import re
import sys
import threading
from typing import Any, ClassVar

import pytest
from structlog.testing import capture_logs

from trainbus import ConfigError, EventBus
from trainbus import events as ev
from trainbus.callbacks import Progress
from trainbus.testing import VirtualTimeScheduler


def fit_started(max_steps: int | None = 100, max_epochs: int | None = None) -> ev.FitStarted:
    return ev.FitStarted(step=0, epoch=0, max_steps=max_steps, max_epochs=max_epochs, device="cpu")


def publish_steps(bus: EventBus, steps: range, step_event: Any) -> None:
    for i in steps:
        bus.publish(step_event(i, loss=float(i) / 10))
    bus.flush()


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"refresh_s": 0}, "refresh_s"),
        ({"refresh_s": -1.0}, "refresh_s"),
        ({"refresh_s": float("inf")}, "refresh_s"),
        ({"refresh_s": "fast"}, "refresh_s"),
        ({"refresh_s": True}, "refresh_s"),
        ({"bar": "yes"}, "bar"),
        ({"bar": 1}, "bar"),
        ({"desc": 3}, "desc"),
    ],
)
def test_invalid_arguments_name_the_argument(kwargs: dict[str, Any], name: str) -> None:
    with pytest.raises(ConfigError, match=f"^{name}="):
        Progress(**kwargs)


def test_bar_follows_the_latest_step_and_draws_its_last_line_once(
    vbus: EventBus, vts: VirtualTimeScheduler, step_event: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    progress = Progress(refresh_s=1.0, bar=True)
    progress.setup(vbus)
    vbus.publish(fit_started(max_steps=100))
    publish_steps(vbus, range(1, 41), step_event)  # 40 steps inside one refresh period
    bar = progress.bar
    assert bar is not None and bar.total == 100
    assert bar.n == 0  # nothing drawn before the period ends
    vts.advance_by(1.0)
    assert bar.n == 40 and progress.step == 40  # the latest step of the period, not the first
    assert "loss=4" in capsys.readouterr().err  # step 40's loss (4.0), not step 1's (0.1)
    publish_steps(vbus, range(41, 47), step_event)
    vbus.publish(ev.FitEnded(step=46, epoch=0, reason="completed"))
    vbus.flush()
    assert bar.n == 46 and bar.disable  # the last step is shown, then the bar is closed
    err = capsys.readouterr().err
    assert err.count("46/100") == 1, err  # the last line is drawn once
    assert "loss=4.6" in err  # ... with step 46's loss, not a stale one


def test_log_lines_are_current_and_the_last_line_is_not_repeated(
    vbus: EventBus, vts: VirtualTimeScheduler, step_event: Any
) -> None:
    progress = Progress(refresh_s=0.5, bar=False)
    progress.setup(vbus)
    with capture_logs() as logs:
        vbus.publish(fit_started(max_steps=30))
        publish_steps(vbus, range(1, 11), step_event)
        vts.advance_by(0.5)
        publish_steps(vbus, range(11, 21), step_event)
        vts.advance_by(0.5)
        vbus.publish(ev.FitEnded(step=20, epoch=0, reason="completed"))
        vbus.flush()
    assert progress.bar is None
    lines = [x for x in logs if x["event"] == "progress"]
    assert [x["step"] for x in lines] == [10, 20]  # step 20 logged once, not again at the end
    assert lines[1]["loss"] == pytest.approx(2.0) and lines[1]["total_steps"] == 30
    assert lines[1]["epoch"] == 0 and lines[1]["lr"] == 0.1
    assert lines[1]["steps_per_s"] is not None and lines[1]["steps_per_s"] > 0
    assert lines[1]["remaining_s"] == pytest.approx(10 / lines[1]["steps_per_s"])


def test_fit_ended_shows_the_latest_values_when_no_sample_fell_due(
    vbus: EventBus, step_event: Any
) -> None:
    progress = Progress(refresh_s=10.0, bar=False)
    progress.setup(vbus)
    with capture_logs() as logs:
        vbus.publish(fit_started(max_steps=None, max_epochs=None))
        publish_steps(vbus, range(1, 47), step_event)
        vbus.publish(ev.FitEnded(step=46, epoch=0, reason="completed"))
        vbus.flush()
    (line,) = [x for x in logs if x["event"] == "progress"]
    assert line["step"] == 46 and line["loss"] == pytest.approx(4.6)  # not step 1's 0.1


def test_without_tqdm_it_falls_back_to_log_lines(
    monkeypatch: pytest.MonkeyPatch, vbus: EventBus, vts: VirtualTimeScheduler, step_event: Any
) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)  # `import tqdm` now raises ImportError
    with pytest.raises(ConfigError, match=r"^bar=True.*tqdm is not installed"):
        Progress(bar=True).setup(EventBus())
    progress = Progress()
    progress.setup(vbus)
    with capture_logs() as logs:
        vbus.publish(fit_started())
        publish_steps(vbus, range(1, 3), step_event)
        vts.advance_by(progress.refresh_s)
    assert progress.bar is None
    assert [x["step"] for x in logs if x["event"] == "progress"] == [2]


def test_total_is_estimated_from_the_first_epoch(
    vbus: EventBus, vts: VirtualTimeScheduler, step_event: Any
) -> None:
    progress = Progress(bar=True)
    progress.setup(vbus)
    vbus.publish(fit_started(max_steps=None, max_epochs=3))
    vbus.publish(ev.EpochStarted(step=0, epoch=0))
    publish_steps(vbus, range(1, 5), step_event)
    assert progress.total_steps is None and progress.bar.total is None
    vbus.publish(ev.EpochEnded(step=4, epoch=0, batches=4))
    vbus.flush()
    assert progress.total_steps == 12 and progress.bar.total == 12
    assert progress.bar.n == 4  # EpochEnded shows its step too


def test_total_is_known_from_the_start_with_steps_per_epoch(
    vbus: EventBus, vts: VirtualTimeScheduler, step_event: Any
) -> None:
    progress = Progress(bar=True, refresh_s=0.1)
    progress.setup(vbus)
    vbus.publish(ev.FitStarted(step=0, epoch=0, max_steps=None, max_epochs=3, device="cpu",
                               steps_per_epoch=4))  # fmt: skip
    vbus.publish(ev.EpochStarted(step=0, epoch=0))
    publish_steps(vbus, range(1, 3), step_event)
    vts.advance_by(0.1)
    assert progress.total_steps == 12 and progress.bar.total == 12 and progress.bar.n == 2
    # max_steps below max_epochs x steps_per_epoch wins
    other = Progress(bar=False)
    other.setup(vbus)
    vbus.publish(ev.FitStarted(step=0, epoch=0, max_steps=5, max_epochs=3, device="cpu",
                               steps_per_epoch=4))  # fmt: skip
    vbus.flush()
    assert other.total_steps == 5


class _FakeBar:
    """Stands in for tqdm.tqdm: records each call with the thread it ran on."""

    instances: ClassVar[list[_FakeBar]] = []

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.total = kwargs["total"]
        self.n = kwargs["initial"]
        self.calls: list[tuple[str, int]] = [("init", threading.get_ident())]
        self.closed = False
        _FakeBar.instances.append(self)

    def set_postfix(self, postfix: dict[str, Any], refresh: bool = True) -> None:
        self.calls.append(("set_postfix", threading.get_ident()))

    def update(self, n: int) -> None:
        self.calls.append(("update", threading.get_ident()))
        self.n += n

    def refresh(self) -> None:
        self.calls.append(("refresh", threading.get_ident()))

    def close(self) -> None:
        self.calls.append(("close", threading.get_ident()))
        self.closed = True


def test_in_a_run_the_bar_is_driven_from_the_loop_thread_only(
    monkeypatch: pytest.MonkeyPatch, trainer_factory: Any
) -> None:
    monkeypatch.setattr("tqdm.tqdm", _FakeBar)  # what `from tqdm import tqdm` finds
    _FakeBar.instances.clear()
    trainer = trainer_factory([Progress(refresh_s=0.05)], epochs=3, batches=4)
    training_threads: set[int] = set()
    trainer.add_hook("batch", lambda ctx: training_threads.add(threading.get_ident()))
    result = trainer.fit_sync()
    (bar,) = _FakeBar.instances
    assert bar.kwargs["file"] is sys.stderr
    assert bar.n == result.steps == 12 and bar.total == 12 and bar.closed
    threads = {t for _, t in bar.calls}
    assert len(threads) == 1  # one event-loop thread (run()'s portal), never the training one
    assert training_threads and not training_threads & threads


def test_in_a_run_the_total_is_known_during_the_first_epoch(
    monkeypatch: pytest.MonkeyPatch, trainer_factory: Any
) -> None:
    monkeypatch.setattr("tqdm.tqdm", _FakeBar)
    _FakeBar.instances.clear()
    trainer_factory([Progress(refresh_s=0.05)], epochs=3, batches=4).fit_sync()
    (bar,) = _FakeBar.instances
    assert bar.kwargs["total"] == 12


class _TerminalStderr:
    """A stand-in stderr that is 'a terminal' (fd 2) whose text the test reads."""

    def __init__(self) -> None:
        self.text = ""

    def write(self, text: str) -> int:
        self.text += text
        return len(text)

    def flush(self) -> None:
        pass

    def fileno(self) -> int:
        return 2

    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(("columns", "width"), [(0, 100), (60, None)])
def test_bar_width_on_a_terminal_reporting_zero_columns(
    vbus: EventBus, vts: VirtualTimeScheduler, step_event: Any,
    monkeypatch: pytest.MonkeyPatch, columns: int, width: int | None,
) -> None:  # fmt: skip
    import os

    import trainbus.callbacks._progress as progress_module

    stderr = _TerminalStderr()
    monkeypatch.setattr(sys, "stderr", stderr)
    monkeypatch.setattr(os, "get_terminal_size", lambda fd=None: os.terminal_size((columns, 24)))
    assert progress_module.terminal_columns(stderr) == columns
    progress = Progress(refresh_s=1.0, bar=True)
    progress.setup(vbus)
    vbus.publish(fit_started(max_steps=100))
    publish_steps(vbus, range(1, 11), step_event)
    vts.advance_by(1.0)
    bar = progress.bar
    assert bar is not None
    # The visible text of the last redraw (another test's open bar can add cursor moves).
    text = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", stderr.text)
    line = next(p for p in reversed(re.split(r"[\r\n]", text)) if "10/100" in p)
    if width is None:  # a real width: the bar follows the terminal
        assert bar.dynamic_ncols and bar.ncols == columns - 1
    else:  # zero columns: a fixed-width bar that still shows the step
        assert "10/100" in line and "|" in line and len(line) <= width, repr(line)
        assert not bar.dynamic_ncols and bar.ncols == width
    bar.close()

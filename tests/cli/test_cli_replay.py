"""``trainbus replay`` and ``trainbus plot`` on a recorded run."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.callbacks.conftest import make_trainer

from trainbus._cli import main
from trainbus.callbacks import JsonlEventLog


def test_replay_prints_a_line_per_event_and_plot_writes_the_png(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    log = tmp_path / "events.jsonl"
    make_trainer([JsonlEventLog(log, flush_s=0.05)], epochs=1, batches=3).fit_sync()
    capsys.readouterr()
    assert main(["replay", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(log.read_text().splitlines())
    assert "TrainerBuilt" in lines[0] and "FitStarted" in lines[1] and "FitEnded" in lines[-1]
    assert sum(" StepEnded " in line for line in lines) == 3
    assert main(["plot", str(tmp_path)]) == 0
    png = tmp_path / "curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["replay", str(tmp_path / "nope")]) == 2


def test_replay_filters_by_type_and_step_range(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "events.jsonl"
    make_trainer([JsonlEventLog(log, flush_s=0.05)], epochs=2, batches=4).fit_sync()
    capsys.readouterr()
    assert main(["replay", str(tmp_path), "--type", "StepEnded", "--steps", "3:6"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [int(line.split("step=")[1].split()[0]) for line in lines] == [3, 4, 5, 6]
    assert all(" StepEnded " in line for line in lines)
    assert main(["replay", str(tmp_path), "--type", "EpochEnded,FitEnded", "--steps", "5:"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[3] for line in lines] == ["EpochEnded", "FitEnded"]
    assert main(["replay", str(tmp_path), "--type", "EpochEnded", "--type", "FitStarted",
                 "--steps", ":0"]) == 0  # fmt: skip
    assert [line.split()[3] for line in capsys.readouterr().out.splitlines()] == ["FitStarted"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--type", "StepEnd"], r"--type='StepEnd' is invalid: an event class name: .*StepEnded"),
        (["--steps", "20:10"], r"--steps='20:10' is invalid: START <= END"),
        (["--steps", "a:b"], r"--steps='a:b' is invalid: START:END with integers"),
    ],
)
def test_replay_filter_errors_name_the_option(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    import re

    (tmp_path / "events.jsonl").write_text("")
    assert main(["replay", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("trainbus replay: ") and re.search(message, err), err

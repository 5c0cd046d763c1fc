"""The ``trainbus`` CLI: ``trainbus demo`` trains on digits and writes a complete run folder."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from trainbus._cli import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True)
def _restore_structlog() -> Iterator[None]:
    # main() configures structlog process-wide; later tests must not inherit it.
    yield
    structlog.reset_defaults()


def accuracy_of(stdout: str) -> float:
    match = re.search(r"final val accuracy: ([\d.]+)%", stdout)
    assert match, stdout
    return float(match.group(1)) / 100


def check_run_folder(run_dir: Path) -> list[dict[str, object]]:
    records = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert [r["type"] for r in records[:2]] == ["TrainerBuilt", "FitStarted"]
    assert records[-1]["type"] == "FitEnded"
    assert records[-1]["reason"] in ("completed", "stopped")
    assert list((run_dir / "checkpoints").glob("*.pt"))
    assert (run_dir / "curves.png").read_bytes()[:8] == PNG_MAGIC
    return records


def test_demo_writes_the_run_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--epochs", "3", "--run-dir", str(tmp_path)]) == 0
    records = check_run_folder(tmp_path)
    assert sum(r["type"] == "EpochEnded" for r in records) == 3
    assert {r["tag"] for r in records if r["type"] == "CheckpointSaved"} >= {"best"}
    out, err = capsys.readouterr()
    assert f"run folder: {tmp_path}" in out
    assert accuracy_of(out) > 0.9  # the MLP learns digits in a few epochs
    assert "evaluation_ended" in err  # console logs go to stderr


def test_demo_json_logs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--epochs", "1", "--run-dir", str(tmp_path), "--json-logs"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line]
    events = {x["event"] for x in lines}
    assert {"demo_started", "progress", "evaluation_ended", "fit_ended"} <= events
    evaluation = next(x for x in lines if x["event"] == "evaluation_ended")
    assert evaluation["level"] == "info" and 0 <= evaluation["val_acc"] <= 1


@pytest.mark.parametrize("argv", [[], ["demo", "--epochs", "0"], ["demo", "--bogus"], ["fly"]])
def test_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert "usage: trainbus" in capsys.readouterr().err


@pytest.mark.slow
def test_the_installed_command(tmp_path: Path) -> None:
    exe = Path(sys.executable).parent / "trainbus"
    proc = subprocess.run(
        [str(exe), "demo", "--epochs", "2", "--run-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=110,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    check_run_folder(tmp_path / "run")
    assert accuracy_of(proc.stdout) > 0.85


def test_demo_default_folder_latest_pointer_and_few_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["demo", "--epochs", "12"]) == 0
    out, err = capsys.readouterr()
    (first,) = set((tmp_path / "runs" / "demo").iterdir()) - {tmp_path / "runs" / "demo" / "latest"}
    # The folder is logged at the start, printed at the end, and named by the docs.
    assert f"run folder: {Path('runs') / 'demo' / first.name}" in out
    assert str(Path("runs") / "demo" / first.name) in err.split("demo_started")[1]
    assert re.fullmatch(r"\d{8}-\d{6}", first.name)
    latest = tmp_path / "runs" / "demo" / "latest"
    assert latest.resolve() == first.resolve()
    # No tqdm bar drawn into a log (stderr is not a terminal here): the default progress rule.
    assert "\r" not in err and "it/s" not in err and "train:" not in err
    # A few files, not one per improvement: 2 best, 2 newest cadence saves, the final one.
    ckpts = sorted(p.name for p in (first / "checkpoints").glob("*.pt"))
    assert sum(name.endswith("-best.pt") for name in ckpts) <= 2, ckpts
    assert len(ckpts) <= 5, ckpts

    # A second run moves the pointer; `trainbus replay runs/demo` reads the newest.
    assert main(["demo", "--epochs", "1"]) == 0
    capsys.readouterr()
    second = latest.resolve()
    assert second != first.resolve() and second.parent == first.parent.resolve()
    assert main(["replay", "runs/demo", "--type", "EpochEnded"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 1  # the one-epoch run, not the first


def test_a_pointer_file_where_links_fail(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from trainbus._replay import new_run_dir, resolve_run

    def no_links(self: Path, *args: object, **kwargs: object) -> None:
        raise OSError("symbolic links are not supported here")

    monkeypatch.setattr(Path, "symlink_to", no_links)
    run = new_run_dir(tmp_path / "runs")
    assert (tmp_path / "runs" / "latest").read_text().strip() == run.name
    assert resolve_run(tmp_path / "runs") == run / "events.jsonl"
    assert new_run_dir(tmp_path / "runs").name == f"{run.name}-2"  # same second: a suffix

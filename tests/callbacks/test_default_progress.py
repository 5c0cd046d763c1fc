"""The default kit: a Trainer shows a Progress bar when stderr is a terminal, on rank 0 only."""

from __future__ import annotations

import sys

import pytest

from trainbus import ConfigError
from trainbus.callbacks import Progress
from trainbus.callbacks._progress import progress_by_default

from .conftest import make_trainer


def _progress(trainer: object) -> list[Progress]:
    return [cb for cb in trainer.callbacks if isinstance(cb, Progress)]  # type: ignore[attr-defined]


@pytest.fixture
def terminal(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    monkeypatch.delenv("RANK", raising=False)
    return monkeypatch


def test_terminal_on_rank_0_gets_a_progress_bar(terminal: pytest.MonkeyPatch) -> None:
    assert progress_by_default()
    assert len(_progress(make_trainer())) == 1
    terminal.setenv("RANK", "0")
    assert len(_progress(make_trainer())) == 1


def test_no_terminal_gets_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    monkeypatch.delenv("RANK", raising=False)
    assert not progress_by_default()
    assert _progress(make_trainer()) == []
    # progress=True forces it, terminal or not.
    assert len(_progress(make_trainer(progress=True))) == 1


def test_other_ranks_get_none(terminal: pytest.MonkeyPatch) -> None:
    terminal.setenv("RANK", "1")
    assert not progress_by_default()
    assert _progress(make_trainer()) == []


def test_progress_false_disables_it(terminal: pytest.MonkeyPatch) -> None:
    assert _progress(make_trainer(progress=False)) == []


def test_a_progress_in_callbacks_replaces_the_default(terminal: pytest.MonkeyPatch) -> None:
    mine = Progress(refresh_s=1.0, bar=False)
    assert _progress(make_trainer([mine])) == [mine]
    assert _progress(make_trainer([mine], progress=True)) == [mine]


def test_invalid_progress_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="progress"):
        make_trainer(progress="yes")


def test_default_progress_draws_the_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("tqdm")
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # capsys' stderr, a "terminal"
    monkeypatch.delenv("RANK", raising=False)
    trainer = make_trainer(epochs=1, batches=3, eval_data=None)
    trainer.fit_sync()
    (bar,) = _progress(trainer)
    assert bar.step == 3 and bar.total_steps == 3
    assert "3/3" in capsys.readouterr().err

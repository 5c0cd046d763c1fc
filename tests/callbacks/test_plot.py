"""CurvePlot: collects curves on the loop, renders a PNG off it when the run ends."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import pytest

from trainbus import ConfigError, EventBus
from trainbus import events as ev
from trainbus.callbacks import CurvePlot
from trainbus.callbacks import _plot as plot_module
from trainbus.callbacks._plot import render

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def test_rejects_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^path=.*not an existing directory"):
        CurvePlot(tmp_path)
    with pytest.raises(ConfigError, match=r"^path="):
        CurvePlot(None)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^title="):
        CurvePlot(tmp_path / "c.png", title=3)  # type: ignore[arg-type]


def test_a_run_writes_a_png(tmp_path: Path, trainer_factory: Any) -> None:
    path = tmp_path / "plots" / "curves.png"
    plot = CurvePlot(path)
    trainer = trainer_factory([plot], epochs=3, batches=4, score=[0.5, 0.7, 0.9])
    trainer.fit_sync()
    assert plot.written == path
    # Two panels (loss; val_score), 10 x 4 inches at 100 dpi; no temporary file left behind.
    assert png_size(path) == (1000, 400)
    assert [p.name for p in path.parent.iterdir()] == ["curves.png"]


def test_a_failed_run_still_leaves_its_curves(tmp_path: Path, trainer_factory: Any) -> None:
    path = tmp_path / "curves.png"
    trainer = trainer_factory([CurvePlot(path)], epochs=2, batches=4)

    def explode(ctx: Any) -> None:
        if ctx.step == 5:
            raise RuntimeError("bad batch")

    trainer.add_hook("batch", explode)
    with pytest.raises(RuntimeError, match="bad batch"):
        trainer.fit_sync()
    assert png_size(path) == (600, 400)  # val_loss only: one panel


def test_render_without_points(tmp_path: Path) -> None:
    path = tmp_path / "empty.png"
    render(path, [], [])
    assert png_size(path) == (600, 400)


def test_the_training_curve_comes_from_metrics_logged_not_each_step(
    tmp_path: Path, trainer_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No per-step device read: CurvePlot takes the log window's loss (read by the loop at the
    window's close), so it does not even ask for StepEnded."""
    bus = EventBus()
    CurvePlot(tmp_path / "c.png").setup(bus)
    assert bus.wants(ev.MetricsLogged) and not bus.wants(ev.StepEnded)

    drawn: list[Any] = []
    monkeypatch.setattr(plot_module, "render", lambda path, train, val, title: drawn.append(train))
    trainer = trainer_factory([CurvePlot(tmp_path / "c.png")], epochs=2, batches=4, log_every=2,
                              progress=False)  # fmt: skip
    logged: list[ev.MetricsLogged] = []
    trainer.bus.stream(ev.MetricsLogged).subscribe(logged.append)
    trainer.fit_sync()
    assert [s for s, _ in drawn[0]] == [2, 4, 6, 8]
    assert drawn[0] == [(e.step, e.metrics["loss"]) for e in logged]


def test_matplotlib_loads_when_the_run_starts_not_at_its_end(
    tmp_path: Path, trainer_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first render in a process loads matplotlib and its fonts (seconds): done at
    FitStarted, while the run trains, the render at the end is quick."""
    order: list[str] = []
    monkeypatch.setattr(plot_module, "_warm_up", lambda: order.append("warm_up"))
    monkeypatch.setattr(plot_module, "render", lambda *args: order.append("render"))
    trainer = trainer_factory([CurvePlot(tmp_path / "c.png")], epochs=1, batches=2, progress=False)
    trainer.fit_sync()
    assert order == ["warm_up", "render"]

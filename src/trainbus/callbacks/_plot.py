"""A PNG of the training and validation curves, written when the run ends."""

from __future__ import annotations

import contextlib
import io
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeAlias

import anyio.to_thread
from reactivex import operators as ops

from .. import events as ev
from .._exceptions import ConfigError
from .._validate import check_path
from ._base import Callback

if TYPE_CHECKING:
    from .._bus import EventBus

__all__ = ["CurvePlot", "render"]

_Train: TypeAlias = list[tuple[int, float]]
_Val: TypeAlias = list[tuple[int, Mapping[str, float]]]


@dataclass(slots=True)
class _Curves:
    """Points collected on the event-loop thread during one run."""

    train: _Train = field(default_factory=list)
    val: _Val = field(default_factory=list)

    def add_window(self, e: ev.MetricsLogged) -> None:
        # The window's mean loss, already read at its close: no device read here.
        loss = e.metrics.get("loss")
        if loss is not None:
            self.train.append((e.step, loss))

    def add_eval(self, e: ev.EvaluationEnded) -> None:
        if e.error is None and e.metrics:
            self.val.append((e.step, e.metrics))

    def snapshot(self, e: ev.FitEnded) -> tuple[_Train, _Val, ev.FitEnded]:
        return list(self.train), list(self.val), e


def render(
    path: Path,
    train: _Train,
    val: _Val,
    title: str | None = None,
) -> None:
    """Draw the curves to ``path`` (PNG, written atomically) with matplotlib's Agg canvas (no
    pyplot: safe off the main thread). Left: the losses; right: the other metrics."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    names = sorted({k for _, m in val for k in m})
    losses = [n for n in names if "loss" in n]
    others = [n for n in names if "loss" not in n]
    fig = Figure(figsize=(10 if others else 6, 4), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2 if others else 1, squeeze=False)[0]
    if train:
        axes[0].plot(
            [s for s, _ in train], [v for _, v in train], lw=0.8, alpha=0.8, label="train loss"
        )
    for ax, ylabel, metrics in zip(
        axes, ("loss", "validation metric"), (losses, others), strict=False
    ):
        for name in metrics:
            pts = [(s, m[name]) for s, m in val if name in m]
            ax.plot([s for s, _ in pts], [v for _, v in pts], marker="o", label=name)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        if metrics or (train and ax is axes[0]):
            ax.legend()
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    path.parent.mkdir(parents=True, exist_ok=True)
    # open(), not mkstemp: its 0600 mode would stick to the PNG.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb") as f:
            fig.savefig(f, format="png", dpi=100)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _warm_up() -> None:
    """Import matplotlib and load its fonts (seconds, the first time) before the run ends."""
    with contextlib.suppress(ImportError):  # the render reports it
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        fig = Figure(figsize=(1, 1))
        FigureCanvasAgg(fig)
        fig.subplots().set_title("warm-up")
        fig.savefig(io.BytesIO(), format="png")


class CurvePlot(Callback):
    """Writes a PNG of the loss curves and validation metrics when the run ends, however it
    ended. Requires matplotlib. See docs/callbacks/curve-plot.md.

    Args:
        path: The ``.png`` file to write (parent folders are created).
        title: Figure title (default: ``"trainbus: <reason> at step <n>"``).

    Attributes:
        written: The path once the plot was written, else None.

    Raises:
        ConfigError: ``path`` is not a file path, or ``title`` is not a string.
    """

    def __init__(self, path: str | os.PathLike[str], *, title: str | None = None) -> None:
        self.path = check_path("path", path)
        if title is not None and not isinstance(title, str):
            raise ConfigError.invalid("title", title, "a string or None")
        self.title = title
        self.written: Path | None = None

    def setup(self, bus: EventBus) -> None:
        """Subscribe the collectors and the renderer."""
        curves = _Curves()
        bus.stream(ev.MetricsLogged).subscribe(curves.add_window, name="CurvePlot.metrics_logged")
        bus.stream(ev.EvaluationEnded).subscribe(curves.add_eval, name="CurvePlot.evaluation_ended")

        async def draw(snap: tuple[_Train, _Val, ev.FitEnded] | None) -> None:
            if snap is None:  # FitStarted: matplotlib loads while the run trains
                await anyio.to_thread.run_sync(_warm_up)
                return
            train, val, end = snap
            title = self.title or f"trainbus: {end.reason} at step {end.step}"
            await anyio.to_thread.run_sync(render, self.path, train, val, title)
            self.written = self.path

        bus.subscribe_async(
            bus.stream(ev.FitStarted, ev.FitEnded).pipe(
                ops.map(lambda e: curves.snapshot(e) if isinstance(e, ev.FitEnded) else None)
            ),
            draw,
            overflow="block",
            name="CurvePlot.render",
        )

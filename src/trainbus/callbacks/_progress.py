"""Training progress: a tqdm bar when tqdm is installed, else a structlog line per refresh."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

import structlog
from reactivex import operators as ops

from .. import events as ev
from .._exceptions import ConfigError
from .._validate import check_seconds
from ._base import Callback
from ._estimate import RunLength, StepRate

if TYPE_CHECKING:
    from .._bus import EventBus

__all__ = ["FALLBACK_COLUMNS", "Progress", "progress_by_default", "terminal_columns"]

log = structlog.get_logger("trainbus")


def progress_by_default() -> bool:
    """Whether a ``Trainer`` shows a :class:`Progress` when not told (``progress=None``):
    when stderr is a terminal and this process is rank 0 (``RANK`` absent or ``"0"``)."""
    if os.environ.get("RANK", "0").strip() not in ("", "0"):
        return False
    try:
        return bool(sys.stderr.isatty())
    except (AttributeError, ValueError):  # stderr replaced by an object without isatty, or closed
        return False


FALLBACK_COLUMNS = 100
"""The bar's width on a terminal that reports zero columns."""


def terminal_columns(stream: Any) -> int | None:
    """The columns of the terminal the file object ``stream`` writes to (0 on some
    pseudo-terminals), None when it is not one."""
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, ValueError, OSError):  # no fileno, closed, or not a terminal
        return None


class Progress(Callback):
    """Shows training progress: step / total, epoch, loss and learning rate.

    Refreshed at most once per ``refresh_s`` (``ops.sample`` of ``StepEnded``) on the event-loop
    thread, and at each epoch's end and the run's end. The total is ``max_steps`` or
    ``max_epochs x steps_per_epoch`` (the smaller), else estimated from the first full epoch. The
    display shows the latest step's values, set to its ``step``; ``loss`` is read (a device
    sync) once per refresh, never on the training thread.

    Args:
        refresh_s: Minimum seconds between two refreshes (> 0).
        bar: ``None``: a tqdm bar on stderr when tqdm is importable, else log lines;
            ``True``: require tqdm; ``False``: log lines (``"progress"`` events from the
            ``"trainbus"`` structlog logger, keys ``step``, ``epoch``, ``loss``, ``lr``,
            ``total_steps``, ``steps_per_s``, ``remaining_s``).
        desc: Label of the bar.

    Attributes:
        bar: The current tqdm bar (None in log mode or before ``FitStarted``); it stays
            readable after it is closed.
        step: The last step shown (None before the first).
        total_steps: The total shown (None while unknown).

    Raises:
        ConfigError: ``refresh_s`` is not a positive number, ``bar`` is not None/True/False,
            ``desc`` is not a string; at setup, ``bar=True`` without tqdm installed.
    """

    def __init__(self, refresh_s: float = 0.2, *, bar: bool | None = None, desc: str = "train"):
        self.refresh_s = check_seconds("refresh_s", refresh_s)
        if bar is not None and not isinstance(bar, bool):
            raise ConfigError.invalid("bar", bar, "None (tqdm when importable), True or False")
        if not isinstance(desc, str):
            raise ConfigError.invalid("desc", desc, "a string")
        self.use_bar = bar
        self.desc = desc
        self._view: _View | None = None

    @property
    def bar(self) -> Any:
        """The tqdm bar of the current (or last) run; None in log mode."""
        return self._view.bar if self._view is not None else None

    @property
    def step(self) -> int | None:
        """The last step shown."""
        return self._view.step if self._view is not None else None

    @property
    def total_steps(self) -> int | None:
        """The total shown, None while unknown."""
        return self._view.total if self._view is not None else None

    def setup(self, bus: EventBus) -> None:
        """Build the display pipelines.

        Raises:
            ConfigError: ``bar=True`` and tqdm is not installed.
        """
        tqdm_cls: Any = None
        if self.use_bar is not False:
            try:  # optional dependency, imported only when a Progress is added
                import tqdm

                tqdm_cls = tqdm.tqdm
            except ImportError:
                if self.use_bar:
                    raise ConfigError.invalid(
                        "bar", True, "False or None: tqdm is not installed (pip install tqdm)"
                    ) from None
        view = self._view = _View(tqdm_cls, self.desc)
        bus.stream(ev.FitStarted).subscribe(view.started, name="Progress.fit_started")
        # Every step is remembered (an assignment and a deque append); drawing is sampled.
        bus.stream(ev.StepEnded).subscribe(view.latest, name="Progress.latest")
        bus.stream(ev.StepEnded).pipe(ops.sample(self.refresh_s)).subscribe(
            view.stepped, name="Progress.step_ended"
        )
        bus.stream(ev.EpochStarted).subscribe(view.epoch_started, name="Progress.epoch_started")
        bus.stream(ev.EpochEnded).subscribe(view.epoch_ended, name="Progress.epoch_ended")
        bus.stream(ev.FitEnded).subscribe(view.ended, name="Progress.fit_ended")


class _View:
    """The display of one run. Touched only on the event-loop thread: no lock."""

    def __init__(self, tqdm_cls: Any, desc: str) -> None:
        self.tqdm_cls = tqdm_cls
        self.desc = desc
        self.bar: Any = None
        self.length = RunLength()
        self.rate = StepRate()
        self.step: int | None = None
        self.epoch: int | None = None
        self.last: ev.StepEnded | None = None
        self.shown: ev.StepEnded | None = None
        self.loss: float | None = None
        self.logged: tuple[int, int, ev.StepEnded | None] | None = None

    @property
    def total(self) -> int | None:
        return self.length.total

    # ------------------------------------------------------------------ events
    def started(self, e: ev.FitStarted) -> None:
        self.length.started(e)
        self.step = e.step
        self._open(e.step)

    def latest(self, e: ev.StepEnded) -> None:
        self.last = e
        self.rate.add(e)

    def stepped(self, e: ev.StepEnded) -> None:
        self._show(e.step, e.epoch)

    def epoch_started(self, e: ev.EpochStarted) -> None:
        self.length.epoch_started(e)

    def epoch_ended(self, e: ev.EpochEnded) -> None:
        self.length.epoch_ended(e)
        self._show(e.step, e.epoch)

    def ended(self, e: ev.FitEnded) -> None:
        # FitEnded.epoch counts the epoch after the last one; show the last one trained.
        epoch = self.epoch if self.epoch is not None else e.epoch
        if self.bar is None:
            self._show(e.step, epoch)
            return
        # Bring the bar up to date without drawing: close() draws the last line, once.
        self._update(e.step, epoch, draw=False)
        self.bar.close()

    # ------------------------------------------------------------------ display
    def _open(self, initial: int) -> None:
        if self.tqdm_cls is None or self.bar is not None:
            return
        # mininterval=0: the sampling upstream already decides when to draw. A terminal that
        # reports zero columns (some CI pseudo-terminals) would get a bar of no width, so
        # nothing: draw it at a fixed width there instead of following the terminal.
        width = terminal_columns(sys.stderr)
        fixed = width is not None and width <= 0
        self.bar = self.tqdm_cls(
            total=self.total, initial=initial, desc=self.desc, unit="step",
            file=sys.stderr, mininterval=0, dynamic_ncols=not fixed,
            ncols=FALLBACK_COLUMNS if fixed else None,
        )  # fmt: skip

    def _values(self) -> dict[str, Any]:
        """Loss and LR of the latest step (the loss read once per new step shown)."""
        last = self.last
        if last is None:
            return {}
        if last is not self.shown:
            self.shown, self.loss = last, float(last.loss)  # a device read, once per refresh
        return {"loss": self.loss, "lr": last.lr}

    def _show(self, step: int, epoch: int) -> None:
        if self.tqdm_cls is None:
            self.step, self.epoch = step, epoch
            state = (step, epoch, self.last)
            if state == self.logged:
                return  # nothing new since the last line (e.g. the epoch's last step)
            self.logged = state
            rate = self.rate.steps_per_s
            total = self.total
            remaining = (
                max(0.0, (total - step) / rate) if rate is not None and total is not None else None
            )
            values = {"loss": None, "lr": None, **self._values()}
            log.info("progress", step=step, epoch=epoch, total_steps=total, steps_per_s=rate,
                     remaining_s=remaining, **values)  # fmt: skip
            return
        self._update(step, epoch, draw=True)

    def _update(self, step: int, epoch: int, *, draw: bool) -> None:
        self.step, self.epoch = step, epoch
        if self.bar is None:  # added after FitStarted
            self._open(step)
        bar = self.bar
        if bar.total != self.total:
            bar.total = self.total
        postfix: dict[str, Any] = {"epoch": epoch}
        values = self._values()
        if values:
            postfix["loss"] = f"{values['loss']:.4g}"
            postfix["lr"] = f"{values['lr']:.3g}"
        bar.set_postfix(postfix, refresh=False)
        if not draw:
            bar.n = max(bar.n, step)
        elif step > bar.n:
            bar.update(step - bar.n)  # to the event's step: many steps may pass per refresh
        else:
            bar.refresh()

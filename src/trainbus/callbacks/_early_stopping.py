"""Early stopping: stop the run when an evaluation metric stops improving."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

from reactivex import operators as ops

from .. import commands as cmd
from .. import events as ev
from .. import operators as tbops
from .._validate import check_metric
from ._monitored import TrackedCallback, check_monitored, lightning_names, reads_metric

if TYPE_CHECKING:
    from .._bus import EventBus
    from .._bus.subscriptions import CommandSink
    from ._base import RunPlan

__all__ = ["EarlyStopping"]

# Lightning's EarlyStopping arguments that trainbus spells otherwise (monitor, mode, patience
# and min_delta are the same).
_LIGHTNING = {
    "stopping_threshold": "ThresholdStopping(monitor, below=...) (above= for mode='max')",
    "divergence_threshold": "ThresholdStopping(monitor, above=...) (below= for mode='max')",
}


class EarlyStopping(TrackedCallback):
    """Sends ``StopTraining`` once ``monitor`` has not improved for ``patience`` evaluations.

    Pipeline::

        EvaluationEnded | ExternalEvaluationEnded carrying monitor
            -> filter(no error) -> tbops.patience(monitor, ...) -> bus.commands

    The run ends at the step of the evaluation that decided it, with
    ``FitResult.reason == "stopped"`` and a ``stop_reason`` starting with ``"early stopping"``.
    NaN never counts as an improvement. A ``monitor`` the run's evaluation does not produce is
    a ``ConfigError`` before the run starts (:meth:`check`).

    Results of evaluation jobs (``ExternalEvaluationEnded``, from
    :class:`~trainbus.callbacks.EvaluateCheckpoints`) carrying ``monitor`` count too; a stop
    they decide is applied at the loop's next poll point (they are not barriers).

    Args:
        monitor: Evaluation metric to watch (``"val_loss"``, ``"val_acc"``...).
        patience: Evaluations without improvement before stopping (>= 1).
        mode: ``"min"`` if lower is better, ``"max"`` otherwise.
        min_delta: Smallest change that counts as an improvement (>= 0).
        state_key: Name of its state in checkpoints (None: ``"EarlyStopping"``). A resumed run
            keeps counting its patience, and one resumed at the step it decided to stop stops
            again (unless ``patience`` is now larger).

    Raises:
        ConfigError: for an argument out of range, naming it.
    """

    @lightning_names("EarlyStopping", "EarlyStopping", _LIGHTNING)
    def __init__(
        self,
        monitor: str = "val_loss",
        patience: int = 3,
        mode: Literal["min", "max"] = "min",
        min_delta: float = 0.0,
        *,
        state_key: str | None = None,
    ) -> None:
        monitor = check_metric("monitor", monitor)
        tbops.patience(monitor, mode=mode, patience=patience, min_delta=min_delta)  # validates
        self.monitor, self.patience, self.mode, self.min_delta = monitor, patience, mode, min_delta
        # The tracker: best value and evaluations without improvement (fresh each time it is added).
        super().__init__(state_key)
        # The bus' back-channel, not the bus: the bus holds this callback's subscription, so
        # holding the bus would be a cycle that keeps a dropped Trainer until a gc pass.
        self._commands: CommandSink | None = None
        self._stop: cmd.StopTraining | None = None
        """The stop this run decided (saved with the tracker: a resume at its step repeats it)."""

    def check(self, plan: RunPlan) -> None:
        """Refuse a ``monitor`` no evaluation of the run produces.

        Raises:
            ConfigError: naming ``monitor`` and the metrics the run has.
        """
        check_monitored(plan, "EarlyStopping.monitor", self.monitor, external=True)

    def setup(self, bus: EventBus) -> None:
        """Subscribe the decision pipeline to ``bus.commands``."""
        monitor = self.monitor
        # One run, one tracker: an instance added to a second trainer starts afresh.
        tracker = self.fresh_tracker()
        self._commands, self._stop = bus.commands, None
        decide = tbops.patience(monitor, mode=self.mode, patience=self.patience,
                                min_delta=self.min_delta, tracker=tracker)  # fmt: skip
        bus.stream(ev.EvaluationEnded, ev.ExternalEvaluationEnded).pipe(
            ops.filter(
                lambda e: (
                    e.error is None and (isinstance(e, ev.EvaluationEnded) or monitor in e.metrics)
                )
            ),
            ops.filter(reads_metric(monitor)),  # named sets: only the metric's own set
            decide,
            ops.do_action(self._decided),
        ).subscribe(bus.commands, name="EarlyStopping")

    def _decided(self, stop: cmd.StopTraining) -> None:
        self._stop = stop

    def state_dict(self) -> dict[str, Any]:
        """The tracker's state and the reason of the stop it decided (None: none yet)."""
        return {**super().state_dict(),
                "stop_reason": None if self._stop is None else self._stop.reason}  # fmt: skip

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; a state saved after the stop was decided sends it again
        (before the resumed run's first step), unless ``patience`` now allows more.

        Raises:
            ConfigError: ``state`` is not a tracker state.
        """
        super().load_state_dict(state)
        reason = state.get("stop_reason")
        self._stop = None
        if isinstance(reason, str) and self.tracker.bad >= self.patience:
            self._stop = cmd.StopTraining(reason=reason)
            if self._commands is not None:  # added: the resumed run applies it first
                self._commands.send(self._stop)

"""The learning-rate scheduler's step (traced as ``"scheduler_step"``) and ``SchedulerStepped``."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from .. import events as ev

if TYPE_CHECKING:
    from .._bus import LoopPort
    from ..checkpoint import TrainState
    from .settings import Settings
    from .wants import Wants

__all__ = ["SchedulerStepper"]

_BEFORE_OPTIMIZER = r"Detected call of `lr_scheduler\.step\(\)` before `optimizer\.step\(\)`"
"""torch's warning for a scheduler stepped before its optimizer in this process."""


class SchedulerStepper:
    """Steps the scheduler and publishes ``SchedulerStepped``."""

    def __init__(self, settings: Settings, port: LoopPort, state: TrainState, wants: Wants) -> None:
        self._s = settings
        self._port = port
        self._state = state
        self._wants = wants

    def lr(self) -> float:
        """The optimizer's current learning rate of parameter group 0."""
        return float(self._s.optimizer.param_groups[0]["lr"])

    def step(self, *, always: bool, replayed: bool = False) -> None:
        """``scheduler.step()`` (traced), then ``SchedulerStepped`` (with ``error=`` when it
        raised), wanted or not with ``always``. ``replayed``: a resume replays an epoch's end
        before its first optimizer step, so torch's "scheduler before optimizer" warning is
        silenced (the uninterrupted run stepped the optimizer first)."""
        pub, st, w, s = self._port.publish, self._state, self._wants, self._s
        assert s.scheduler is not None
        try:
            with w.trace("scheduler_step"):
                if replayed:
                    with warnings.catch_warnings():
                        warnings.filterwarnings("ignore", _BEFORE_OPTIMIZER, UserWarning)
                        s.scheduler.step()
                else:
                    s.scheduler.step()
        except BaseException as exc:
            if always or w.scheduler_stepped:
                pub(ev.SchedulerStepped(step=st.step, epoch=st.epoch, lr=self.lr(), error=exc))
            raise
        if always or w.scheduler_stepped:
            pub(ev.SchedulerStepped(step=st.step, epoch=st.epoch, lr=self.lr()))

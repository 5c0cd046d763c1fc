"""Callbacks whose whole state is one :class:`~trainbus.operators.Tracker`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .. import operators as tbops
from ._base import Callback

__all__ = ["TrackedCallback"]


class TrackedCallback(Callback):
    """A callback deciding with a tracker-backed operator (``tbops.patience``, ``tbops.plateau``).

    It owns the tracker: the operator counts in it, checkpoints save it (:meth:`state_dict`), a
    resume restores it before the first evaluation, and :meth:`fresh_tracker` gives each addition
    (one run) its own.

    Args:
        state_key: Name of its state in checkpoints (None: the class name).
    """

    def __init__(self, state_key: str | None = None) -> None:
        self.state_key = state_key
        self.tracker = tbops.Tracker()

    def fresh_tracker(self) -> tbops.Tracker:
        """Start a new run's tracker (called from ``setup``) and return it."""
        self.tracker = tbops.Tracker()
        return self.tracker

    def state_dict(self) -> dict[str, Any]:
        """The tracker's state (best value, counters)."""
        return self.tracker.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (before the resumed run's first evaluation)."""
        self.tracker.load_state_dict(state)

"""What every driver (``trainbus launch``, :mod:`trainbus.ray`) does alike with the user's
callbacks and the workers' ending."""

from __future__ import annotations

from . import events as ev
from ._bus import EventBus
from ._exceptions import ConfigError
from ._trainer.added import hook_methods, instance
from .callbacks._base import Callback

__all__ = ["add_driver_callback", "workers_stop_reason"]


def add_driver_callback(bus: EventBus, callback: Callback | type[Callback]) -> None:
    """Subscribe a callback's ``on_*`` methods (and its ``setup``) to a driver's bus: as
    ``Trainer.add_callback``, minus the hooks, which run on a training thread, and there is
    none in the driver.

    Raises:
        ConfigError: not a Callback, or one with ``hook_*`` methods (naming them).
    """
    cb = instance(callback)
    hooks_map = hook_methods(cb)
    if hooks_map:
        raise ConfigError.invalid(
            "callbacks", cb, "callbacks without hook_* methods (hooks change the step on the "
            f"training thread, which is in the workers: {sorted(hooks_map)})",
        )  # fmt: skip
    cb.subscribe_to(bus)


def workers_stop_reason(ended: ev.FitEnded | None, asked: str | None) -> str | None:
    """Why the workers stopped: their own ``FitEnded.stop_reason`` once it arrived (a run that
    did not complete), else the reason the driver asked them to stop with, else None."""
    if ended is not None and ended.reason != "completed":
        return ended.stop_reason or asked
    return asked

"""The signals that stop a run or a launch, and which of them a call may take over."""

from __future__ import annotations

import signal
from typing import Literal

from ._exceptions import ConfigError

__all__ = ["STOP_SIGNALS", "OnSignal", "check_on_signal", "not_ignored"]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
"""What stops a run gracefully (a second SIGINT aborts it)."""


def not_ignored(signums: tuple[signal.Signals, ...] = STOP_SIGNALS) -> tuple[signal.Signals, ...]:
    """The signals of ``signums`` the process does not ignore now (one ignored stays so, as
    for a background job's SIGINT)."""
    return tuple(s for s in signums if signal.getsignal(s) is not signal.SIG_IGN)


OnSignal = Literal["raise", "return"]
"""``on_signal=`` of the Trainer and the launchers (None: no handler)."""


def check_on_signal(value: object) -> OnSignal | None:
    """``on_signal=``: an :data:`OnSignal`, or None for no signal handler (else
    ``ConfigError``)."""
    if value is None or value in ("raise", "return"):
        return value
    raise ConfigError.invalid(
        "on_signal",
        value,
        "'raise' (the interrupt reaches the caller after the graceful stop), 'return' "
        "(the result is returned) or None (no handler: Python's own SIGINT and SIGTERM)",
    )

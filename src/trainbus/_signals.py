"""The signals that stop a run or a launch, and which of them a call may take over."""

from __future__ import annotations

import signal

__all__ = ["STOP_SIGNALS", "not_ignored"]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
"""What stops a run gracefully (a second SIGINT aborts it)."""


def not_ignored(signums: tuple[signal.Signals, ...] = STOP_SIGNALS) -> tuple[signal.Signals, ...]:
    """The signals of ``signums`` the process does not ignore now.

    A signal ignored when a call starts stays ignored for the call, as Python leaves an
    ignored SIGINT alone at start-up: a script's background job (``python train.py &``)
    ignores SIGINT so that a Ctrl-C meant for the script's foreground does not reach it.
    """
    return tuple(s for s in signums if signal.getsignal(s) is not signal.SIG_IGN)

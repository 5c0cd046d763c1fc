"""How a run's ending reaches its caller: what ``fit()`` raises after a run that SIGINT or
SIGTERM stopped gracefully, and which stopped runs skip their final checkpoint.

With ``Trainer(on_signal="raise")`` (the default) a signal still stops the run as a step
boundary, writes the final checkpoint and delivers every event; then, instead of returning a
result that code which does not look at it would take for a normal end, the interrupt reaches
the caller as it would have without trainbus' handler:

========  =====================================================================
SIGINT    ``KeyboardInterrupt`` (Python's own Ctrl-C)
SIGTERM   ``SystemExit(143)`` (128 + 15: the exit status of a process that a
          SIGTERM ended; ``except Exception`` does not catch it, an Optuna study
          leaves the trial RUNNING, the process exits 143 when nothing catches it)
========  =====================================================================

``trainer.result`` holds the run's :class:`~trainbus.FitResult` (``ending == Ending.SIGNAL``).
"""

from __future__ import annotations

import signal
from collections.abc import Iterable
from typing import Literal

from .._exceptions import ConfigError
from ..events import Ending

__all__ = ["OnSignal", "check_on_signal", "check_skip_final", "interrupt_for"]

SKIPPABLE = (Ending.STOPPED, Ending.PRUNED, Ending.SIGNAL)

OnSignal = Literal["raise", "return"]


def check_on_signal(value: object) -> OnSignal:
    """``value`` as an :data:`OnSignal`.

    Raises:
        ConfigError: ``value`` is neither ``"raise"`` nor ``"return"``.
    """
    if value == "raise":
        return "raise"
    if value == "return":
        return "return"
    raise ConfigError.invalid(
        "on_signal",
        value,
        "'raise' (the interrupt reaches the caller "
        "after the graceful stop) or 'return' (fit() returns the result)",
    )


def interrupt_for(signum: signal.Signals, step: int, checkpoint: str | None) -> BaseException:
    """The exception ``fit()`` raises after ``signum`` stopped the run at ``step``.

    Args:
        signum: The first signal the call received.
        step: The step the run stopped at.
        checkpoint: The last checkpoint written (None: none).

    Returns:
        ``KeyboardInterrupt`` for SIGINT, ``SystemExit(128 + signum)`` for any other.
    """
    where = f"at step {step}" + (f", checkpoint {checkpoint}" if checkpoint else "")
    if signum == signal.SIGINT:
        return KeyboardInterrupt(
            f"trainbus: SIGINT stopped the run gracefully {where}; trainer.result holds the "
            "result (Trainer(on_signal='return') returns it instead)"
        )
    exit_ = SystemExit(128 + int(signum))
    exit_.add_note(f"trainbus: {signum.name} stopped the run gracefully {where}; "
                   "trainer.result holds the result (Trainer(on_signal='return') returns it "
                   "instead)")  # fmt: skip
    return exit_


def check_skip_final(value: object) -> frozenset[Ending]:
    """``skip_final_checkpoint`` as a set of endings.

    Args:
        value: An iterable of ``"stopped"``, ``"pruned"``, ``"signal"`` (or those
            :class:`~trainbus.events.Ending` members); empty: every stopped run writes one.

    Returns:
        The endings whose final checkpoint is skipped.

    Raises:
        ConfigError: not an iterable of those endings.
    """
    allowed = (
        "an iterable of 'stopped', 'pruned', 'signal' (the stopped runs whose final "
        "checkpoint to skip), e.g. {'pruned'}; empty: always write it"
    )
    if isinstance(value, str) or not isinstance(value, Iterable):
        raise ConfigError.invalid("skip_final_checkpoint", value, allowed)
    out = set()
    for item in value:
        if item not in SKIPPABLE:
            raise ConfigError.invalid("skip_final_checkpoint", item, allowed)
        out.add(Ending(item))
    return frozenset(out)

"""How a run's ending reaches its caller: what ``fit()`` raises after a graceful stop by
SIGINT (``KeyboardInterrupt``) or SIGTERM (``SystemExit(143)``) with ``on_signal="raise"``, and
which stopped runs skip their final checkpoint.
"""

from __future__ import annotations

import signal
from collections.abc import Iterable

from .._exceptions import ConfigError
from ..events import Ending

__all__ = ["check_skip_final", "interrupt_for"]

SKIPPABLE = (Ending.STOPPED, Ending.PRUNED, Ending.SIGNAL)


def interrupt_for(signum: signal.Signals, step: int, checkpoint: str | None) -> BaseException:
    """``KeyboardInterrupt`` for SIGINT, ``SystemExit(128 + signum)`` for another signal that
    stopped the run at ``step`` (``checkpoint``: the last one written, or None)."""
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


def check_skip_final(value: object, name: str = "CheckpointDir.skip_final") -> frozenset[Ending]:
    """``CheckpointDir(skip_final=)``: an iterable of ``"stopped"``, ``"pruned"``,
    ``"signal"`` as a set of endings.

    Raises:
        ConfigError: not an iterable of those endings.
    """
    allowed = (
        "an iterable of 'stopped', 'pruned', 'signal' (the stopped runs whose final "
        "checkpoint to skip), e.g. {'pruned'}; empty: always write it"
    )
    if isinstance(value, str) or not isinstance(value, Iterable):
        raise ConfigError.invalid(name, value, allowed)
    out = set()
    for item in value:
        if item not in SKIPPABLE:
            raise ConfigError.invalid(name, item, allowed)
        out.add(Ending(item))
    return frozenset(out)

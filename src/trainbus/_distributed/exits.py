"""How each rank exited, read line by line from torchrun's failure summary on standard error
(a sample is in tests/distributed/test_exits.py): one block per failed rank, the first failure
last, under ``Root Cause``. A ``rank`` line pairs only with the ``exitcode`` line right under
it, so an earlier log line naming an exit code is never blamed.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass

__all__ = ["RankExit", "RankExits"]

_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)\s*$")
_EXITCODE = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)\b")
_ROOT = re.compile(r"^\s*Root Cause\b")
_SIGNALS = {s.value: s.name for s in signal.Signals}


@dataclass(frozen=True, slots=True, kw_only=True)
class RankExit:
    """One failed rank, as torchrun reported it (a negative ``exitcode``: killed by that
    signal; ``root_cause``: the first failure, not a rank torchrun stopped)."""

    rank: int
    local_rank: int
    exitcode: int
    root_cause: bool

    @property
    def signal(self) -> str | None:
        """The name of the signal that killed it (``"SIGKILL"``), or None."""
        return _SIGNALS.get(-self.exitcode) if self.exitcode < 0 else None

    def describe(self) -> str:
        """``rank 1 exited with code -9 (SIGKILL)``."""
        name = f" ({self.signal})" if self.signal else ""
        return f"rank {self.rank} exited with code {self.exitcode}{name}"


class RankExits:
    """Reads torchrun's standard error line by line and keeps every rank's failure block."""

    def __init__(self) -> None:
        self._exits: list[RankExit] = []
        self._pending: tuple[int, int] | None = None
        self._in_root = False

    def feed(self, line: str) -> None:
        """Read one line of torchrun's standard error (with or without its newline)."""
        if _ROOT.match(line):
            self._in_root = True
            return
        rank = _RANK.match(line)
        if rank:
            self._pending = (int(rank.group(1)), int(rank.group(2)))
            return
        pending, self._pending = self._pending, None
        code = _EXITCODE.match(line)
        if pending is not None and code:
            self._exits.append(RankExit(rank=pending[0], local_rank=pending[1],
                                        exitcode=int(code.group(1)),
                                        root_cause=self._in_root))  # fmt: skip

    @property
    def exits(self) -> tuple[RankExit, ...]:
        """Every failed rank torchrun reported, in its order (the root cause last)."""
        return tuple(self._exits)

    @property
    def root_cause(self) -> RankExit | None:
        """torchrun's ``Root Cause`` block, else the only block, else None."""
        roots = [e for e in self._exits if e.root_cause]
        if roots:
            return roots[-1]
        return self._exits[0] if len(self._exits) == 1 else None

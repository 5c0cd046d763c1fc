"""The doorbell: how the bus tells the training loop, in one attribute read, to look at it.

The loop runs stretches of ordinary steps without polling. Between two steps it reads
:attr:`Doorbell.rings` and compares it with the value it last acted on; the bus' parts ring the
bell after each change the loop must act on: a subscription came or went (``RouteTable``), a
decision schedule was declared or removed (``StepClock``), a command was sent
(``CommandChannel``), a ``"raise"`` subscriber failed (``FailureLedger``), a cancel was
requested. The loop then re-reads the real state (routes version, commands, failure), so a
ring carries no data and two rings racing on different threads lose nothing: each rings after
its own change is visible, and whichever value the loop sees next differs from the one it had.
"""

from __future__ import annotations

__all__ = ["Doorbell"]


class Doorbell:
    """A counter that only grows; :meth:`ring` after a change the training loop must see.

    Attributes:
        rings: How many times the bell rang (read by the loop between steps).
    """

    __slots__ = ("rings",)

    def __init__(self) -> None:
        self.rings = 0

    def ring(self) -> None:
        """Tell the loop to look at the bus. Any thread; never blocks."""
        self.rings += 1

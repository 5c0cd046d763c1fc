"""The step clock: the steps at which subscriptions decide, and the step a command was decided at.

A **decision step** is a step at which some subscription declared it decides (``tbops.every(n)``
and ``tbops.once(at=k)`` carry theirs;
``bus.declare_decision_steps(...)`` declares some by hand). At a
decision step the loop delivers everything published so far, waits for the async subscribers of
that step's ``StepEnded``, and applies the commands they sent before the next step starts, so a
decision lands at the same step on every run (docs/events.md, "When a command takes effect").

:class:`StepClock` owns the declared decision steps; :class:`DecisionStamp` knows the step of the
event being handled right now, which ``bus.send`` stamps on a command as its ``decided_at``.
This module imports nothing else of the bus (it comes first in the bus' import order).
"""

from __future__ import annotations

import contextvars
import itertools
import threading
from dataclasses import dataclass
from typing import TypeAlias

from .._validate import check_int
from .doorbell import Doorbell

__all__ = ["At", "DecisionStamp", "DecisionSteps", "Every", "StepClock"]


@dataclass(frozen=True, slots=True)
class Every:
    """Decide at every step that is a multiple of ``n`` (``n``, ``2n``, ...)."""

    n: int

    def __post_init__(self) -> None:
        check_int("n", self.n, 1)

    def next_after(self, step: int) -> int:
        """The smallest multiple of ``n`` greater than ``step``."""
        return (step // self.n + 1) * self.n


@dataclass(frozen=True, slots=True)
class At:
    """Decide once, at ``step``."""

    step: int

    def __post_init__(self) -> None:
        check_int("step", self.step, 0)

    def next_after(self, step: int) -> int | None:
        """``step`` when it is still ahead of ``step``, else None."""
        return self.step if self.step > step else None


DecisionSteps: TypeAlias = Every | At
"""A declared set of decision steps."""


class StepClock:
    """The declared decision steps, and the next decision step after a given one.

    Declarations come and go on the event-loop thread; the training thread reads
    :meth:`next_decision` (the declarations are a tuple replaced on change, so a reader always sees
    a consistent set) and re-reads it only when the doorbell rang (every change rings it).
    """

    def __init__(self, doorbell: Doorbell | None = None) -> None:
        self._doorbell = doorbell or Doorbell()
        self._ids = itertools.count()
        self._declared: dict[int, DecisionSteps] = {}
        self._decision_steps: tuple[DecisionSteps, ...] = ()

    def declare(self, *decision_steps: DecisionSteps) -> list[int]:
        """Add ``decision_steps``; returns their keys for :meth:`remove`."""
        keys = []
        for steps in decision_steps:
            key = next(self._ids)
            self._declared[key] = steps
            keys.append(key)
        self._changed()
        return keys

    def remove(self, keys: list[int]) -> None:
        """Remove the decision steps of ``keys`` (idempotent)."""
        for key in keys:
            self._declared.pop(key, None)
        self._changed()

    def _changed(self) -> None:
        self._decision_steps = tuple(self._declared.values())
        self._doorbell.ring()  # after the change: the loop that hears it reads the new set

    @property
    def decision_steps(self) -> tuple[DecisionSteps, ...]:
        """Every declaration, in order of declaration."""
        return self._decision_steps

    def next_decision(self, after_step: int) -> int | None:
        """The smallest declared decision step greater than ``after_step`` (None: none)."""
        best: int | None = None
        for steps in self._decision_steps:
            step = steps.next_after(after_step)
            if step is not None and (best is None or step < best):
                best = step
        return best


_ITEM_STEP: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "trainbus_item_step", default=None
)
"""The step of the item an async worker is running (set around each item)."""


class DecisionStamp:
    """Which step is being handled on this thread now: what ``bus.send`` stamps on a command.

    ``step`` is set by the dispatch slice for each event it delivers (a plain attribute: it is
    written once per dispatched event) and reset to None after the slice; async workers set a
    context variable around each item (:meth:`item`). Commands sent from anywhere else (another
    thread, a signal handler) get None: "as soon as possible".
    """

    __slots__ = ("event_id", "loop_thread", "step")

    def __init__(self) -> None:
        self.step: int | None = None
        """Step of the event the dispatch slice is delivering (None outside a slice)."""
        self.event_id = 0
        """``id()`` of the event the dispatch slice is delivering or delivered last: an async
        subscription notes it with each item, so a barrier knows who received its event even
        after the poller dispatched it (an id, not the event: holding the event here would
        free its tensors on the event-loop thread, see ``spent.py``)."""
        self.loop_thread: int | None = None
        """The thread of the last dispatch slice (the event-loop thread while the bus runs)."""

    def current(self) -> int | None:
        """The step of the event being handled by the caller, or None."""
        if self.step is not None and threading.get_ident() == self.loop_thread:
            return self.step
        return _ITEM_STEP.get()

    @staticmethod
    def item(step: int | None) -> contextvars.Token[int | None]:
        """An async worker starts an item of ``step``; reset the token when it is done."""
        return _ITEM_STEP.set(step)

    @staticmethod
    def done(token: contextvars.Token[int | None]) -> None:
        """The async worker finished the item of ``token``."""
        _ITEM_STEP.reset(token)

"""The routing table: which root observers each event type goes to, in tier order.

A *root* is one subscription at the top of a chain (a ``bus.events`` / ``bus.stream(...)``
subscription): the event types it takes and the observer to feed. Roots are kept sorted by tier
(internal, core, user, global), then by order of subscription. The per-type answer is cached in
:attr:`RouteTable.cache`, a dict that is replaced (copy-on-write), never mutated in place, so a
dispatch in progress keeps a consistent view while a subscriber subscribes.

A *sampled* root takes only some events, decided where the event is routed:
``bus.stream(T, every_s=s)`` the first event, then none whose ``time`` is less than ``s``
seconds after the last one it took (``throttle_first`` on the events' own clock);
``bus.stream(T, every_steps=n)`` the events whose ``step`` is a multiple of ``n``. The table
keeps, per event type asked about, a :class:`Demand`: whether some root takes every event,
and otherwise which event a sampled one takes next. A publisher that builds events only for
subscribers (the training loop) asks it (:meth:`Demand.takes`) and builds no event nobody
will take; the sampling itself stays in here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal

from reactivex import abc

from .._exceptions import ConfigError
from .doorbell import Doorbell

__all__ = ["Demand", "Root", "RouteTable", "Sampled", "Tier", "TierContext"]

Tier = Literal["internal", "core", "user", "global"]
TIER_ORDER = {"internal": 0, "core": 1, "user": 2, "global": 3}


class Root:
    """One subscription at the top of a chain: the types it takes and the observer to feed
    (for a sampled root, its :class:`Sampled` gate)."""

    __slots__ = ("observer", "order", "types")

    def __init__(self, types: tuple[type, ...], observer: abc.ObserverBase[Any], order: int):
        self.types = types
        self.observer = observer
        self.order = order


class Demand:
    """What the subscriptions of one event type take: every event, a sample, or nothing.

    Kept up to date by the :class:`RouteTable` on the event-loop thread (the same object for
    the table's lifetime); the publisher reads it from its own thread and never sees how the
    sampling is done. A time-sampled event the publisher is told to build moves the due time
    on by the shortest ``every_s`` at once, on the publisher's thread, and again from the
    event's stamp once it is built (:meth:`built`), the time the gates measure from: however
    late the event loop delivers it (when the gates set the exact due times), no other is
    built meanwhile, and the next one built is not refused for being stamped short of it.

    Attributes:
        each: Some subscription takes every event of the type.
        sampled: No subscription takes every event, but a sampled one (``every_s`` /
            ``every_steps``) takes some: ask :meth:`takes` for each event.
    """

    __slots__ = ("_at", "_every_s", "_periods", "_timed", "each", "sampled")

    def __init__(self) -> None:
        self.each = False
        self.sampled = False
        self._at = math.inf
        self._every_s = math.inf
        self._periods: tuple[int, ...] = ()
        self._timed = False  # the last yes was a time gate's: built() moves its due time

    def takes(self, step: int, now: float) -> bool:
        """True when some subscription takes the event of ``step`` stamped ``now`` (a
        ``time.monotonic()`` value). One call, asked only while :attr:`sampled`: a time-sampled
        subscription whose next event is due by ``now``, or a step-sampled one whose
        ``every_steps`` divides ``step``."""
        if self.each:
            return True
        if now >= self._at:
            # A gate takes it: none is due before every_s from now. (A delivery's exact due
            # time racing this write costs at most one event more, or one a little later.)
            self._at = now + self._every_s
            self._timed = True
            return True
        for n in self._periods:  # a loop, not any() over a generator: asked once a step
            if step % n == 0:
                return True
        return False

    def built(self, at: float) -> None:
        """The event :meth:`takes` said yes to is stamped ``at`` (its ``time``, at the step's
        end): a time gate measures the next one from there, so the next is due ``every_s``
        after it. Until a delivery sets the exact due time (a held event loop delivers late),
        the next event is then built where the gate passes it, not short of it, refused, and
        its sample left to the interval after."""
        if self._timed:
            self._timed = False
            self._at = at + self._every_s

    def update(self, each: bool, gates: list[Sampled], *, passed: bool = False) -> None:
        """Set the demand from the type's roots: ``each`` (some root takes every event) and
        the gates of its sampled roots (the table calls it on every change).

        Args:
            each: Some root takes every event of the type.
            gates: The gates of its sampled roots.
            passed: Called because a gate passed an event. The due time then only moves on:
                the publisher may have built newer events than the one delivered (a held
                event loop delivers late), and going back to the delivered one's due time
                would have it build events the gates then refuse. After a refusal or a change
                of the roots it is the gates' exact due time, earlier or not.
        """
        exact = min((g.next_at for g in gates), default=math.inf)
        self._at = max(exact, self._at) if passed else exact
        self._every_s = min((g.every_s for g in gates if g.every_s is not None), default=math.inf)
        self._periods = tuple(sorted({g.every_steps for g in gates if g.every_steps}))
        self.sampled = not each and bool(gates)
        self.each = each


class Sampled(abc.ObserverBase[Any]):
    """The gate of a sampled root. Time-sampled (``every_s``): passes an event whose ``time``
    is at least ``every_s`` after the last one it passed (the first always), then tells the
    table its next due time. Step-sampled (``every_steps``): passes the events whose ``step``
    is a multiple of it.

    The publisher builds an event when its own estimate of the due time (``Demand.takes``:
    the step's start plus ``every_s``) says so; an event stamped at the step's end can still
    fall short of the exact due time and be refused. The first refusal after a pass tells the
    table too, so the publisher builds again at the exact due time rather than an interval
    later.

    Args:
        observer: The subscription's observer.
        every_s: The least time between two events passed, in seconds; or None.
        every_steps: The step period; or None (exactly one of the two is given).
        passed: Called after a time-sampled event passed (with True), and after the first
            one refused since (with False): the table recomputes its due times.
    """

    __slots__ = ("_observer", "_passed", "_told", "every_s", "every_steps", "next_at")

    def __init__(
        self,
        observer: abc.ObserverBase[Any],
        every_s: float | None,
        every_steps: int | None,
        passed: Callable[[bool], None],
    ) -> None:
        self._observer = observer
        self._passed = passed
        self._told = False  # the table was told of a refusal since the last pass
        self.every_s = every_s
        self.every_steps = every_steps
        self.next_at = -math.inf if every_s is not None else math.inf

    def on_next(self, value: Any) -> None:
        if self.every_steps is not None:
            if value.step % self.every_steps == 0:
                self._observer.on_next(value)
            return
        assert self.every_s is not None
        t = value.time
        if t < self.next_at:
            if not self._told:
                self._told = True
                self._passed(False)
            return
        self.next_at = t + self.every_s
        self._told = False
        self._passed(True)
        self._observer.on_next(value)

    def on_error(self, error: Exception) -> None:
        self._observer.on_error(error)

    def on_completed(self) -> None:
        self._observer.on_completed()


class TierContext:
    """``with bus.tier("core"):`` sets the table's current tier, and restores it on exit."""

    def __init__(self, table: RouteTable, tier: Tier) -> None:
        self._table = table
        self._tier: Tier = tier
        self._previous: Tier = table.current_tier

    def __enter__(self) -> None:
        self._previous = self._table.current_tier
        self._table.current_tier = self._tier

    def __exit__(self, *exc: object) -> None:
        self._table.current_tier = self._previous


class RouteTable:
    """Roots by tier, the per-type route cache, and the demand answers built on it."""

    def __init__(self, doorbell: Doorbell | None = None) -> None:
        self._doorbell = doorbell or Doorbell()
        self._roots: list[Root] = []
        self._seq = 0
        self.cache: dict[type, tuple[abc.ObserverBase[Any], ...]] = {}
        """Event type -> observers, in delivery order. Replaced on every change (copy-on-write):
        read it, never write it; a miss is answered by :meth:`resolve`."""
        self.current_tier: Tier = "user"
        """Tier of the roots registered now (see :meth:`tier`)."""
        self._demands: dict[type, Demand] = {}
        """Event type -> its Demand, for the types a publisher asked about (:meth:`demand`)."""

    def wants(self, event_type: type) -> bool:
        """True when some root would receive events of ``event_type``."""
        routes = self.cache.get(event_type)
        if routes is None:
            routes = self.resolve(event_type)
        return bool(routes)

    def demand(self, event_type: type) -> Demand:
        """The :class:`Demand` of ``event_type``: kept up to date as roots of that type come,
        go and take events (the same object for the table's lifetime)."""
        demand = self._demands.get(event_type)
        if demand is None:
            demand = self._demands[event_type] = Demand()
            self._update_demands()
        return demand

    def _update_demands(self, passed: bool = False) -> None:
        for event_type, demand in self._demands.items():
            roots = [r.observer for r in self._roots if issubclass(event_type, r.types)]
            gates = [o for o in roots if isinstance(o, Sampled)]
            demand.update(len(gates) < len(roots), gates, passed=passed)

    def resolve(self, event_type: type) -> tuple[abc.ObserverBase[Any], ...]:
        """The observers ``event_type`` goes to, computed and cached."""
        observers = tuple(r.observer for r in self._roots if issubclass(event_type, r.types))
        routes = dict(self.cache)  # copy-on-write: a dispatch in progress keeps its view
        routes[event_type] = observers
        self.cache = routes
        return observers

    def register(
        self,
        types: tuple[type, ...],
        observer: abc.ObserverBase[Any],
        tier: Tier | None = None,
        *,
        every_s: float | None = None,
        every_steps: int | None = None,
    ) -> Root:
        """Add a root in ``tier`` (default: the current tier) and return it; with ``every_s``
        or ``every_steps``, a sampled root (see the module's docstring)."""
        # Sorted by tier, then by order of subscription: core -> user -> global.
        self._seq += 1
        rank = TIER_ORDER[tier or self.current_tier]
        if every_s is not None or every_steps is not None:
            observer = Sampled(observer, every_s, every_steps, self._update_demands)
        root = Root(types, observer, rank * 1_000_000_000 + self._seq)
        self._roots.append(root)
        self._roots.sort(key=lambda r: r.order)
        self.cache = {}
        self._update_demands()
        self._doorbell.ring()  # after the change: the loop that hears it re-reads its demand
        return root

    def unregister(self, root: Root) -> None:
        """Remove ``root`` (idempotent)."""
        if root in self._roots:
            self._roots.remove(root)
            self.cache = {}
            self._update_demands()
            self._doorbell.ring()

    def observers(self) -> list[abc.ObserverBase[Any]]:
        """Every root observer, in delivery order (a copy: closing completes them)."""
        return [r.observer for r in self._roots]

    def tier(self, tier: Tier) -> TierContext:
        """A context manager under which new roots register in ``tier``.

        Raises:
            ConfigError: ``tier`` is not one of internal, core, user, global.
        """
        if tier not in TIER_ORDER:
            raise ConfigError.invalid("tier", tier, f"one of {tuple(TIER_ORDER)}")
        return TierContext(self, tier)

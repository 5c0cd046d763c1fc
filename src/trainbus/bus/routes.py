"""The routing table: which root observers each event type goes to, in tier order.

A *root* is one subscription at the top of a chain (a ``bus.events`` / ``bus.stream(...)``
subscription): the event types it takes and the observer to feed. Roots are kept sorted by tier
(internal, core, user, global), then by order of subscription. The per-type answer is cached in
:attr:`RouteTable.cache`, a dict that is replaced (copy-on-write), never mutated in place, so a
dispatch in progress keeps a consistent view while a subscriber subscribes.
"""

from __future__ import annotations

from typing import Any, Literal

from reactivex import abc

from .._exceptions import ConfigError
from .doorbell import Doorbell

__all__ = ["Root", "RouteTable", "Tier", "TierContext"]

Tier = Literal["internal", "core", "user", "global"]
TIER_ORDER = {"internal": 0, "core": 1, "user": 2, "global": 3}


class Root:
    """One subscription at the top of a chain: the types it takes and the observer to feed."""

    __slots__ = ("observer", "order", "types")

    def __init__(self, types: tuple[type, ...], observer: abc.ObserverBase[Any], order: int):
        self.types = types
        self.observer = observer
        self.order = order


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
        self.version = 0
        """Bumped whenever a root comes or goes: a publisher caching :meth:`wants` answers
        re-reads them when this changes (one int compare per step)."""
        self.current_tier: Tier = "user"
        """Tier of the roots registered now (see :meth:`tier`)."""

    def wants(self, event_type: type) -> bool:
        """True when some root would receive events of ``event_type``."""
        routes = self.cache.get(event_type)
        if routes is None:
            routes = self.resolve(event_type)
        return bool(routes)

    def resolve(self, event_type: type) -> tuple[abc.ObserverBase[Any], ...]:
        """The observers ``event_type`` goes to, computed and cached."""
        observers = tuple(r.observer for r in self._roots if issubclass(event_type, r.types))
        routes = dict(self.cache)  # copy-on-write: a dispatch in progress keeps its view
        routes[event_type] = observers
        self.cache = routes
        return observers

    def register(
        self, types: tuple[type, ...], observer: abc.ObserverBase[Any], tier: Tier | None = None
    ) -> Root:
        """Add a root in ``tier`` (default: the current tier) and return it."""
        # Sorted by tier, then by order of subscription: core -> user -> global.
        self._seq += 1
        rank = TIER_ORDER[tier or self.current_tier]
        root = Root(types, observer, rank * 1_000_000_000 + self._seq)
        self._roots.append(root)
        self._roots.sort(key=lambda r: r.order)
        self.cache = {}
        self.version += 1
        self._doorbell.ring()
        return root

    def unregister(self, root: Root) -> None:
        """Remove ``root`` (idempotent)."""
        if root in self._roots:
            self._roots.remove(root)
            self.cache = {}
            self.version += 1
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

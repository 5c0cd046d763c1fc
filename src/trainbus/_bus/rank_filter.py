"""Which ranks a subscription runs on under ``torchrun``.

A subscription runs on rank 0 by default; ``ranks="all"`` (or an int, or a set of ranks) per
subscription, or for every subscription made inside ``with bus.on_ranks(...)`` (what a
``Callback`` with a ``ranks`` attribute gets). A subscription not for this rank registers
nothing: no route, so ``bus.wants()`` stays false and the loop builds no event for it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Literal, TypeAlias

from .._exceptions import ConfigError

__all__ = ["RankFilter", "Ranks", "env_rank"]

Ranks: TypeAlias = int | Iterable[int] | Literal["all"] | None
"""``None`` (the default: rank 0, or what ``bus.on_ranks`` set), ``"all"``, a rank, or ranks."""


def env_rank(env: Mapping[str, str] | None = None) -> int:
    """This process' rank from torchrun's ``RANK`` variable (0 when unset).

    Raises:
        ConfigError: ``RANK`` is set but not an integer >= 0.
    """
    text = (os.environ if env is None else env).get("RANK")
    if text is None or text == "":
        return 0
    try:
        rank = int(text)
    except ValueError:
        raise ConfigError.invalid("RANK", text, "an integer >= 0 (set by torchrun)") from None
    if rank < 0:
        raise ConfigError.invalid("RANK", rank, "an integer >= 0 (set by torchrun)")
    return rank


def _normalise(ranks: Ranks) -> frozenset[int] | Literal["all"] | None:
    if ranks is None or ranks == "all":
        return ranks
    if isinstance(ranks, bool):
        raise ConfigError.invalid("ranks", ranks, "None, 'all', a rank or an iterable of ranks")
    if isinstance(ranks, int):
        ranks = (ranks,)
    if isinstance(ranks, str) or not isinstance(ranks, Iterable):
        raise ConfigError.invalid("ranks", ranks, "None, 'all', a rank or an iterable of ranks")
    out = frozenset(ranks)
    if not out or any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in out):
        raise ConfigError.invalid("ranks", ranks, "a non-empty set of integers >= 0")
    return out


class RankFilter:
    """This bus' rank and the default ranks of new subscriptions.

    Args:
        rank: This process' rank.
    """

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._default: frozenset[int] | Literal["all"] = frozenset({0})

    def runs_here(self, ranks: Ranks) -> bool:
        """True when a subscription for ``ranks`` runs on this rank.

        Raises:
            ConfigError: ``ranks`` is not None, ``"all"``, a rank or ranks.
        """
        chosen = _normalise(ranks)
        if chosen is None:
            chosen = self._default
        return chosen == "all" or self.rank in chosen

    @contextmanager
    def default(self, ranks: Ranks) -> Iterator[None]:
        """Subscriptions made inside without ``ranks=`` run on ``ranks`` (None: unchanged).

        Raises:
            ConfigError: ``ranks`` is not None, ``"all"``, a rank or ranks.
        """
        chosen = _normalise(ranks)
        previous = self._default
        if chosen is not None:
            self._default = chosen
        try:
            yield
        finally:
            self._default = previous

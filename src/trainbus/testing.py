"""Helpers for testing code built on trainbus: record events, control time, tiny models and
data (docs/testing.md)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from reactivex import Observable
from reactivex.scheduler import VirtualTimeScheduler as _RxVirtualTimeScheduler

from . import events as ev
from ._validate import check_int

if TYPE_CHECKING:
    import torch

    from ._bus import EventBus
    from ._bus.subscriptions import Subscription

__all__ = ["EventRecorder", "NaNLossAt", "VirtualTimeScheduler", "tiny_loader", "tiny_model"]

_E = TypeVar("_E", bound=ev.BaseEvent)


class VirtualTimeScheduler(_RxVirtualTimeScheduler):
    """Virtual time in seconds, from 0. ``advance_by(1.5)`` runs what falls due meanwhile."""

    def __init__(self, initial_clock: float = 0.0) -> None:
        super().__init__(float(initial_clock))

    @classmethod
    def add(cls, absolute: Any, relative: Any) -> float:
        return float(cls.to_seconds(absolute)) + float(cls.to_seconds(relative))

    @property
    def seconds(self) -> float:
        """Virtual seconds elapsed."""
        return float(self.to_seconds(self.clock))


class EventRecorder:
    """Records every item of a bus stream (default: all events) in arrival order.

    Args:
        bus: The bus to record from.
        source: What to record (default ``bus.events``); any bus observable.

    Attributes:
        items: What was received, in order.
        completed: True once the bus closed (the stream completed).
    """

    def __init__(self, bus: EventBus, source: Observable[Any] | None = None) -> None:
        self.items: list[Any] = []
        self.completed = False
        self.subscription: Subscription = bus.subscribe(
            source if source is not None else bus.events,
            self.items.append,
            on_completed=self._complete,
            name="EventRecorder",
        )

    def _complete(self) -> None:
        self.completed = True

    def of_type(self, event_type: type[_E]) -> list[_E]:
        """The recorded events of ``event_type`` (subclasses included)."""
        return [e for e in self.items if isinstance(e, event_type)]

    def names(self) -> list[str]:
        """Class names of the recorded items, in order (handy for transcripts)."""
        return [type(e).__name__ for e in self.items]

    def clear(self) -> None:
        """Forget what was recorded."""
        self.items.clear()

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.items)


def tiny_model(
    in_features: int = 32, hidden: int = 64, out_features: int = 10, *, seed: int = 0
) -> torch.nn.Module:
    """The 32-64-10 MLP of the tests and benchmarks, initialised from ``seed``."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(in_features, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, out_features)
    )
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model


class NaNLossAt:
    """A ``loss_fn`` whose ``n``-th calls (1-based) return NaN; the others cross-entropy.

    Args:
        calls: The calls that return NaN (the evaluation's calls count too).

    Attributes:
        calls: How many times it was called.
    """

    def __init__(self, *calls: int) -> None:
        self.bad, self.calls = set(calls), 0

    def __call__(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        import torch.nn.functional as F

        self.calls += 1
        loss = F.cross_entropy(outputs, targets)
        return loss * float("nan") if self.calls in self.bad else loss


def tiny_loader(
    batches: int = 8,
    batch_size: int = 32,
    in_features: int = 32,
    classes: int = 10,
    *,
    seed: int = 0,
) -> Sequence[tuple[torch.Tensor, torch.Tensor]]:
    """A list of ``batches`` generated ``(inputs, targets)`` batches with a learnable signal.

    ``seed`` draws the class centres too, so loaders of two seeds are two different tasks:
    take training and validation data from one loader
    (``data = tiny_loader(10); train, val = data[:8], data[8:]``).

    Raises:
        ConfigError: a size below 1.
    """
    import torch

    check_int("batches", batches, 1)
    check_int("batch_size", batch_size, 1)
    gen = torch.Generator().manual_seed(seed)
    centers = torch.randn(classes, in_features, generator=gen)
    out = []
    for _ in range(batches):
        y = torch.randint(0, classes, (batch_size,), generator=gen)
        x = centers[y] + 0.5 * torch.randn(batch_size, in_features, generator=gen)
        out.append((x, y))
    return out

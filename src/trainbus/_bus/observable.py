"""The Observable the bus hands out, and the Observer that is its back-channel.

RxPY passes the scheduler from the subscriber towards the source: the ``scheduler`` given to
the *last* ``subscribe`` of a chain becomes the default of every time-based operator above it.
A chain that starts at ``bus.events`` / ``bus.stream(...)`` is a :class:`BusObservable`, and so
is whatever its ``pipe()`` returns; its ``subscribe`` passes the bus' Rx scheduler and ends the
chain in a guarded observer, so ``bus.stream(X).pipe(ops.throttle_first(1.0)).subscribe(fn)``
runs the throttle on the bus' loop and isolates ``fn``'s failures without any extra call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

from reactivex import Observable, abc

from .. import commands as cmd
from .._exceptions import ConfigError
from .clock import DecisionSteps
from .failures import ErrorPolicy
from .subscriptions import Subscription

__all__ = ["BusChains", "BusObservable", "CommandSink", "normalize_observer"]

_T = TypeVar("_T")
_T_co = TypeVar("_T_co", covariant=True)


class BusChains(Protocol):
    """What a :class:`BusObservable` needs of its bus (the bus' ``Chains`` provides it)."""

    @property
    def rx_scheduler(self) -> abc.SchedulerBase:
        """The scheduler handed to chains: timers on the bus' Rx scheduler, "now" work inline."""
        ...

    def subscribe_observer(
        self,
        source: Observable[Any],
        observer: Any,
        on_rx_error: Any = None,
        on_completed: Any = None,
        *,
        on_error: ErrorPolicy | None = None,
        name: str | None = None,
        scheduler: abc.SchedulerBase | None = None,
        ranks: Any = None,
    ) -> Subscription:
        """Subscribe ``observer`` to ``source`` behind the bus' guard."""
        ...

    def declare(self, decision_steps: tuple[DecisionSteps, ...]) -> abc.DisposableBase:
        """Declare decision steps until the returned disposable is disposed."""
        ...


class BusObservable(Observable[_T], Generic[_T]):
    """An Observable born on the bus: ``pipe`` keeps it a bus observable, ``subscribe`` guards
    the observer and hands the bus' Rx scheduler to the chain's time-based operators.

    ``decision_steps`` are those of the operators piped so far (an operator with a
    ``decision_steps`` attribute, like ``tbops.every(n)``): subscribing declares them to the bus'
    step clock for the subscription's lifetime. A stream of events that are never published per step
    (``bus.stream(ev.EpochEnded)``) has ``per_step=False`` and declares nothing: its own events
    are barriers or arrive rarely, and decision steps there would only add barriers.
    """

    def __init__(
        self,
        chains: BusChains,
        source: Observable[_T],
        decision_steps: tuple[DecisionSteps, ...] = (),
        *,
        per_step: bool = True,
    ) -> None:
        super().__init__()
        self.chains = chains
        self.source = source
        self.decision_steps = decision_steps
        self.per_step = per_step

    def _subscribe_core(
        self, observer: abc.ObserverBase[_T], scheduler: abc.SchedulerBase | None = None
    ) -> abc.DisposableBase:
        return self.source.subscribe(observer, scheduler=scheduler or self.chains.rx_scheduler)

    def pipe(self, *operators: Callable[[Any], Any]) -> Any:
        """Compose operators left to right; the result is still a bus observable."""
        # Operators subscribe to their source; give them the raw chain, not this guarded
        # observable, so only the last subscribe of a pipeline is guarded and counted.
        result = Observable(self._subscribe_core).pipe(*operators)
        decision_steps = self.decision_steps
        if self.per_step:
            decision_steps += tuple(
                s for op in operators if (s := getattr(op, "decision_steps", None)) is not None
            )
        if isinstance(result, Observable) and not isinstance(result, BusObservable):
            return BusObservable(self.chains, result, decision_steps, per_step=self.per_step)
        return result

    def subscribe(  # type: ignore[override]  # on_error= is the policy, as on the bus
        self,
        on_next: abc.ObserverBase[_T] | Callable[[_T], Any] | None = None,
        on_rx_error: Callable[[Exception], Any] | None = None,
        on_completed: Callable[[], Any] | None = None,
        *,
        on_error: ErrorPolicy | None = None,
        scheduler: abc.SchedulerBase | None = None,
        name: str | None = None,
        ranks: Any = None,
    ) -> Subscription:
        """Subscribe under the bus' guard.

        The positional slots are RxPY's (``subscribe(on_next, on_error, on_completed)``), so
        reactivex operators that subscribe to a bus chain with callbacks keep working; by
        keyword, ``on_error=`` is the error policy, as in ``bus.subscribe`` and
        ``bus.subscribe_async``.

        Args:
            on_next: A function of one item, or an Rx observer (``bus.commands`` included).
            on_rx_error: The Rx error callback of a function ``on_next``: called with an
                error the chain itself emits (RxPY's second positional argument).
            on_completed: Called when the bus closes.
            on_error: What a failure of ``on_next`` does: ``"log"``, ``"stop"`` or
                ``"raise"`` (default: the bus' ``on_error``).
            scheduler: Overrides the bus' Rx scheduler for this chain.
            name: Name in logs and statistics.
            ranks: Where it runs under torchrun: None (rank 0, or the ``bus.on_ranks``
                default), ``"all"``, a rank or an iterable of ranks.

        Returns:
            The :class:`~trainbus.bus.Subscription` (an Rx disposable).

        Raises:
            ConfigError: ``on_next`` is neither callable nor an observer; ``on_rx_error`` or
                ``on_completed`` is not callable; unknown policy.
        """
        sub = self.chains.subscribe_observer(
            self.source,
            on_next,
            on_rx_error,
            on_completed,
            on_error=on_error,
            name=name,
            scheduler=scheduler,
            ranks=ranks,
        )
        if self.decision_steps and sub.active:
            sub.hold(self.chains.declare(self.decision_steps))
        return sub

    def subscribe_raw(self, observer: abc.ObserverBase[Any]) -> abc.DisposableBase:
        """Subscribe an internal observer directly (async feeders), with the bus' Rx scheduler."""
        return self.source.subscribe(observer, scheduler=self.chains.rx_scheduler)


class CommandSink(abc.ObserverBase[Any]):
    """``bus.commands``: the back-channel as an Rx Observer of commands.

    ``pipeline.subscribe(bus.commands)`` sends every command the pipeline emits; a non-command
    is a ``ConfigError``, reported as that subscription's failure.
    """

    def __init__(self, send: Callable[[cmd.Command], None]) -> None:
        self._send = send

    def send(self, command: cmd.Command) -> None:
        """Put ``command`` on the back-channel (what ``on_next`` does)."""
        self._send(command)

    def on_next(self, value: cmd.Command) -> None:
        self._send(value)

    def on_error(self, error: Exception) -> None:
        raise error

    def on_completed(self) -> None:
        return None


def normalize_observer(
    observer: Any, on_rx_error: Any, on_completed: Any
) -> tuple[Callable[[Any], Any], Any, Any]:
    """Split an Rx observer or callbacks into (on_next, on_rx_error, on_completed), validated.

    Raises:
        ConfigError: ``observer`` is neither callable nor an observer, or a callback is not
            callable.
    """
    if isinstance(observer, CommandSink):
        # Failures of a decision pipeline are the subscription's, under its policy (a
        # ConfigError from send() is reported, not re-raised into the pipeline).
        return observer.send, on_rx_error, on_completed
    if isinstance(observer, abc.ObserverBase):
        return observer.on_next, observer.on_error, observer.on_completed
    if observer is None or not callable(observer):
        raise ConfigError.invalid("on_next", observer, "a callable of one event, or an Rx observer")
    if isinstance(on_rx_error, str):  # a policy where RxPY's error callback goes
        raise ConfigError.invalid(
            "on_rx_error", on_rx_error,
            "an Rx error callback or None; an error policy goes in on_error=",
        )  # fmt: skip
    for field, value in (("on_rx_error", on_rx_error), ("on_completed", on_completed)):
        if value is not None and not callable(value):
            raise ConfigError.invalid(field, value, "a callable or None")
    return observer, on_rx_error, on_completed

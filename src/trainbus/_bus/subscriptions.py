"""Subscriptions: their records and statistics (each one its chain's observer), async workers,
back-pressure, ranks, and the :class:`SubscriptionSet` every :class:`BusObservable` subscribes
through. Counters are plain ints touched on the event-loop thread only.
"""

from __future__ import annotations

import inspect
import os
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Any, Generic, Literal, TypeAlias, TypeVar, get_args

import anyio
from reactivex import Observable, abc
from reactivex.disposable import CompositeDisposable

from .._exceptions import BusClosedError, ConfigError
from .._log import get_logger
from .._validate import check_int
from .commands import ITEM_STEP, CommandSink, DecisionStamp, DecisionSteps, Doorbell, StepClock
from .scheduler import ChainScheduler, TaskSet
from .watchdog import ErrorPolicy, FailureLedger, Watchdog, check_policy, name_of

__all__ = [
    "OVERFLOWS",
    "AsyncSubscription",
    "BusObservable",
    "BusStatistics",
    "LostWork",
    "Overflow",
    "RankFilter",
    "Ranks",
    "Subscription",
    "SubscriptionSet",
    "SubscriptionStatistics",
    "env_rank",
]

log = get_logger(__name__)


# ================================================================== statistics
@dataclass(frozen=True, slots=True, kw_only=True)
class SubscriptionStatistics:
    """A snapshot of one subscription's counters."""

    name: str
    kind: Literal["sync", "async"]
    active: bool
    received: int
    """Items that reached the subscription (after its operators)."""
    delivered: int
    """Items handed to the subscriber's function."""
    completed: int
    """Calls of the function that returned or raised (async: finished awaits)."""
    failed: int
    dropped: int
    """Items discarded by the overflow policy (async only)."""
    queued: int
    """Items waiting in the buffer (async only)."""
    in_flight: int
    cancelled: int
    """Items waiting or running when cancelled (``close_timeout``, ``cancel_pending()``)."""
    last_error: str | None
    stalls: int = 0
    """Calls that blocked the event-loop thread past the bus' ``watchdog_s`` (sync only)."""
    blocked_s: float = 0.0
    """Seconds those calls blocked the event loop (to within the watchdog's poll)."""
    waited_s: float = 0.0
    """Seconds the training thread waited on it (a full ``"block"`` buffer, a barrier: a
    decider's wait, a sync subscriber's backlog)."""
    end_waited_s: float = 0.0
    """Seconds the ends of calls (and the close) waited for this async subscription to finish
    what it had received, each at most ``close_timeout``."""

    @property
    def lost_work(self) -> LostWork:
        """What this subscription lost: items dropped, cancelled, or whose call failed."""
        return LostWork(dropped=self.dropped, cancelled=self.cancelled, failed=self.failed)


@dataclass(frozen=True, slots=True, kw_only=True)
class LostWork:
    """Work one subscription never did (``FitResult.lost_work``).

    Attributes:
        dropped: Items its overflow policy dropped (``"drop_oldest"``, ``"latest"``).
        cancelled: Items waiting or running when they were cancelled (``close_timeout``,
            ``EventBus.cancel_pending()``).
        failed: Calls that raised (and upstream errors that ended its stream).
    """

    dropped: int = 0
    cancelled: int = 0
    failed: int = 0

    @property
    def total(self) -> int:
        """dropped + cancelled + failed."""
        return self.dropped + self.cancelled + self.failed

    def __bool__(self) -> bool:
        return self.total > 0

    def __add__(self, other: LostWork) -> LostWork:
        """The lost work of two subscriptions (or two calls) together, count by count."""
        return LostWork(
            dropped=self.dropped + other.dropped,
            cancelled=self.cancelled + other.cancelled,
            failed=self.failed + other.failed,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class BusStatistics:
    """A snapshot of the whole bus."""

    published: int
    """Events accepted by ``publish`` (delivered plus still queued)."""
    delivered: int
    """Events taken off the queue and dispatched to every matching subscription."""
    queue_depth: int
    dropped: int
    failed: int
    cancelled: int
    publisher_waits: int
    """Times a publishing thread waited because the queue was full (``max_queue``)."""
    subscriptions: tuple[SubscriptionStatistics, ...]


# ================================================================== back-pressure
_SLICE = 0.05
"""Seconds between two looks of a waiting training thread (its waits are counted per slice)."""


def _remedies(overflow: str) -> str:
    """What helps a subscriber that cannot keep up, ``overflow`` the other policy to try."""
    return (
        f"a larger buffer=, a higher concurrency=, {overflow}, or sample at the stream: "
        "bus.stream(T, every_steps=n) / bus.stream(T, every_s=x)"
    )


class Backpressure:
    """The ``"block"`` subscriptions over capacity (changed on the event-loop thread), and the
    training thread's wait for them (it reads ``active``)."""

    __slots__ = ("_doorbell", "_holders", "_room", "active")

    def __init__(self, doorbell: Doorbell) -> None:
        self.active = False
        self._doorbell = doorbell
        self._holders: dict[int, AsyncSubscription] = {}
        self._room = threading.Event()
        self._room.set()

    def signal(self, sub: AsyncSubscription) -> None:
        """``sub``'s buffer went over capacity (event-loop thread)."""
        if id(sub) in self._holders:
            return
        self._holders[id(sub)] = sub
        self._room.clear()
        self.active = True
        self._doorbell.ring()  # after the change: the loop that hears it finds it active

    def relieve(self, sub: AsyncSubscription) -> None:
        """``sub`` is back within capacity, or will never take another item (loop thread)."""
        if self._holders.pop(id(sub), None) is not None and not self._holders:
            self.active = False
            self._room.set()

    def wait_for_room(self, stop: Callable[[], bool] | None = None) -> float:
        """Block while a ``"block"`` buffer is over capacity, until the doorbell rings or
        ``stop()``; return the seconds waited, each slice charged to the holders."""
        if not self.active:
            return 0.0
        bell = self._doorbell
        seen = bell.rings
        start = t = time.monotonic()
        while self.active and bell.rings == seen and not (stop is not None and stop()):
            holding = tuple(list(self._holders.values()))  # a snapshot: the loop thread edits
            for sub in holding:
                sub.announce_wait(
                    "its overflow='block' buffer is full: training goes at its pace so that "
                    "nothing is dropped",
                    _remedies(
                        "overflow='drop_oldest' or 'latest' (drops are counted as lost work)"
                    ),
                )
            self._room.wait(_SLICE)
            now = time.monotonic()
            for sub in holding:
                sub.waited_s += now - t
            t = now
        return t - start


# ================================================================== subscription records
class Subscription(abc.DisposableBase, abc.ObserverBase[Any]):
    """Handle of a bus subscription: dispose it to unsubscribe; read its ``statistics()``."""

    kind: Literal["sync", "async"] = "sync"

    def __init__(
        self,
        ledger: FailureLedger,
        name: str,
        policy: ErrorPolicy | None,
        fn: Callable[[Any], Any],
        watchdog: Watchdog | None = None,
        on_rx_error: Callable[[Exception], Any] | None = None,
        on_completed: Callable[[], Any] | None = None,
    ) -> None:
        self._ledger = ledger
        self.name = name
        self.policy = policy
        self._watchdog = watchdog
        self._fn = fn
        self._on_rx_error = on_rx_error
        self._on_completed = on_completed
        self.active = True
        self.received = 0
        self.completed = 0
        self.failed = 0
        self.dropped = 0
        self.cancelled = 0
        self.waited_s = 0.0
        self.end_waited_s = 0.0
        self.last_error: str | None = None
        self.stalls = 0
        self.blocked_s = 0.0
        self.busy_s = 0.0
        """Seconds its calls ran on the event-loop thread (sync; a barrier charges its share)."""
        self.in_flight = 0  # async: items its workers run now
        self.upstream: abc.DisposableBase | None = None  # the chain, and its decision steps
        self._stop_sent = False
        self._announced: set[str] = set()

    @property
    def delivered(self) -> int:
        return self.received - self.dropped

    def on_next(self, value: Any) -> None:
        """The end of its chain (sync): count, run the function, mark the call on the
        watchdog, report a failure to the ledger."""
        assert self._watchdog is not None
        self.received += 1
        watchdog = self._watchdog
        outer = watchdog.current  # a subscriber may flush(): the inner call restores it
        watchdog.current = self  # with received (just counted), it names this very call
        start = time.perf_counter()
        try:
            self._fn(value)
        except Exception as exc:
            self.fail(exc, value)
        finally:
            watchdog.current = outer
            self.busy_s += time.perf_counter() - start
        self.completed += 1

    def on_error(self, error: Exception) -> None:
        self.active = False
        if self._on_rx_error is None:
            self.fail(error, None, ended=True)
            return
        self.fail(error, None, handled=True)
        try:
            self._on_rx_error(error)
        except Exception as exc:
            self.fail(exc, None, ended=True)

    def on_completed(self) -> None:
        self.active = False
        if self._on_completed is not None:
            try:
                self._on_completed()
            except Exception as exc:
                self.fail(exc, None, ended=True)

    def fail(
        self, exc: Exception, item: Any, *, ended: bool = False, handled: bool = False
    ) -> None:
        """Count a failure and report it to the ledger, which applies this subscription's
        policy (``handled``: the user's Rx error callback handles it; only counted)."""
        self.failed += 1
        self.last_error = repr(exc)
        if handled:
            self._ledger.count()
        else:
            self._ledger.subscriber_failed(self, exc, item, ended=ended)

    def claim_stop(self) -> bool:
        """True the first time only: the ``"stop"`` policy sends one ``StopTraining``."""
        first, self._stop_sent = not self._stop_sent, True
        return first

    def announce_wait(self, reason: str, remedies: str) -> None:
        """Log ``training_waits_for_subscriber`` once per ``reason``: training waits on it."""
        if reason in self._announced:
            return
        self._announced.add(reason)
        log.warning(
            "training_waits_for_subscriber",
            subscription=self.name,
            received=self.received,  # counts: rates over the first items' microseconds mislead
            completed=self.completed,
            reason=reason,
            remedies=remedies,
        )

    def dispose(self) -> None:
        """Unsubscribe. Idempotent."""
        self.active = False
        if self.upstream is not None:
            self.upstream.dispose()

    def statistics(self) -> SubscriptionStatistics:
        """A frozen snapshot of this subscription's counters."""
        names = (f.name for f in fields(SubscriptionStatistics))
        return SubscriptionStatistics(**{name: getattr(self, name) for name in names})

    @property
    def queued(self) -> int:
        return 0

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} active={self.active}>"


# ================================================================== async subscriptions

Overflow: TypeAlias = Literal["block", "drop_oldest", "latest"]
"""What a full async buffer does (``subscribe_async(overflow=)``; docs/bus.md)."""
OVERFLOWS: tuple[str, ...] = get_args(Overflow)


class AsyncSubscription(Subscription):
    """An ``async def fn(item)`` fed from a bounded buffer by ``concurrency`` worker tasks.
    ``on_next`` never awaits: a full ``"block"`` buffer takes the item and signals back-pressure
    (the training loop waits for room, the dispatch does not)."""

    kind = "async"

    def __init__(
        self,
        ledger: FailureLedger,
        name: str,
        fn: Callable[[Any], Awaitable[Any]],
        *,
        concurrency: int,
        buffer: int,
        overflow: Overflow,
        policy: ErrorPolicy | None,
        backpressure: Backpressure,
        decides: bool,
        stamp: DecisionStamp,
    ) -> None:
        super().__init__(ledger, name, policy, fn)
        self.decides = decides
        """Barriers that deliver it an item wait for it (``EventBus.subscribe_async``)."""
        self.concurrency = concurrency
        self.capacity = buffer
        self.overflow = overflow
        self.buffer: deque[Any] = deque()
        self.started = 0
        self.input_closed = False
        self._backpressure = backpressure
        self._workers: TaskSet | None = None
        self._cancelling = False  # cancel() came: the workers stop (when they start)
        self._ready: anyio.Event | None = None
        # Which dispatched event pushed the last item, and the count after it (received_from).
        self._stamp = stamp
        self._source = 0
        self._source_count = 0
        self._progress: anyio.Event | None = None
        self._finished: anyio.Event | None = None
        self._suspending = False

    @property
    def delivered(self) -> int:
        return self.started

    @property
    def queued(self) -> int:
        return len(self.buffer)

    @property
    def settled(self) -> int:
        """Items that need no more work: dropped, finished or cancelled."""
        return self.dropped + self.completed + self.cancelled

    @property
    def finished(self) -> bool:
        return self._finished is not None and self._finished.is_set()

    @property
    def pending(self) -> int:
        """Items waiting or running: the work a close waits for."""
        return len(self.buffer) + self.in_flight

    def received_from(self, event_id: int) -> int | None:
        """When the last item came from the dispatched event with ``id() == event_id``: how
        many items it had received then; else None."""
        return self._source_count if self._source == event_id else None

    def on_next(self, item: Any) -> None:
        """Accept one item into the buffer (loop thread, never awaits)."""
        self.received += 1
        self._source = self._stamp.event_id
        self._source_count = self.received
        if self.finished:
            # Cancelled at close while the drain goes on: no worker will run it.
            self.cancelled += 1
            return
        buf = self.buffer
        if len(buf) >= self.capacity and self.overflow != "block":
            buf.popleft()
            self.dropped += 1
            if self.dropped == 1 and self.overflow == "drop_oldest":
                # Counts so far: a rate over the moments before the first drop means nothing.
                log.warning(
                    "subscriber_dropping",
                    subscription=self.name,
                    buffer=self.capacity,
                    received=self.received,
                    completed=self.completed,
                    action="its oldest waiting items are dropped from now on, counted as lost "
                    "work (FitResult.lost_work, bus_closed_with_lost_work at the end)",
                    remedies=_remedies(
                        "overflow='block' (training then waits for it, said and counted)"
                    ),
                )
        buf.append(item)
        if len(buf) > self.capacity:
            self._backpressure.signal(self)
        if self._ready is not None:
            self._ready.set()

    def on_error(self, error: Exception) -> None:
        self.fail(error, None, ended=True)
        self.on_completed()

    def on_completed(self) -> None:
        """No more items will come: workers finish the buffer and exit."""
        self.input_closed = True
        if self._ready is not None:
            self._ready.set()

    def dispose(self) -> None:
        super().dispose()
        self.on_completed()

    def start(self, tasks: TaskSet) -> None:
        """Start the workers among the bus' tasks (called once the bus runs)."""
        self._ready = anyio.Event()
        self._finished = anyio.Event()
        self._cancelling = False
        self._suspending = False
        self._workers = None
        tasks.start_soon(self._run, name=f"trainbus-subscriber:{self.name}")

    def suspend(self) -> None:
        """The bus suspends: the workers end (what they hold counts as cancelled); the
        subscription stays active and starts again with the bus."""
        self._suspending = True
        self.cancel()

    def cancel(self) -> None:
        """Cancel the workers; what they held and whatever arrives later counts as
        cancelled."""
        self._cancelling = True
        if self._workers is not None:
            self._workers.stop()

    async def _run(self) -> None:
        assert self._finished is not None
        try:
            async with anyio.create_task_group() as tg:
                workers = self._workers = TaskSet(tg)
                if self._cancelling:
                    workers.stop()
                for _ in range(self.concurrency):
                    workers.start_soon(self._worker)
        finally:
            self.cancelled += self.pending
            self.buffer.clear()
            self.in_flight = 0
            if not self._suspending:
                self.active = False
            self._backpressure.relieve(self)
            self._progressed()
            self._finished.set()

    async def _worker(self) -> None:
        buf = self.buffer
        while True:
            while not buf:
                if self.input_closed:
                    return
                assert self._ready is not None
                if self._ready.is_set():
                    self._ready = anyio.Event()
                await self._ready.wait()
            item = buf.popleft()
            if len(buf) <= self.capacity:
                self._backpressure.relieve(self)
            self.started += 1
            self.in_flight += 1
            # A command sent while running the item is stamped with the item's step.
            step = getattr(item, "step", None)
            token = ITEM_STEP.set(step if type(step) is int else None)
            try:
                await self._fn(item)
            except Exception as exc:
                self.fail(exc, item)
            finally:
                ITEM_STEP.reset(token)
            # Not in a ``finally``: a cancelled await stays in ``in_flight`` (_run: cancelled).
            self.in_flight -= 1
            self.completed += 1
            self._progressed()

    def _progressed(self) -> None:
        if self._progress is not None:
            self._progress.set()

    async def wait_settled(self, target: int) -> None:
        """Wait until ``target`` items have been dropped, finished or cancelled."""
        while self.settled < target and not self.finished:
            # Waiters share one event, so a second waiter never strands the first.
            if self._progress is None or self._progress.is_set():
                self._progress = anyio.Event()
            await self._progress.wait()

    async def wait_finished(self) -> None:
        """Wait until every worker has exited."""
        if self._finished is not None:
            await self._finished.wait()


# ================================================================== ranks
Ranks: TypeAlias = int | Iterable[int] | Literal["all"] | None
"""``None`` (the default: rank 0, or what ``bus.on_ranks`` set), ``"all"``, a rank, or ranks."""


def env_rank(env: Mapping[str, str] | None = None) -> int:
    """This process' rank from torchrun's ``RANK`` variable (0 when unset; ConfigError when
    not an integer >= 0)."""
    text = (os.environ if env is None else env).get("RANK")
    if text is None or text == "":
        return 0
    try:
        rank = int(text)
    except ValueError:
        rank = -1
    if rank < 0:
        raise ConfigError.invalid("RANK", text, "an integer >= 0 (set by torchrun)")
    return rank


def _normalise(ranks: Ranks) -> frozenset[int] | Literal["all"] | None:
    if ranks is None or ranks == "all":
        return ranks
    if isinstance(ranks, int) and not isinstance(ranks, bool):
        ranks = (ranks,)
    if isinstance(ranks, str | bool) or not isinstance(ranks, Iterable):
        raise ConfigError.invalid("ranks", ranks, "None, 'all', a rank or an iterable of ranks")
    out = frozenset(ranks)
    if not out or any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in out):
        raise ConfigError.invalid("ranks", ranks, "a non-empty set of integers >= 0")
    return out


class RankFilter:
    """This bus' rank and the default ranks of new subscriptions."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._default: frozenset[int] | Literal["all"] = frozenset({0})

    def runs_here(self, ranks: Ranks) -> bool:
        chosen = _normalise(ranks)
        if chosen is None:
            chosen = self._default
        return chosen == "all" or self.rank in chosen

    @contextmanager
    def default(self, ranks: Ranks) -> Iterator[None]:
        """Subscriptions made inside without ``ranks=`` run on ``ranks`` (None: unchanged)."""
        chosen = _normalise(ranks)
        previous = self._default
        if chosen is not None:
            self._default = chosen
        try:
            yield
        finally:
            self._default = previous


# ================================================================== chains
_T = TypeVar("_T")


class BusObservable(Observable[_T], Generic[_T]):
    """An Observable born on the bus: ``pipe`` keeps it a bus observable, ``subscribe`` guards
    the observer and hands the bus' Rx scheduler to the chain's time-based operators
    (docs/bus.md, "Streams")."""

    def __init__(
        self,
        subscriptions: SubscriptionSet,
        source: Observable[_T],
        decision_steps: tuple[DecisionSteps, ...] = (),
        *,
        per_step: bool = True,
    ) -> None:
        super().__init__()
        self.subscriptions = subscriptions
        self.source = source
        self.decision_steps = decision_steps
        self.per_step = per_step

    def _subscribe_core(
        self, observer: abc.ObserverBase[_T], scheduler: abc.SchedulerBase | None = None
    ) -> abc.DisposableBase:
        return self.source.subscribe(
            observer, scheduler=scheduler or self.subscriptions.rx_scheduler
        )

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
            return BusObservable(self.subscriptions, result, decision_steps, per_step=self.per_step)
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
        """Subscribe under the bus' guard; ``on_error=`` is the error policy, RxPY's error
        callback is ``on_rx_error`` (docs/bus.md, "Errors").

        Args:
            on_next: A function of one item, or an Rx observer (``bus.commands`` included).
            on_rx_error: The Rx error callback of a function ``on_next``: called with an
                error the chain itself emits.
            on_completed: Called when the bus closes.
            on_error: What a failure of ``on_next`` does: ``"log"``, ``"stop"`` or
                ``"raise"`` (default: the bus' ``on_error``).
            scheduler: Overrides the bus' Rx scheduler for this chain.
            name: Name in logs and statistics.
            ranks: Where it runs under torchrun (default rank 0; ``"all"``, a rank or ranks).

        Returns:
            The :class:`~trainbus.bus.Subscription` (an Rx disposable).

        Raises:
            ConfigError: ``on_next`` is neither callable nor an observer; ``on_rx_error`` or
                ``on_completed`` is not callable; one of them is ``async def`` (use
                ``bus.subscribe_async``); unknown policy.
        """
        return self.subscriptions.subscribe(
            self, on_next, on_rx_error, on_completed, on_error, name, ranks, scheduler
        )


def _is_async(fn: Callable[..., Any]) -> bool:
    """True for an ``async def`` function or method, a ``functools.partial`` of one, or an
    object whose ``__call__`` is ``async def``."""
    if inspect.iscoroutinefunction(fn):
        return True
    call = getattr(type(fn), "__call__", None)  # noqa: B004  (the class' own __call__)
    return not inspect.isfunction(fn) and inspect.iscoroutinefunction(call)


# ================================================================== the subscription set
class SubscriptionSet:
    """Every subscription of one bus, in order, and the back-pressure they share: what each
    :class:`BusObservable` subscribes through."""

    def __init__(
        self,
        ledger: FailureLedger,
        doorbell: Doorbell,
        stamp: DecisionStamp,
        watchdog: Watchdog,
        ranks: RankFilter,
        clock: StepClock,
        rx_scheduler: abc.SchedulerBase,
    ) -> None:
        self._stamp = stamp
        self._ledger = ledger
        self._watchdog = watchdog
        self._clock = clock
        self._subs: list[Subscription] = []
        self._tasks: TaskSet | None = None
        self._open = True
        self.ranks = ranks
        self.rx_scheduler: abc.SchedulerBase = ChainScheduler(rx_scheduler)
        self.backpressure = Backpressure(doorbell)

    def _check_open(self) -> None:
        if not self._open:
            raise BusClosedError("the bus is closed; subscribe before it closes")

    def close(self) -> None:
        """Refuse new subscriptions from now on."""
        self._open = False

    def subscribe(
        self,
        source: BusObservable[Any],
        observer: Any,
        on_rx_error: Any,
        on_completed: Any,
        on_error: ErrorPolicy | None,
        name: str | None,
        ranks: Ranks,
        scheduler: abc.SchedulerBase | None = None,
    ) -> Subscription:
        """:meth:`BusObservable.subscribe`; on a rank it does not run on, an inert
        subscription."""
        self._check_open()
        on_next = observer
        if isinstance(observer, CommandSink):
            # A ConfigError from send() is the subscription's failure, not the pipeline's.
            on_next = observer.send
        elif isinstance(observer, abc.ObserverBase):
            on_next = observer.on_next
            on_rx_error, on_completed = observer.on_error, observer.on_completed
        elif not callable(observer):
            allowed = "a callable of one event, or an Rx observer"
            raise ConfigError.invalid("on_next", observer, allowed)
        if isinstance(on_rx_error, str):  # a policy where RxPY's error callback goes
            allowed = "an Rx error callback or None; an error policy goes in on_error="
            raise ConfigError.invalid("on_rx_error", on_rx_error, allowed)
        callbacks = {"on_next": on_next, "on_rx_error": on_rx_error, "on_completed": on_completed}
        for field, value in callbacks.items():
            if value is not None and not callable(value):
                raise ConfigError.invalid(field, value, "a callable or None")
            if value is not None and _is_async(value):
                short = getattr(value, "__name__", "fn")
                allowed = (
                    "a plain function: an async def one would never run here (RxPY calls it and "
                    f"drops the coroutine); use bus.subscribe_async(stream, {short}), which "
                    "awaits it"
                )
                raise ConfigError.invalid(field, name_of(value), allowed)
        policy = check_policy(on_error)
        here = self.ranks.runs_here(ranks)
        name = name or (name_of(on_next) if here else "inert")
        sub = Subscription(
            self._ledger, name, policy, on_next, self._watchdog, on_rx_error, on_completed
        )
        if not here:
            sub.dispose()  # registered nowhere: it costs nothing
            return sub
        chain = ChainScheduler(scheduler) if scheduler else self.rx_scheduler
        self._attach(sub, source, chain, declares=True)
        return sub

    def subscribe_async(
        self,
        source: BusObservable[Any],
        fn: Callable[[Any], Awaitable[Any]],
        *,
        concurrency: int,
        buffer: int | None,
        overflow: Overflow | None,
        on_error: ErrorPolicy | None,
        name: str | None,
        decides: bool,
        ranks: Ranks,
    ) -> AsyncSubscription:
        """:meth:`EventBus.subscribe_async` (options validated on every rank alike); on a rank
        it does not run on, an inert subscription."""
        if not _is_async(fn):
            allowed = (
                "an async def function of one item; for a plain function use "
                "bus.subscribe(stream, fn), which runs it on the event loop"
            )
            raise ConfigError.invalid("fn", getattr(fn, "__qualname__", repr(fn)), allowed)
        check_int("concurrency", concurrency, 1)
        if not isinstance(decides, bool):
            raise ConfigError.invalid("decides", decides, "True or False")
        if overflow is None:  # a decider sees every item it may decide on; others never wait
            overflow = "block" if decides else "drop_oldest"
        if overflow not in OVERFLOWS:
            raise ConfigError.invalid("overflow", overflow, f"one of {OVERFLOWS}")
        if buffer is None:
            buffer = 1 if overflow == "latest" else 64
        check_int("buffer", buffer, 1)
        if overflow == "latest" and buffer != 1:
            raise ConfigError.invalid("buffer", buffer, "1 (or omitted) with overflow='latest'")
        check_policy(on_error)
        here = self.ranks.runs_here(ranks)
        sub = AsyncSubscription(
            self._ledger,
            name or (name_of(fn) if here else "inert"),
            fn,
            concurrency=concurrency,
            buffer=buffer,
            overflow=overflow,
            policy=on_error,
            backpressure=self.backpressure,
            decides=decides,
            stamp=self._stamp,
        )
        if not here:
            sub.dispose()
            return sub
        self._check_open()
        if self._tasks is not None:
            # Its workers belong to the event loop, whichever thread subscribes.
            self._tasks.on_loop(sub.start, self._tasks)
        self._attach(sub, source, self.rx_scheduler, declares=decides)
        return sub

    def _attach(
        self,
        sub: Subscription,
        source: BusObservable[Any],
        scheduler: abc.SchedulerBase,
        *,
        declares: bool,
    ) -> None:
        """Subscribe ``sub`` to the chain; with ``declares``, the chain's decision steps hold
        while ``sub`` does."""
        self._subs.append(sub)
        upstream = source.source.subscribe(sub, scheduler=scheduler)
        if declares and source.decision_steps and sub.active:
            upstream = CompositeDisposable(upstream, self._clock.declare(*source.decision_steps))
        sub.upstream = upstream

    def start(self, tasks: TaskSet) -> None:
        """The bus runs: start the active async subscriptions (and later ones at once)."""
        self._tasks = tasks
        for sub in self.asyncs():
            if sub.active:
                sub.start(tasks)

    def suspend(self) -> None:
        """The bus suspends: the async subscriptions keep their state until :meth:`start`."""
        self._tasks = None
        for sub in self.asyncs():
            sub.suspend()

    def all(self) -> tuple[Subscription, ...]:
        return tuple(self._subs)

    def asyncs(self) -> list[AsyncSubscription]:
        return [s for s in self._subs if isinstance(s, AsyncSubscription)]

    def pending(self) -> dict[str, int]:
        """Items waiting or running per async subscription that has any."""
        return {s.name: s.pending for s in self.asyncs() if s.pending}

    def cancel_pending(self) -> dict[str, int]:
        """Cancel every async subscription's workers now; return what was pending per
        subscription (counted as cancelled)."""
        pending = self.pending()
        for sub in self.asyncs():
            sub.cancel()
        return pending

"""AnyioScheduler under asyncio (pytest-asyncio) and trio (``anyio.run(..., backend="trio")``).

Real-clock tests assert only orders, never durations. Exact times are checked under trio's
``MockClock`` (virtual time, autojump), which also starts at 0 instead of ``time.monotonic()``:
the offset handling of the scheduler is what makes actions scheduled before the loop ran land at
the right loop time.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import Any

import anyio
import anyio.from_thread
import pytest
import trio
import trio.testing

from trainbus.bus import AnyioScheduler


@asynccontextmanager
async def running(sched: AnyioScheduler) -> AsyncIterator[None]:
    async with anyio.create_task_group() as tg:
        await tg.start(sched.run)
        yield
        tg.cancel_scope.cancel()


@contextmanager
def frozen_clock(sched: AnyioScheduler) -> Iterator[None]:
    """Due times computed from one instant while scheduling a batch of actions.

    A real-clock ordering test must not depend on the machine never stalling between two
    ``schedule_*`` calls (on a loaded 2-core runner a stall of 10 ms happens).
    """
    now = sched._clock()
    sched._clock = lambda: now  # type: ignore[method-assign]
    try:
        yield
    finally:
        del sched._clock


def run_trio(body: Callable[[], Awaitable[Any]], *, virtual: bool = False) -> None:
    options = {"clock": trio.testing.MockClock(autojump_threshold=0)} if virtual else {}
    anyio.run(body, backend="trio", backend_options=options)


class Log:
    """Records ``(name, loop time, thread)`` per action; ``wait(n)`` until ``n`` actions ran."""

    def __init__(self) -> None:
        self.entries: list[tuple[str, float, int]] = []
        self._count = anyio.Event()
        self._want = 0

    def action(self, name: str) -> Callable[[Any, Any], None]:
        def act(_scheduler: Any, _state: Any) -> None:
            self.entries.append((name, anyio.current_time(), threading.get_ident()))
            if len(self.entries) >= self._want:
                self._count.set()

        return act

    async def wait(self, n: int) -> None:
        self._want = n
        if len(self.entries) < n:
            self._count = anyio.Event()
            with anyio.fail_after(30):
                await self._count.wait()

    @property
    def names(self) -> list[str]:
        return [name for name, _, _ in self.entries]


# ----------------------------------------------------------------------------- ordering
async def ordering() -> None:
    sched, log = AnyioScheduler(), Log()
    async with running(sched):
        with frozen_clock(sched):
            sched.schedule_relative(0.03, log.action("c"))
            sched.schedule_relative(timedelta(seconds=0.01), log.action("a"))
            sched.schedule_relative(0.02, log.action("b1"))
            sched.schedule_relative(0.02, log.action("b2"))  # a tie keeps scheduling order
            sched.schedule(log.action("now"))
            sched.schedule_relative(-5, log.action("negative"))  # clamped to "now"
        await log.wait(6)
    assert log.names == ["now", "negative", "a", "b1", "b2", "c"]
    assert {thread for _, _, thread in log.entries} == {threading.get_ident()}


@pytest.mark.asyncio
async def test_schedule_relative_ordering_asyncio() -> None:
    await ordering()


def test_schedule_relative_ordering_trio() -> None:
    run_trio(ordering)


def test_schedule_relative_exact_times_trio_virtual() -> None:
    async def body() -> None:
        sched, log = AnyioScheduler(), Log()
        async with running(sched):
            t0 = anyio.current_time()
            for delay in (3.0, 1.0, 2.0):
                sched.schedule_relative(delay, log.action(str(delay)))
            await log.wait(3)
        assert log.names == ["1.0", "2.0", "3.0"]
        assert [t - t0 for _, t, _ in log.entries] == pytest.approx([1.0, 2.0, 3.0])

    run_trio(body, virtual=True)


class StillWall(AnyioScheduler):
    """An ``AnyioScheduler`` whose wall clock (``now``, the public reactivex face) stands still:
    an absolute due time is then an exact delay, whatever the machine does between two lines."""

    WALL = datetime(2026, 1, 1, tzinfo=UTC)

    @property
    def now(self) -> datetime:
        return self.WALL


async def absolute() -> None:
    sched, log = StillWall(), Log()
    async with running(sched):
        # The relative action goes in first: however long the machine stalls before the
        # absolute one is pushed, the absolute one is due at least 0.01 s after it. Had the
        # absolute time been taken as "now" (or as a loop time), it would run first.
        sched.schedule_relative(0.01, log.action("rel"))
        sched.schedule_absolute(StillWall.WALL + timedelta(seconds=0.02), log.action("abs"))
        sched.schedule_absolute(StillWall.WALL - timedelta(seconds=5), log.action("past"))
        await log.wait(3)
    assert log.names == ["past", "rel", "abs"]


@pytest.mark.asyncio
async def test_schedule_absolute_asyncio() -> None:
    await absolute()


def test_schedule_absolute_trio() -> None:
    run_trio(absolute)


def test_schedule_absolute_exact_times_trio_virtual() -> None:
    # Virtual loop time and a still wall clock: an absolute due time lands at exactly its
    # distance from ``now``, interleaved with relative ones, whatever the real machine does.
    async def body() -> None:
        sched, log = StillWall(), Log()
        async with running(sched):
            t0 = anyio.current_time()
            sched.schedule_absolute(StillWall.WALL + timedelta(seconds=2), log.action("abs2"))
            sched.schedule_relative(3.0, log.action("rel3"))
            sched.schedule_absolute(StillWall.WALL + timedelta(seconds=1), log.action("abs1"))
            sched.schedule_relative(1.5, log.action("rel1.5"))
            await log.wait(4)
        assert log.names == ["abs1", "rel1.5", "abs2", "rel3"]
        assert [t - t0 for _, t, _ in log.entries] == pytest.approx([1.0, 1.5, 2.0, 3.0])

    run_trio(body, virtual=True)


def test_schedule_periodic_trio_virtual() -> None:
    async def body() -> None:
        sched = AnyioScheduler()
        ticks: list[float] = []
        async with running(sched):
            t0 = anyio.current_time()
            periodic = sched.schedule_periodic(1.0, lambda s: ticks.append(anyio.current_time()))
            await anyio.sleep(3.5)
            periodic.dispose()
            await anyio.sleep(5)
        # Periodic drift correction reads the wall clock: allow its real-time jitter.
        assert [t - t0 for t in ticks] == pytest.approx([1.0, 2.0, 3.0], abs=0.05)

    run_trio(body, virtual=True)


# ----------------------------------------------------------------------------- dispose
async def dispose_cancels() -> None:
    sched, log = AnyioScheduler(), Log()
    async with running(sched):
        cancelled = sched.schedule_relative(0.01, log.action("cancelled"))
        cancelled_now = sched.schedule(log.action("cancelled-now"))
        sched.schedule_relative(0.02, log.action("kept"))
        cancelled.dispose()
        cancelled_now.dispose()
        await log.wait(1)
        # Both cancelled actions were due before "kept": had they not been cancelled, they
        # would have run first.
    assert log.names == ["kept"]


@pytest.mark.asyncio
async def test_dispose_cancels_asyncio() -> None:
    await dispose_cancels()


def test_dispose_cancels_trio() -> None:
    run_trio(dispose_cancels)


# ----------------------------------------------------------------------------- other threads
async def from_another_thread() -> None:
    sched, log = AnyioScheduler(), Log()
    loop_thread = threading.get_ident()

    def schedule_many() -> None:
        assert threading.get_ident() != loop_thread
        with frozen_clock(sched):
            for i, delay in enumerate([0.03, 0.0, 0.02, 0.01]):
                # 0.3 s later than named: a foreign thread's schedule wakes the loop and waits
                # for it, and under load that wait outlasted 0.03 s, so the first action came
                # due and ran before the later, earlier ones were pushed.
                sched.schedule_relative(0.3 + delay, log.action(f"{delay}:{i}"))

    async with running(sched):
        await anyio.to_thread.run_sync(schedule_many)
        await log.wait(4)
    assert log.names == ["0.0:1", "0.01:3", "0.02:2", "0.03:0"]
    assert {thread for _, _, thread in log.entries} == {loop_thread}


@pytest.mark.asyncio
async def test_schedule_from_another_thread_asyncio() -> None:
    await from_another_thread()


def test_schedule_from_another_thread_trio() -> None:
    run_trio(from_another_thread)


async def stale_wake_race(monkeypatch: pytest.MonkeyPatch) -> None:
    """A foreign thread schedules while the timer task is between two waits.

    The timer task found the heap empty and is about to make a fresh wake event; a foreign
    thread pushes an action right then and posts a wake-up to the loop. That wake-up must reach
    the *new* event (the one the timer awaits with no deadline), or the action is stranded.
    The interleaving is forced: the scheduler's lock runs a hook on the loop thread as the timer
    leaves its critical section, and the hook waits until the foreign thread has posted.
    """
    sched = AnyioScheduler()
    loop_thread = threading.get_ident()
    posted = threading.Event()
    real_run_sync = anyio.from_thread.run_sync

    def spy(func: Callable[..., Any], *args: Any, token: Any = None) -> Any:
        posted.set()
        return real_run_sync(func, *args, token=token)

    monkeypatch.setattr(anyio.from_thread, "run_sync", spy)

    class HookLock:
        def __init__(self) -> None:
            self._lock = threading.Lock()
            self.hook: Callable[[], None] | None = None

        def __enter__(self) -> HookLock:
            self._lock.acquire()
            return self

        def __exit__(self, *exc: object) -> None:
            self._lock.release()
            if self.hook is not None and threading.get_ident() == loop_thread:
                hook, self.hook = self.hook, None
                hook()

    lock = HookLock()
    sched._lock = lock  # type: ignore[assignment]
    ran = anyio.Event()
    workers: list[threading.Thread] = []

    def push_from_thread() -> None:
        worker = threading.Thread(target=sched.schedule, args=(lambda s, st: ran.set(),))
        workers.append(worker)
        worker.start()
        assert posted.wait(10)  # the worker pushed and read whatever it reads to wake the loop

    def arm(_s: Any, _st: Any) -> None:
        lock.hook = push_from_thread  # fires when the timer next leaves the lock, heap empty

    async with running(sched):
        sched.schedule(arm)
        with anyio.fail_after(10):
            await ran.wait()
    for worker in workers:
        worker.join()
    assert workers and not lock.hook


@pytest.mark.asyncio
async def test_foreign_wake_reaches_the_current_wait_asyncio(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    await stale_wake_race(monkeypatch)


def test_foreign_wake_reaches_the_current_wait_trio(monkeypatch: pytest.MonkeyPatch) -> None:
    run_trio(partial(stale_wake_race, monkeypatch))


# ----------------------------------------------------------------------------- before the loop
async def scheduled_before_start(sched: AnyioScheduler, log: Log) -> None:
    async with running(sched):
        sched.schedule_relative(0.05, log.action("after-start-0.05"))
        sched.schedule_relative(1.0, log.action("after-start-1.0"))
        await log.wait(4)


def schedule_before_start(sched: AnyioScheduler, log: Log) -> None:
    """Called before any loop runs: due times are taken on ``time.monotonic()``.

    Margins of 0.45 s and 0.5 s around "before-0.5": a stall of that length between here and
    the loop start would be needed to reorder them (the virtual-time test below is exact).
    """
    sched.schedule(log.action("before-now"))
    sched.schedule_relative(0.5, log.action("before-0.5"))


EXPECTED_BEFORE = ["before-now", "after-start-0.05", "before-0.5", "after-start-1.0"]


@pytest.mark.asyncio
async def test_actions_scheduled_before_the_loop_asyncio() -> None:
    # The loop already runs here (pytest-asyncio), but the scheduler's timer does not yet.
    sched, log = AnyioScheduler(), Log()
    await anyio.to_thread.run_sync(schedule_before_start, sched, log)
    await scheduled_before_start(sched, log)
    assert log.names == EXPECTED_BEFORE


def test_actions_scheduled_before_the_loop_trio() -> None:
    # trio's clock = time.monotonic() + a random offset of hours: without rebasing, an action
    # scheduled before the loop started would run at once (or in hours).
    sched, log = AnyioScheduler(), Log()
    schedule_before_start(sched, log)
    run_trio(partial(scheduled_before_start, sched, log))
    assert log.names == EXPECTED_BEFORE


def test_actions_scheduled_before_the_loop_keep_their_delay_trio_virtual() -> None:
    # MockClock starts at 0, far from time.monotonic(): the delay must still be 10 s of loop time
    # counted from scheduling (minus the little real time spent before the loop started).
    sched, log = AnyioScheduler(), Log()
    sched.schedule_relative(10.0, log.action("before-10"))

    async def body() -> None:
        t0 = anyio.current_time()
        async with running(sched):
            await log.wait(1)
        ((_, at, _),) = log.entries
        assert 9.0 < at - t0 <= 10.0

    run_trio(body, virtual=True)


# ----------------------------------------------------------------------------- failures
async def raising_action() -> None:
    errors: list[BaseException] = []
    sched, log = AnyioScheduler(on_failure=errors.append), Log()

    def boom(_s: Any, _st: Any) -> None:
        raise RuntimeError("boom")

    async with running(sched):
        sched.schedule(boom)
        sched.schedule_relative(0.01, log.action("after"))
        await log.wait(1)
        sched.schedule_relative(0.01, boom)
        sched.schedule_relative(0.02, log.action("later"))
        await log.wait(2)
    assert log.names == ["after", "later"]
    assert [str(e) for e in errors] == ["boom", "boom"]
    assert sched.pending == 0


@pytest.mark.asyncio
async def test_raising_action_does_not_stop_the_timer_asyncio() -> None:
    await raising_action()


def test_raising_action_does_not_stop_the_timer_trio() -> None:
    run_trio(raising_action)

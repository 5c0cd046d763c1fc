"""Running work on the training thread while the bus runs: the thread itself (one per Trainer),
the bus around one call (:class:`CallRunner`), the standalone evaluate/predict runs, and the
watchers for cancellation and SIGINT/SIGTERM."""

from __future__ import annotations

import contextlib
import contextvars
import multiprocessing.resource_tracker
import signal
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from types import FrameType
from typing import Any, TypeVar

import anyio
import anyio.from_thread
import anyio.lowlevel
from anyio.lowlevel import EventLoopToken

try:  # what anyio and trio ask which async library runs here (anyio can do without it)
    import sniffio
except ImportError:  # pragma: no cover - anyio without trio: nothing to clear
    sniffio = None  # type: ignore[assignment]

from .. import commands as cmd
from .. import events as ev
from .._bus import EventBus, LoopPort
from .._bus.scheduler import TaskSet
from .._exceptions import TrainbusError
from .._log import get_logger
from .._loop import Cancelled, Hooks, Loop, Settings, StandaloneRun
from .._signals import STOP_SIGNALS, not_ignored
from ..checkpoint import TrainState

__all__ = ["CallRunner", "SignalWatcher", "TrainingThread", "watch_cancel", "watching_cancel"]

log = get_logger(__name__)

T = TypeVar("T")

THREAD_NAME = "trainbus-training"
"""The training thread's name prefix (``threading.current_thread().name`` starts with it)."""


class TrainingThread:
    """The one thread every call of a Trainer runs its loop on: ``fit``, ``evaluate``,
    ``predict``, their sync twins and a resumed ``fit`` all run on it, one at a time.

    Why one thread for the whole session, not a worker per call: torch keeps state per thread
    that a compiled model's traces use, and a later trace on a new thread may meet what an
    ended one left (torch 2.11 kept dynamo's fake CUDA device guard in a thread-local of the
    first thread that traced but published its address process-wide: once that thread had
    exited, the next compiling call read freed memory and crashed). A model traces, recompiles
    and replays on one thread for as long as the Trainer lives.

    The thread starts with the first call and ends with :meth:`close` (the Trainer's close), or
    when the Trainer is dropped: it is the one worker of a ``ThreadPoolExecutor``, whose worker
    exits when the executor is freed (a weakref callback, no cycle: a dropped Trainer ends it
    without a gc pass), shut down, or at interpreter exit (before non-daemon threads are
    joined). Between calls it idles and holds nothing of the last one.

    As with ``anyio.to_thread.run_sync`` (which cannot pin a thread), each call runs in a copy
    of the caller's context (contextvars: per-thread torch settings kept in them, dynamo's
    config since torch 2.12, reach the thread), and its wait cannot be cancelled: a
    cancellation of the caller asks the run to stop (:func:`watching_cancel`) and waits for
    it. What the loop awaits on the event loop from the thread (:meth:`call`) is cancelled
    with the caller.
    """

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=THREAD_NAME)
        self._ident: int | None = None  # the thread's, once it ran a call
        self._token: EventLoopToken | None = None  # the running call's event loop
        self._scopes: set[anyio.CancelScope] = set()  # what the thread awaits there now
        self._cancelled = False

    async def run(self, fn: Callable[[], T]) -> T:
        """Run ``fn()`` on the training thread in a copy of the caller's context; wait for it,
        through a cancellation of the caller too (raised at the caller's next checkpoint).

        Returns:
            What ``fn`` returned.

        Raises:
            What ``fn`` raised.
        """
        done = anyio.Event()
        box: list[tuple[bool, Any]] = []
        token = anyio.lowlevel.current_token()
        self._token, self._cancelled = token, False
        # The future is not waited on: the job reports through ``done`` on the event loop.
        # What it runs goes in a list the job empties: the pool's work item holds its
        # arguments until after ``done`` is set, and must not hold the run (the model) then.
        context = contextvars.copy_context()
        if sniffio is not None:
            # No event loop runs on the training thread, though the copied context names the
            # caller's library: cleared, as anyio's worker threads clear it.
            context.run(sniffio.current_async_library_cvar.set, None)
        self._pool.submit(self._job, [context, fn], box, done, token)
        try:
            with anyio.CancelScope(shield=True):
                await done.wait()
        finally:
            self._token = None
        ok, value = box.pop()
        if ok:
            return value  # type: ignore[no-any-return]
        try:
            raise value
        finally:
            del value  # this frame is in its traceback: nothing of it refers back

    def _job(
        self, work: list[Any], box: list[tuple[bool, Any]], done: anyio.Event, token: EventLoopToken
    ) -> None:
        self._ident = threading.get_ident()
        context, fn = work
        work.clear()
        try:
            box.append((True, context.run(fn)))
        except BaseException as exc:  # raised by run() on the event loop
            box.append((False, exc))
        # Nothing of the call left on this thread once the caller resumes (a dropped Trainer
        # is freed at once, without waiting for this thread to get the GIL back).
        del context, fn
        anyio.from_thread.run_sync(done.set, token=token)

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """From the training thread: ``await fn(*args)`` on the running call's event loop and
        return its value; cancelled when the caller is (:meth:`cancel`).

        Raises:
            Cancelled: the caller was cancelled (before or while ``fn`` ran).
        """
        token = self._token
        if token is None or self._cancelled:
            raise Cancelled
        finished, value = anyio.from_thread.run(self._cancellable, fn, args, token=token)
        if not finished:
            raise Cancelled
        return value  # type: ignore[return-value]  # finished: what fn returned

    def call_sync(self, fn: Callable[..., T], *args: Any) -> T:
        """From the training thread: ``fn(*args)`` on the running call's event loop.

        Raises:
            Cancelled: the caller was cancelled.
        """
        token = self._token
        if token is None or self._cancelled:
            raise Cancelled
        return anyio.from_thread.run_sync(fn, *args, token=token)

    async def _cancellable(
        self, fn: Callable[..., Awaitable[T]], args: tuple[Any, ...]
    ) -> tuple[bool, T | None]:
        with anyio.CancelScope() as scope:
            if self._cancelled:
                scope.cancel()
            self._scopes.add(scope)
            try:
                return True, await fn(*args)
            finally:
                self._scopes.discard(scope)
        return False, None  # its own scope caught the cancellation: no exception left behind

    def cancel(self) -> None:
        """On the event loop: the caller was cancelled; what the thread awaits there now, or
        later in this call, is cancelled (:meth:`call` raises ``Cancelled`` on the thread)."""
        self._cancelled = True
        for scope in list(self._scopes):
            scope.cancel()

    def close(self) -> None:
        """End the thread (it idles: no call runs). Idempotent. Called on the training thread
        itself (a hook closing its Trainer), the thread ends once the call returns."""
        self._pool.shutdown(wait=self._ident != threading.get_ident())


async def watch_cancel(run: Loop | StandaloneRun, thread: TrainingThread) -> None:
    """Sleep until cancelled, then ask ``run`` to stop at its next check.

    If the calling call is cancelled, this task is cancelled with it: the thread stops between
    micro-batches (and what it awaits on the event loop, a barrier, is cancelled), so the
    worker returns and the closing events are published.
    """
    try:
        await anyio.sleep_forever()
    finally:
        run.request_cancel()
        thread.cancel()


@contextlib.asynccontextmanager
async def watching_cancel(run: Loop | StandaloneRun, thread: TrainingThread) -> AsyncIterator[None]:
    """While the block runs, a cancellation of the caller asks ``run`` to stop
    (:func:`watch_cancel`); at its end the watcher ends by its own scope, so nothing is
    cancelled when nothing cancelled the call (``_bus/scheduler.py``: no reference cycle left)."""
    async with anyio.create_task_group() as tg:
        tasks = TaskSet(tg)
        tasks.start_soon(watch_cancel, run, thread)
        try:
            yield
        finally:
            tasks.stop()


class CallRunner:
    """The bus around one trainer call (opened for it, or used as it runs), its barriers, and
    the standalone runs on it.

    Args:
        bus: The trainer's bus (the runner takes its loop face, :attr:`port`, once).
        hooks: The trainer's hooks (run by standalone runs too).
        barrier_timeout: How long a barrier waits for its subscribers.
        thread: The trainer's training thread (standalone runs run on it, barriers wait
            through it).
    """

    def __init__(
        self, bus: EventBus, hooks: Hooks, barrier_timeout: float, thread: TrainingThread
    ) -> None:
        self._bus = bus
        self._port = bus.port()
        self._hooks = hooks
        self._timeout = barrier_timeout
        self._thread = thread
        self._interrupted = False

    @property
    def port(self) -> LoopPort:
        """The bus' loop face, handed to the training loop and the standalone runs."""
        return self._port

    def begin(self) -> None:
        """A ``fit()`` begins: uninterrupted."""
        self._interrupted = False

    def interrupt(self) -> None:
        """A signal asked the run to stop: from now on barriers do not wait for subscribers,
        so the loop reaches its final checkpoint even while a sync subscriber blocks the
        event loop. Safe from a signal handler (sets a flag)."""
        self._interrupted = True

    def barrier(self, event: ev.BaseEvent | None, resume: bool) -> str:
        """Called on the training thread at a barrier event: wait for its deciders (the
        ``decides=True`` async subscriptions that received it).

        Returns:
            The bus' barrier status.

        Raises:
            Cancelled: ``fit()`` was cancelled while the loop waited here.
        """
        if self._interrupted:
            # After Ctrl-C the user wants the run to end: what is published is still
            # delivered before fit() returns, but the loop does not wait for it here.
            return "done"
        # Cancelled with the call (a cancellation, not a failure): Cancelled.
        status: str = self._thread.call(self._port.wait_barrier, self._timeout, event, resume)
        return status

    @contextlib.asynccontextmanager
    async def open(self) -> AsyncIterator[None]:
        """Run the bus for one call, or use it as is when something runs it already (``with
        trainer:``, ``async with trainer:`` or ``async with trainer.bus:``); either way what the
        call published is delivered before it returns. A bus this call opened is suspended at
        its end (streams open, the same subscribers for the next call), not closed.

        Raises:
            TrainbusError: the bus closed already (the message says what to do).
        """
        bus = self._bus
        if bus.state == "running":
            yield
            await bus.wait_delivered(self._timeout)
            return
        if bus.state in ("closing", "closed"):
            raise TrainbusError(
                "this Trainer's bus is closed (trainer.close() or the end of its `with` / "
                "`async with` block); build a new Trainer"
            )
        await bus.__aenter__()
        try:
            yield
        except BaseException:
            await bus.suspend(raise_fatal=False)
            raise
        await bus.suspend()

    async def standalone(
        self, fn: Callable[[StandaloneRun], Any], settings: Settings, state: TrainState | None
    ) -> Any:
        """Run ``fn(run)`` on the training thread with the bus running (evaluate/predict).

        Args:
            fn: What to do with the :class:`StandaloneRun`.
            settings: The settings it runs with (the model is moved to their device).
            state: The last fit's train state, or None before any.

        Returns:
            What ``fn`` returned.

        Raises:
            Whatever ``fn`` raised, after the bus delivered the closing events.
        """
        settings.model.to(settings.device)
        run = StandaloneRun(settings, self._port, self._hooks,
                            state if state is not None else TrainState())  # fmt: skip
        box: dict[str, Any] = {}

        def call() -> None:
            # The worker's exception is raised after the bus delivered the closing events (the
            # span carrying it included), not out of the task group as an exception group.
            try:
                box["result"] = fn(run)
            except BaseException as exc:
                box["error"] = exc

        async with self.open(), watching_cancel(run, self._thread):
            await self._thread.run(call)
        error = box.get("error")
        if isinstance(error, Cancelled):
            await anyio.lowlevel.checkpoint()  # let the pending cancellation out
        if error is not None:
            raise error
        return box["result"]


class SignalWatcher:
    """Turns SIGINT/SIGTERM into ``StopTraining``; a second one cancels the loop (an abort).

    A plain ``signal.signal`` handler, installed on the main thread for a call's duration and
    restored after: Python runs it on the main thread between two bytecodes, so it acts
    while the event loop runs elsewhere (a sync twin's portal thread) and while a sync
    subscriber blocks the event-loop thread (even in ``time.sleep``). It only appends to the
    command channel and sets flags (no lock, no await), which is safe in a signal handler.

    Args:
        bus: Where ``StopTraining(reason="signal")`` is sent.
        on_signal: Called (in the handler) at the first signal, before the command is sent.
    """

    SIGNALS = STOP_SIGNALS

    def __init__(self, bus: EventBus, on_signal: Callable[[], None] | None = None) -> None:
        self._bus = bus
        self._port = bus.port()  # withdrawing a late signal's stop, cancelling pending work
        self._on_signal = on_signal
        self._aborted = False
        self._received = 0
        self._cancels = 0
        self._installed = False
        self._run: Loop | None = None
        self._first: signal.Signals | None = None

    @property
    def received(self) -> signal.Signals | None:
        """The signal that asked the run to stop while installed (None: none, or only ones
        that came once training had ended, which cancel pending work); reset at each
        install."""
        return self._first

    @property
    def aborted(self) -> bool:
        """Whether a second signal aborted the run."""
        return self._aborted

    def watch(self, run: Loop | None) -> None:
        """The loop a second signal cancels (None once it ended)."""
        self._run = run

    @contextlib.contextmanager
    def installed(self, enabled: bool) -> Iterator[None]:
        """Handle SIGINT/SIGTERM while the block runs, then restore the previous handlers. A
        signal the process ignores (``SIG_IGN``) when the block starts is left ignored.

        Does nothing when ``enabled`` is False, off the main thread (where Python cannot set
        a handler: a sync twin installs it on the caller's thread instead) or when an outer
        block installed it already.
        """
        if (
            not enabled
            or self._installed
            or threading.current_thread() is not threading.main_thread()
        ):
            yield
            return
        self._aborted = False
        self._received = 0
        self._cancels = 0
        self._first = None
        previous = {signum: signal.getsignal(signum) for signum in not_ignored(self.SIGNALS)}
        for signum in previous:
            signal.signal(signum, self._handle)
        self._installed = True
        try:
            yield
        finally:
            self._installed = False
            if self._received:
                # A signal after the loop's last look at the commands left its StopTraining
                # queued: it was for this call, not for the next one.
                self._port.withdraw(_is_signal_stop)
            for signum, handler in previous.items():
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)

    def masked(self, fn: Callable[[], T], spawns: bool = False) -> Callable[[], T]:
        """``fn`` to run on the training thread: SIGINT blocked on that thread while
        :meth:`installed` handles it.

        DataLoader workers start from the training thread (its first ``iter(loader)``) and
        inherit that thread's signal mask, forked or spawned. With SIGINT blocked there, a
        Ctrl-C sent to the whole process group (a terminal does) reaches only the main
        process' handler: a forked worker would otherwise run a copy of this handler (and poke
        the parent's event-loop wake-up socket), and a spawned one would raise
        ``KeyboardInterrupt``, exit, and fail the run's next fetch ("DataLoader worker exited
        unexpectedly") before the final checkpoint. The workers end with the loader's iterator
        as usual. The handler itself runs on the main thread either way. The mask is restored
        after ``fn`` (the thread runs the Trainer's later calls too).

        Args:
            fn: What the training thread runs.
            spawns: The run's loaders spawn their workers (``trainbus._trainer.workers``): start
                multiprocessing's resource tracker first, whose start would unblock SIGINT.

        Returns:
            ``fn`` wrapped.
        """

        def run_masked() -> T:
            if not self._installed or not hasattr(signal, "pthread_sigmask"):
                return fn()
            if spawns:
                multiprocessing.resource_tracker.ensure_running()
            previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            try:
                return fn()
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, previous)

        return run_masked

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        run = self._run
        if run is not None and run.result is not None:
            # Training has ended and the call's end waits for async subscribers: a signal
            # cancels what they still hold (counted as lost work) instead of waiting on.
            # A signal after that one also makes fit() raise KeyboardInterrupt once it returns.
            self._aborted = self._aborted or self._cancels > 0
            self._cancels += 1
            self._port.request_cancel_pending()
            with contextlib.suppress(Exception):
                log.warning("signal_received", signal=signal.Signals(signum).name,
                            action="cancel pending async work")  # fmt: skip
            return
        self._received += 1
        if self._received == 1:
            self._first = signal.Signals(signum)
            if self._on_signal is not None:
                self._on_signal()
            # Then the command (a deque append: the training thread sees it at its next step,
            # whatever the event loop does), then the word about it.
            self._bus.send(cmd.StopTraining(reason="signal"))
            action = "stop after this step"
        else:
            self._aborted = True
            run = self._run
            if run is not None:
                run.request_cancel()  # a flag and a doorbell ring
            action = "abort now"
        # The handler may interrupt a write to the same stream (a reentrant call raises).
        with contextlib.suppress(Exception):
            log.warning("signal_received", signal=signal.Signals(signum).name, action=action)


def _is_signal_stop(command: cmd.Command) -> bool:
    return isinstance(command, cmd.StopTraining) and command.reason == "signal"

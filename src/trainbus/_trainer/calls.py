"""The training thread, the bus around one call (:class:`CallRunner`) and across calls with
the sync twins' portal (:class:`BusHolder`, docs/trainer.md "One Trainer, many calls"), the
watchers for cancellation and SIGINT/SIGTERM, and the DataLoader workers a call leaves behind."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import multiprocessing
import multiprocessing.resource_tracker
import signal
import sys
import threading
import warnings
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Coroutine,
    Generator,
    Iterable,
    Iterator,
)
from concurrent.futures import ThreadPoolExecutor
from types import FrameType
from typing import Any, ParamSpec, TypeVar

import anyio
import anyio.from_thread
import anyio.lowlevel
from anyio.from_thread import BlockingPortal
from anyio.lowlevel import EventLoopToken
from torch.utils.data import DataLoader

try:
    import sniffio
except ImportError:  # pragma: no cover - anyio without trio: nothing to clear
    sniffio = None  # type: ignore[assignment]

from .. import commands as cmd
from .. import events as ev
from .._bus import EventBus, LoopPort
from .._bus.scheduler import TaskSet
from .._exceptions import ConfigError, TrainbusError
from .._log import get_logger
from .._loop import Cancelled, Hooks, Loop, Settings, StandaloneRun
from .._signals import STOP_SIGNALS, not_ignored
from ..checkpoint import TrainState

__all__ = [
    "DURING_FIT",
    "BusHolder",
    "CallRunner",
    "SignalWatcher",
    "TrainingThread",
    "end_workers",
    "interrupt_for",
    "spawns_workers",
    "warns_unawaited",
    "watching_cancel",
]

log = get_logger(__name__)

T = TypeVar("T")
P = ParamSpec("P")


def unboxed(outcome: tuple[bool, Any]) -> Any:
    """The value of an ``(ok, value)`` outcome carried across threads, or its exception raised
    here, on the caller's thread. Nothing of this frame, which is in the traceback, refers
    back to the exception (a cycle would keep the Trainer alive until a gc pass)."""
    ok, value = outcome
    del outcome
    if ok:
        return value
    try:
        raise value
    finally:
        del value


class _Call(Coroutine[Any, Any, T]):
    """The coroutine of a trainer call, warning, when dropped without ever being awaited, that
    nothing ran and what to write instead (``fit_sync()`` from synchronous code)."""

    __slots__ = ("_coro", "_name", "_used", "_where")

    def __init__(self, coro: Coroutine[Any, Any, T], name: str, where: tuple[str, int]) -> None:
        self._coro, self._name, self._where = coro, name, where
        self._used = False  # awaited, driven or closed: the caller took it

    def __await__(self) -> Generator[Any, None, T]:
        self._used = True
        return self._coro.__await__()

    def send(self, value: Any) -> Any:
        self._used = True
        return self._coro.send(value)

    def throw(self, *args: Any) -> Any:  # (exception) or the old (type, value, traceback)
        self._used = True
        return self._coro.throw(*args)

    def close(self) -> None:
        self._used = True
        self._coro.close()

    def __getattr__(self, attr: str) -> Any:
        # `result = trainer.fit(...); result.steps`: say where the result comes from.
        raise AttributeError(
            f"{attr!r} of the coroutine Trainer.{self._name}() returns: its result is what "
            f"awaiting it gives (result = await trainer.{self._name}(...)), or call "
            f"trainer.{self._name}_sync(...) from synchronous code",
            name=attr,
            obj=self,
        )

    def __repr__(self) -> str:
        return (
            f"<the coroutine of Trainer.{self._name}(): await it, or call "
            f"trainer.{self._name}_sync() from synchronous code>"
        )

    def __del__(self) -> None:
        if self._used:
            return
        self._coro.close()  # Python's own warning would not say what to write
        warnings.warn_explicit(
            f"Trainer.{self._name}() was never awaited, so nothing ran: from synchronous code "
            f"call trainer.{self._name}_sync(); in async code, await trainer.{self._name}()",
            RuntimeWarning,
            *self._where,
        )


def warns_unawaited(
    fn: Callable[P, Coroutine[Any, Any, T]],
) -> Callable[P, Coroutine[Any, Any, T]]:
    """An ``async def`` trainer call whose coroutine, dropped unawaited, warns at the line that
    called it naming its ``_sync`` twin (:class:`_Call`)."""

    @functools.wraps(fn)
    def call(*args: P.args, **kwargs: P.kwargs) -> Coroutine[Any, Any, T]:
        caller = sys._getframe(1)
        where = (caller.f_code.co_filename, caller.f_lineno)
        return _Call(fn(*args, **kwargs), fn.__name__, where)

    mark = getattr(inspect, "markcoroutinefunction", None)  # Python 3.12+
    return call if mark is None else mark(call)


class TrainingThread:
    """The one thread every call of a Trainer runs its loop on, for the Trainer's life: a
    compiled model's traces use torch's per-thread state (torch 2.11 crashed on a new thread).
    """

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainbus-training")
        self._ident: int | None = None  # the thread's, once it ran a call
        self._token: EventLoopToken | None = None  # the running call's event loop
        self._scopes: set[anyio.CancelScope] = set()  # what the thread awaits there now
        self._cancelled = False

    async def run(self, fn: Callable[[], T]) -> T:
        """``fn()`` on the training thread in a copy of the caller's context, waited for
        through a cancellation of the caller (:func:`watching_cancel` stops the run)."""
        done = anyio.Event()
        box: list[tuple[bool, Any]] = []
        token = anyio.lowlevel.current_token()
        self._token, self._cancelled = token, False
        # The job empties the list: the pool's work item must not hold the run once it is done.
        context = contextvars.copy_context()
        if sniffio is not None:
            # No event loop runs on the training thread (as anyio's worker threads do).
            context.run(sniffio.current_async_library_cvar.set, None)
        self._pool.submit(self._job, [context, fn], box, done, token)
        try:
            with anyio.CancelScope(shield=True):
                await done.wait()
        finally:
            self._token = None
        return unboxed(box.pop())  # type: ignore[no-any-return]

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
        del context, fn  # nothing of the call left here once the caller resumes
        anyio.from_thread.run_sync(done.set, token=token)

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """From the training thread: ``await fn(*args)`` on the call's event loop (raises
        ``Cancelled`` when the caller was cancelled)."""
        finished, value = anyio.from_thread.run(self._cancellable, fn, args, token=self._live())
        if not finished:
            raise Cancelled
        return value  # type: ignore[return-value]  # finished: what fn returned

    def call_sync(self, fn: Callable[..., T], *args: Any) -> T:
        """From the training thread: ``fn(*args)`` on the call's event loop (or ``Cancelled``)."""
        return anyio.from_thread.run_sync(fn, *args, token=self._live())

    def _live(self) -> EventLoopToken:
        if self._token is None or self._cancelled:
            raise Cancelled
        return self._token

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
        """On the event loop: the caller was cancelled, and so is what the thread awaits."""
        self._cancelled = True
        for scope in list(self._scopes):
            scope.cancel()

    def close(self) -> None:
        """End the thread once it idles. Idempotent; on the thread itself, after the call."""
        self._pool.shutdown(wait=self._ident != threading.get_ident())


async def _watch_cancel(run: Loop | StandaloneRun, thread: TrainingThread) -> None:
    try:
        await anyio.sleep_forever()
    finally:
        run.request_cancel()
        thread.cancel()


@contextlib.asynccontextmanager
async def watching_cancel(run: Loop | StandaloneRun, thread: TrainingThread) -> AsyncIterator[None]:
    """While the block runs, a cancellation of the caller asks ``run`` to stop."""
    async with anyio.create_task_group() as tg:
        tasks = TaskSet(tg)
        tasks.start_soon(_watch_cancel, run, thread)
        try:
            yield
        finally:
            tasks.stop()


class CallRunner:
    """The bus around one trainer call, its barriers and the standalone runs on it."""

    def __init__(
        self, bus: EventBus, hooks: Hooks, thread: TrainingThread, signals: SignalWatcher
    ) -> None:
        self._bus = bus
        self.port: LoopPort = bus.port()  # the bus' loop face, for the loop and standalone runs
        self._hooks = hooks
        self._thread = thread
        self._signals = signals

    def barrier(self, event: ev.BaseEvent | None, resume: bool) -> str:
        """On the training thread: wait for the deciders of a barrier event (no more after a
        stop signal, so the final checkpoint is reached); the bus' status."""
        if self._signals.received is not None:
            return "done"
        if not resume:
            self.port.barrier_requested()
        status: str = self._thread.call(
            self.port.wait_barrier, self._bus.barrier_timeout, event, resume
        )
        return status

    @contextlib.asynccontextmanager
    async def open(self) -> AsyncIterator[None]:
        """Run the bus for one call (suspended at its end), or use it as is when it runs;
        either way deliver what the call published."""
        bus = self._bus
        if bus.state == "running":  # across calls (async with): commands apply in this one
            self.port.resume_polls()
            try:
                yield
                await bus.wait_delivered(bus.barrier_timeout)
            finally:
                self.port.end_polls()
            return
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
        """``fn(run)`` (evaluate/predict) on the training thread with the bus running; what it
        raised is raised after the closing events were delivered."""
        settings.model.to(settings.device)
        run = StandaloneRun(
            settings, self.port, self._hooks, state if state is not None else TrainState()
        )

        def call() -> tuple[bool, Any]:  # raised after the closing events, not in a group
            try:
                return True, fn(run)
            except BaseException as exc:
                return False, exc

        async with self.open(), watching_cancel(run, self._thread):
            outcome = await self._thread.run(call)
        if isinstance(outcome[1], Cancelled):
            await anyio.lowlevel.checkpoint()  # let the pending cancellation out
        return unboxed(outcome)


BACKENDS = ("asyncio", "trio")
DURING_FIT = (
    "; during fit(), evaluate or save with a command: trainer.bus.send(commands.Evaluate()) "
    "or SaveCheckpoint() (await trainer.bus.request(...) from an async subscriber waits for it)"
)


async def _captured(fn: Callable[[], Awaitable[T]]) -> tuple[bool, Any]:
    try:
        return True, await fn()
    except (Exception, KeyboardInterrupt) as exc:  # raised again on the caller's thread
        # (a second Ctrl-C's abort too: out of the portal's task it would end its event loop
        # with an exception group printed at shutdown)
        return False, exc


def portal_call(portal: BlockingPortal, fn: Callable[[], Awaitable[T]]) -> T:
    """``portal.call(fn)``, raising on the caller's thread (anyio's portal holds an exception
    in a reference cycle, which would keep the Trainer alive until a gc pass)."""
    return unboxed(portal.call(_captured, fn))  # type: ignore[no-any-return]


class BusHolder:
    """How a Trainer holds its bus across calls and the portal of its sync twins; the
    training ``thread`` ends when the bus closes."""

    def __init__(self, bus: EventBus, thread: TrainingThread) -> None:
        self._bus = bus
        self._thread = thread
        self._portal: BlockingPortal | None = None
        self._backend = "asyncio"
        self._stack: contextlib.ExitStack | None = None

    @property
    def closed(self) -> bool:
        """Whether the bus closed (``close()``, the end of ``with`` / ``async with``)."""
        return self._bus.state in ("closing", "closed")

    def check_open(self, call: str) -> None:
        """Raises ``TrainbusError`` naming ``call`` when the bus closed."""
        if self.closed:
            raise TrainbusError(
                f"{call}: this Trainer is closed (trainer.close() or the end of its `with` / "
                "`async with` block completed its bus); build a new Trainer (to continue "
                "training: fit(resume='latest'))"
            )

    def _check_enter(self, block: str) -> None:
        self.check_open(block)
        if self._bus.state == "running" or self._portal is not None:
            raise TrainbusError(
                f"{block}: its bus runs already (an enclosing `with` or "
                "`async with`); enter it once"
            )

    def enter(self) -> None:
        """``with trainer:``: start the portal every sync call of the block runs through."""
        self._check_enter("with trainer")
        stack = contextlib.ExitStack()
        self._portal = stack.enter_context(anyio.from_thread.start_blocking_portal("asyncio"))
        self._stack, self._backend = stack, "asyncio"

    def close(self) -> None:
        """Close the bus, stop the ``with`` block's portal and end the training thread."""
        try:
            self._close()
        finally:
            self._end_thread()

    def _end_thread(self) -> None:
        if self.closed:
            self._thread.close()

    def _close(self) -> None:
        stack, portal = self._stack, self._portal
        if stack is not None and portal is not None:
            self._stack = self._portal = None
            with stack:
                if self._bus.state == "running":  # a call interrupted here runs on: cancel it
                    with contextlib.suppress(RuntimeError):
                        portal.call(portal.stop, True)
                elif not self.closed:
                    portal.call(self._run_to_close)
        if self._bus.state == "running":
            raise TrainbusError(
                "close(): the bus runs in an event loop (`async with trainer` "
                "or `async with trainer.bus`); leave that block, which closes "
                "it, or `await trainer.aclose()` after it"
            )
        if not self.closed:
            with anyio.from_thread.start_blocking_portal(self._backend) as temporary:
                temporary.call(self._run_to_close)

    def call(self, fn: Callable[[], Awaitable[T]], backend: str, name: str) -> T:
        """``fn()`` (a trainer call) through the ``with trainer:`` portal, or one of its own."""
        if backend not in BACKENDS:
            raise ConfigError.invalid("backend", backend, f"one of {BACKENDS}")
        if self._portal is not None:
            if backend != self._backend:
                raise ConfigError.invalid(
                    "backend", backend, f"{self._backend!r}, the backend `with trainer:` runs"
                )
            return portal_call(self._portal, fn)
        if self._bus.state == "running":
            raise TrainbusError(
                f"{name}_sync(): the trainer's bus runs in an event loop already (a fit() "
                "running, `async with trainer` or `async with trainer.bus`); there, `await "
                f"trainer.{name}(...)`{DURING_FIT}"
            )
        self.check_open(f"{name}()")
        self._backend = backend  # close() closes the bus on the backend it ran on
        with anyio.from_thread.start_blocking_portal(backend) as portal:
            return portal_call(portal, fn)

    async def aenter(self) -> None:
        self._check_enter("async with trainer")
        await self._bus.__aenter__()

    async def aexit(self, exc_type: type[BaseException] | None) -> None:
        try:
            await self._bus.__aexit__(exc_type, None, None)
        finally:
            self._end_thread()

    async def aclose(self) -> None:
        """Close a bus that does not run, then end the training thread. Idempotent."""
        if not self.closed and (self._bus.state == "running" or self._portal is not None):
            raise TrainbusError(
                "aclose(): the bus runs in a `with` or `async with` block; "
                "leaving it closes the bus"
            )
        try:
            if not self.closed:
                await self._run_to_close()
        finally:
            self._end_thread()

    async def _run_to_close(self) -> None:
        async with self._bus:
            pass


class SignalWatcher:
    """A main-thread handler turning SIGINT/SIGTERM into ``StopTraining`` (``received``), a
    second one into a cancel (``aborted``); it only sends a command and sets flags."""

    def __init__(self, bus: EventBus) -> None:
        self._bus = bus
        self._port = bus.port()  # withdrawing a late signal's stop, cancelling pending work
        self.aborted = False
        self.received: signal.Signals | None = None
        self._count = 0  # the signals that asked the run to stop
        self._cancels = 0
        self._installed = False
        self._run: Loop | None = None

    def watch(self, run: Loop | None) -> None:
        """The loop a second signal cancels (None: none)."""
        self._run = run

    @contextlib.contextmanager
    def installed(self, enabled: bool) -> Iterator[None]:
        """Handle SIGINT/SIGTERM in the block, then restore the handlers; nothing when not
        ``enabled``, off the main thread or inside an outer block."""
        if (
            not enabled
            or self._installed
            or threading.current_thread() is not threading.main_thread()
        ):
            yield
            return
        self.aborted = False
        self.received = None
        self._count = self._cancels = 0
        previous = {signum: signal.getsignal(signum) for signum in not_ignored(STOP_SIGNALS)}
        for signum in previous:
            signal.signal(signum, self._handle)
        self._installed = True
        try:
            yield
        finally:
            self._installed = False
            if self._count:  # a StopTraining the loop never read was for this call only
                self._port.withdraw(_is_signal_stop)
            for signum, handler in previous.items():
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)

    def masked(self, fn: Callable[[], T], spawns: bool = False) -> Callable[[], T]:
        """``fn`` with SIGINT blocked on the training thread while handled, so that DataLoader
        workers, inheriting the mask, survive a Ctrl-C to the process group; ``spawns``:
        start the resource tracker first (its start unblocks SIGINT)."""

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
            # Training ended; the call waits for async subscribers: cancel what they hold
            # (lost work); a further signal also makes fit() raise KeyboardInterrupt.
            self.aborted = self.aborted or self._cancels > 0
            self._cancels += 1
            self._port.request_cancel_pending()
            action = "cancel pending async work"
        elif self._count == 0:
            self._count = 1
            self.received = signal.Signals(signum)
            self._bus.send(cmd.StopTraining(reason="signal"))
            action = "stop after this step"
        else:
            self._count += 1
            self.aborted = True
            if run is not None:
                run.request_cancel()
            action = "abort now, unless the first signal's stop has taken effect"
        # The handler may interrupt a write to the same stream (a reentrant call raises).
        with contextlib.suppress(Exception):
            log.warning("signal_received", signal=signal.Signals(signum).name, action=action)


def _is_signal_stop(command: cmd.Command) -> bool:
    return isinstance(command, cmd.StopTraining) and command.reason == "signal"


def interrupt_for(signum: signal.Signals, step: int, checkpoint: str | None) -> BaseException:
    """What ``fit()`` raises after a graceful stop by ``signum`` (``on_signal="raise"``)."""
    where = f"at step {step}" + (f", checkpoint {checkpoint}" if checkpoint else "")
    said = (
        f"trainbus: {signum.name} stopped the run gracefully {where}; trainer.result holds "
        "the result (Trainer(on_signal='return') returns it instead)"
    )
    if signum == signal.SIGINT:
        return KeyboardInterrupt(said)
    exit_ = SystemExit(128 + int(signum))
    exit_.add_note(said)
    return exit_


def _start_method(loader: DataLoader[Any]) -> str:
    context = loader.multiprocessing_context
    if context is not None:
        return str(context.get_start_method())
    # allow_none: reading must not fix the default (a later set_start_method would raise).
    method = multiprocessing.get_start_method(allow_none=True)
    return method if method is not None else multiprocessing.get_all_start_methods()[0]


def spawns_workers(loaders: Iterable[object]) -> bool:
    """Whether any of ``loaders`` is a ``DataLoader`` starting workers by spawn or forkserver."""
    return any(
        isinstance(loader, DataLoader)
        and loader.num_workers > 0
        and _start_method(loader) != "fork"
        for loader in loaders
    )


def end_workers(loaders: Iterable[object]) -> None:
    """Shut down the persistent workers of the ``DataLoader``\\ s among ``loaders`` (they
    would pile up over a sweep's runs); torch has no public method for it."""
    seen: set[int] = set()
    for loader in loaders:
        if not isinstance(loader, DataLoader) or id(loader) in seen:
            continue
        seen.add(id(loader))
        if not (loader.persistent_workers and loader.num_workers > 0):
            continue
        iterator = getattr(loader, "_iterator", None)
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if shutdown is None:
            continue
        loader._iterator = None
        shutdown()

"""One Trainer, many calls: fit, evaluate and predict in any order, async and sync, in a
notebook's running loop, with the bus' lifetime explicit (``with`` / ``async with`` /
``close()``) or per call; a failed call leaves nothing behind."""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Callable, Coroutine, Generator
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
import torch.nn.functional as F
from reactivex import operators as ops
from structlog.testing import capture_logs

from trainbus import ConfigError, EvalSchedule, EventBus, FitResult, TrainbusError, Trainer
from trainbus import commands as cmd
from trainbus import events as ev
from trainbus.bus import BusClosedError
from trainbus.testing import EventRecorder, tiny_loader, tiny_model

CALL_ENDS = (ev.FitEnded, ev.EvaluationRoundEnded, ev.PredictionEnded)


def _leaked(before: set[threading.Thread]) -> list[threading.Thread]:
    """Threads started since ``before`` that are still alive once given 10 s to end: a stopped
    portal's idle anyio worker threads are told to exit, not joined, so they may take a
    moment (on a loaded machine)."""
    new = set(threading.enumerate()) - before
    for thread in new:
        thread.join(timeout=10)
    return [t for t in new if t.is_alive()]


def make_trainer(**overrides: Any) -> Trainer:
    model = overrides.pop("model", None) or tiny_model()
    kwargs: dict[str, Any] = dict(
        loss_fn=F.cross_entropy,
        max_steps=3,
        device="cpu",
        eval_data=tiny_loader(1, seed=1),
        on_signal=None,
        progress=False,
        eval_schedule=EvalSchedule(epoch_end=False),
    )
    kwargs.update(overrides)
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_loader(3), **kwargs)


def ends(recorder: EventRecorder) -> list[str]:
    return [type(e).__name__ for e in recorder.items if isinstance(e, CALL_ENDS)]


class AsyncCounter:
    """An async subscriber on every call's closing event: what it finished, by call."""

    def __init__(self, trainer: Trainer) -> None:
        self.done: list[str] = []
        self.threads: set[int] = set()
        trainer.bus.subscribe_async(trainer.bus.stream(*CALL_ENDS), self.take)

    async def take(self, event: ev.BaseEvent) -> None:
        await anyio.sleep(0.01)  # real async work: the call waits for it before returning
        self.threads.add(threading.get_ident())
        self.done.append(type(event).__name__)


# ---------------------------------------------------------------------------- async, per call
@pytest.mark.asyncio
async def test_fit_then_evaluate_then_predict_then_evaluate_on_one_trainer() -> None:
    trainer = make_trainer()
    recorder = EventRecorder(trainer.bus)
    counter = AsyncCounter(trainer)
    result = await trainer.fit()
    assert result.steps == 3 and counter.done == ["FitEnded"]  # delivered before fit returned
    metrics = await trainer.evaluate()
    assert set(metrics) == {"val_loss"} and counter.done[-1] == "EvaluationRoundEnded"
    out = await trainer.predict(tiny_loader(2), return_outputs=True)
    assert out.shape == (64, 10) and counter.done[-1] == "PredictionEnded"
    await trainer.evaluate()
    assert ends(recorder) == counter.done == [
        "FitEnded", "EvaluationRoundEnded", "PredictionEnded", "EvaluationRoundEnded",
    ]  # fmt: skip
    assert trainer.bus.state == "suspended" and not recorder.completed
    await trainer.aclose()
    assert trainer.bus.state == "closed" and recorder.completed
    with pytest.raises(TrainbusError, match=r"closed.*build a new Trainer"):
        await trainer.evaluate()


@pytest.mark.asyncio
async def test_evaluate_then_predict_then_fit_on_a_fresh_trainer() -> None:
    trainer = make_trainer()
    recorder = EventRecorder(trainer.bus)
    await trainer.evaluate()
    await trainer.predict(tiny_loader(1))
    result = await trainer.fit()
    assert result.reason == "completed"
    assert ends(recorder) == ["EvaluationRoundEnded", "PredictionEnded", "FitEnded"]


@pytest.mark.asyncio
async def test_a_call_ends_its_time_windows_before_it_returns() -> None:
    trainer = make_trainer()
    batches: list[list[ev.BaseEvent]] = []
    # A window far longer than any call: only the call's end closes it.
    trainer.bus.subscribe(
        trainer.bus.stream(ev.StepEnded, ev.EvalBatchEnded).pipe(
            ops.buffer_with_time(600.0), ops.filter(bool)
        ),
        batches.append,
    )
    await trainer.fit()
    assert [e.step for e in batches[-1] if isinstance(e, ev.StepEnded)] == [1, 2, 3]
    await trainer.evaluate()
    assert batches[-1] and all(isinstance(e, ev.EvalBatchEnded) for e in batches[-1])


# ---------------------------------------------------------------------------- sync, per call
def test_sync_twins_in_any_order_without_leaving_a_thread() -> None:
    before = set(threading.enumerate())
    trainer = make_trainer()
    recorder = EventRecorder(trainer.bus)
    counter = AsyncCounter(trainer)
    trainer.evaluate_sync()
    trainer.fit_sync()
    trainer.predict_sync(tiny_loader(1))
    trainer.evaluate_sync()
    assert ends(recorder) == counter.done == [
        "EvaluationRoundEnded", "FitEnded", "PredictionEnded", "EvaluationRoundEnded",
    ]  # fmt: skip
    trainer.close()
    trainer.close()  # idempotent
    assert recorder.completed
    assert _leaked(before) == []


def test_a_second_fit_is_an_error_unless_it_resumes(tmp_path: Any) -> None:
    trainer = make_trainer(max_steps=6, checkpoint_dir=tmp_path)
    recorder = EventRecorder(trainer.bus)

    def stop_at_2(ctx: Any) -> None:
        if ctx.step == 2 and not recorder.of_type(ev.FitEnded):
            trainer.bus.send(cmd.StopTraining(reason="pause"))

    trainer.add_hook("after_optimizer_step", stop_at_2)
    first = trainer.fit_sync()
    assert (first.reason, first.steps) == ("stopped", 2)
    with pytest.raises(TrainbusError, match=r"ran on this Trainer already.*fit\(resume="):
        trainer.fit_sync()
    second = trainer.fit_sync(resume="latest")
    assert (second.reason, second.steps) == ("completed", 6)
    started = recorder.of_type(ev.FitStarted)
    assert len(started) == 2 and started[1].resumed_from is not None
    assert [e.step for e in recorder.of_type(ev.StepEnded)] == [1, 2, 3, 4, 5, 6]
    trainer.close()


# ---------------------------------------------------------------------------- explicit lifetime
def test_with_block_runs_every_sync_call_through_one_portal() -> None:
    before = set(threading.enumerate())
    with make_trainer() as trainer:
        recorder = EventRecorder(trainer.bus)
        counter = AsyncCounter(trainer)
        trainer.fit_sync()
        assert counter.done == ["FitEnded"]  # delivered before run() returned
        trainer.evaluate_sync()
        trainer.evaluate_sync()
        trainer.predict_sync(tiny_loader(1))
        assert trainer.bus.state == "suspended"  # between calls: subscribe freely here
        assert len(counter.threads) == 1  # one event-loop thread: the with block's portal
        with pytest.raises(ConfigError, match="backend"):
            trainer.evaluate_sync(backend="trio")
    assert counter.done == ends(recorder) and len(counter.done) == 4
    assert recorder.completed and trainer.bus.state == "closed"
    with pytest.raises(TrainbusError, match="closed"):
        trainer.fit_sync()
    assert _leaked(before) == []


@pytest.mark.asyncio
async def test_async_with_block_holds_the_bus_for_every_call() -> None:
    trainer = make_trainer()
    recorder = EventRecorder(trainer.bus)
    async with trainer:
        await trainer.fit()
        await trainer.evaluate()
        assert trainer.bus.state == "running" and not recorder.completed
        # The loop runs here: a sync twin would block it. The error says what to do.
        with pytest.raises(TrainbusError, match=r"await trainer.evaluate\("):
            trainer.evaluate_sync()
        with pytest.raises(TrainbusError, match="close"):
            trainer.close()
    assert recorder.completed and ends(recorder) == ["FitEnded", "EvaluationRoundEnded"]


# ---------------------------------------------------------------------------- notebooks
def test_sync_twins_work_where_an_asyncio_loop_runs_on_the_thread() -> None:
    # A notebook cell: synchronous code called while the kernel's loop runs on this thread.
    trainer = make_trainer()
    recorder = EventRecorder(trainer.bus)

    async def cell() -> tuple[Any, Any]:
        asyncio.get_running_loop()  # there is one
        return trainer.fit_sync(), trainer.evaluate_sync()

    result, metrics = asyncio.run(cell())
    assert result.reason == "completed" and "val_loss" in metrics
    assert ends(recorder) == ["FitEnded", "EvaluationRoundEnded"]


def test_sync_twin_from_a_running_loops_callback() -> None:
    trainer = make_trainer()

    async def main() -> Any:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()

        def callback() -> None:
            try:
                fut.set_result(trainer.predict_sync(tiny_loader(1), return_outputs=True))
            except BaseException as exc:  # handed to the awaiting test
                fut.set_exception(exc)

        loop.call_soon(callback)
        return await fut

    assert asyncio.run(main()).shape == (32, 10)
    trainer.close()


# ---------------------------------------------------------------------------- failures
class FailOnce(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner, self.fail = tiny_model(), True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail:
            self.fail = False
            raise ValueError("boom")
        out: torch.Tensor = self.inner(x)
        return out


def test_a_failed_call_leaves_no_state_behind(tmp_path: Any) -> None:
    trainer = make_trainer(model=FailOnce())
    recorder = EventRecorder(trainer.bus)
    with pytest.raises(ValueError, match="boom"):
        trainer.evaluate_sync()
    assert trainer.evaluate_sync()["val_loss"] > 0  # the next call works
    with pytest.raises(ConfigError):  # fit fails before it runs: no fit happened
        trainer.fit_sync(resume=tmp_path / "missing.pt")
    assert trainer.fit_sync().reason == "completed"
    assert ends(recorder) == ["EvaluationRoundEnded", "EvaluationRoundEnded", "FitEnded"]
    trainer.close()


def test_a_raise_policy_failure_fails_its_call_only() -> None:
    trainer = make_trainer()
    calls: list[str] = []

    def picky(event: ev.EvaluationRoundEnded) -> None:
        calls.append("seen")
        if len(calls) == 1:
            raise RuntimeError("first time only")

    trainer.bus.subscribe(trainer.bus.stream(ev.EvaluationRoundEnded), picky, on_error="raise")
    with pytest.raises(Exception, match="first time only"):
        trainer.evaluate_sync()
    trainer.predict_sync(tiny_loader(1))  # no stale failure raised here
    trainer.close()


@pytest.mark.asyncio
async def test_evaluate_while_fit_runs_is_a_clear_error() -> None:
    trainer = make_trainer(max_steps=10_000)
    errors: list[BaseException] = []

    async def on_step(event: ev.StepEnded) -> None:
        if event.step == 2 and not errors:
            try:
                await trainer.predict(tiny_loader(1))
            except TrainbusError as exc:
                errors.append(exc)
            trainer.bus.send(cmd.StopTraining())

    trainer.bus.subscribe_async(trainer.bus.stream(ev.StepEnded), on_step)
    await trainer.fit()
    assert len(errors) == 1 and "predict() cannot run while fit() runs" in str(errors[0])


def test_bad_backend_is_a_config_error() -> None:
    trainer = make_trainer()
    with pytest.raises(ConfigError, match=r"^backend='curio'.*asyncio"):
        trainer.fit_sync(backend="curio")
    assert trainer.fit_sync().reason == "completed"  # nothing was left behind
    trainer.close()


def test_ctrl_c_during_a_sync_call_in_a_with_block_cancels_it_then_closes() -> None:
    import signal
    import time

    trainer = make_trainer(eval_data=tiny_loader(1_000))
    batches: list[int] = []

    def slow_batch(ctx: Any) -> None:
        batches.append(1)
        if len(batches) == 2:
            # Ctrl-C, to the main thread waiting on the portal (evaluate_sync installs no
            # handler: Python's default raises KeyboardInterrupt there).
            signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)
        time.sleep(0.01)

    trainer.add_hook("eval_batch", slow_batch)
    recorder = EventRecorder(trainer.bus)
    with pytest.raises(KeyboardInterrupt), trainer:
        trainer.evaluate_sync()
    # The block's end cancelled the interrupted call (between batches), then closed the bus.
    assert trainer.bus.state == "closed" and recorder.completed
    assert len(batches) < 1_000
    started = recorder.of_type(ev.EvaluationRoundStarted)
    assert len(started) == 1 and ends(recorder) == ["EvaluationRoundEnded"]


def test_a_hung_async_subscriber_is_cut_off_at_the_call_end_and_reported() -> None:
    # (A hung "block" subscriber holds training itself until a stop: see
    # tests/bus/test_watchdog_failures.py::test_a_hung_block_subscriber_holds_training_says_so_...)
    trainer = make_trainer(bus=EventBus(close_timeout=0.5, barrier_timeout=0.5))
    seen: list[int] = []

    async def hang(event: ev.StepEnded) -> None:
        seen.append(event.step)
        await anyio.sleep_forever()

    sub = trainer.bus.subscribe_async(trainer.bus.stream(ev.StepEnded), hang, buffer=1)
    result = trainer.fit_sync()  # returns: the hung work is cancelled at close_timeout
    # One item started and hung; of the other two, what waited in the buffer at the call's
    # end was cancelled with it and the rest dropped (how many of each depends on how the
    # three events fell into dispatch slices): all three are lost work, none is silent.
    assert result.steps == 3 and len(seen) == 1
    stats = sub.statistics()
    assert stats.cancelled >= 1 and stats.dropped + stats.cancelled == 3
    assert sum(x.total for x in result.lost_work.values()) == 3
    assert 0.5 <= result.end_waited_s[stats.name] < 5  # the wait, up to close_timeout
    assert trainer.evaluate_sync()["val_loss"] > 0  # the next call runs
    trainer.close()


def test_the_wait_for_a_slow_subscriber_after_training_is_counted_apart() -> None:
    trainer = make_trainer()

    async def slow(event: ev.FitEnded) -> None:
        await anyio.sleep(0.3)  # a report written once training ended

    async def quick(event: ev.FitEnded) -> None:
        pass

    trainer.bus.subscribe_async(trainer.bus.stream(ev.FitEnded), slow, name="slow")
    trainer.bus.subscribe_async(trainer.bus.stream(ev.FitEnded), quick, name="quick")
    result = trainer.fit_sync()
    assert result.subscriber_failures == {}
    assert set(result.end_waited_s) == {"slow"} and result.end_waited_s["slow"] >= 0.3
    assert result.waited_s == {}  # training itself never waited


# fit() is cancellable at any moment: a cancellation, or a SIGINT, at every await point of a fit
# (start-up, training, the call's end) ends with a FitResult or the cancellation itself, never a
# foreign RuntimeError about cancel scopes, and the next call in the same event loop works.
# Deterministic: the k-th suspension of fit()'s coroutine triggers it, not a timer.


BACKENDS = ["asyncio", "trio"]


class AtSuspension:
    """Await ``coro``, calling ``action()`` when it suspends for the ``k``-th time (each time
    it yields to the event loop: every await point that really waits). Counts them all."""

    def __init__(self, coro: Coroutine[Any, Any, Any], k: int | None,
                 action: Callable[[], None]) -> None:  # fmt: skip
        self.coro, self.k, self.action = coro, k, action
        self.count = 0

    def __await__(self) -> Generator[Any, Any, Any]:
        it = self.coro.__await__()
        send: Any = None
        error: BaseException | None = None
        while True:
            try:
                value = it.send(send) if error is None else it.throw(error)
            except StopIteration as stop:
                return stop.value
            send, error = None, None
            self.count += 1
            if self.count == self.k:
                self.action()
            try:
                send = yield value
            except BaseException as exc:  # the event loop's cancellation, delivered here
                error = exc


def make_cancelled_trainer(tmp: Path, **overrides: Any) -> Trainer:
    model = tiny_model()
    kwargs: dict[str, Any] = dict(
        loss_fn=F.cross_entropy,
        max_steps=4,
        device="cpu",
        eval_data=tiny_loader(1, seed=1),
        on_signal=None,
        progress=False,
        eval_schedule=EvalSchedule(every_steps=2),
        checkpoint_dir=tmp,
    )
    kwargs.update(overrides)
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_loader(2), **kwargs)


async def next_calls_work(trainer: Trainer) -> None:
    """The next fit (resuming when the cancelled one trained) and an evaluate() run."""
    assert trainer.bus.state in ("new", "suspended")
    if trainer.result is None:  # the loop never ran: the Trainer is as before
        result = await trainer.fit()
    else:
        result = await trainer.fit(resume="latest")
    assert result.reason == "completed" and result.steps == 4
    metrics = await trainer.evaluate()
    assert "val_loss" in metrics


def count_suspensions(backend: str, tmp: Path) -> int:
    async def main() -> int:
        waiter = AtSuspension(make_cancelled_trainer(tmp).fit(), None, lambda: None)
        result = await waiter
        assert result.reason == "completed"
        return waiter.count

    return anyio.run(main, backend=backend)


# One fit per await point (about 30-60 of them): minutes on a loaded 2-core machine.
@pytest.mark.timeout(360)
@pytest.mark.parametrize("backend", BACKENDS)
def test_cancel_at_every_await_point_of_fit(backend: str, tmp_path: Path) -> None:
    total = count_suspensions(backend, tmp_path / "count")
    assert total >= 5  # start-up, the thread, barriers' deliveries, the call's end
    outcomes: dict[str, int] = {}

    async def main() -> None:
        for k in range(1, total + 2):  # one past the end: cancelled after the last await
            trainer = make_cancelled_trainer(tmp_path / str(k))
            with anyio.CancelScope() as scope:
                result = await AtSuspension(trainer.fit(), k, scope.cancel)
            if scope.cancelled_caught:
                outcomes["cancellation"] = outcomes.get("cancellation", 0) + 1
            else:
                # The cancel arrived once nothing could be cancelled: a clean result.
                assert isinstance(result, FitResult)
                assert result.reason in ("completed", "cancelled"), (k, result)
                outcomes[result.reason] = outcomes.get(result.reason, 0) + 1
            await next_calls_work(trainer)

    anyio.run(main, backend=backend)
    assert outcomes.get("cancellation", 0) >= total - 2, outcomes


@pytest.mark.timeout(360)
@pytest.mark.parametrize("backend", BACKENDS)
def test_sigint_at_every_await_point_of_fit(backend: str, tmp_path: Path) -> None:
    total = count_suspensions(backend, tmp_path / "count")
    reasons: dict[str, int] = {}

    async def main() -> None:
        for k in range(1, total + 1):
            # on_signal="return": the result, not the interrupt (tests/test_signals.py)
            trainer = make_cancelled_trainer(tmp_path / str(k), on_signal="return")
            result = await AtSuspension(trainer.fit(), k,
                                        lambda: signal.raise_signal(signal.SIGINT))  # fmt: skip
            assert result.reason in ("stopped", "completed"), (k, result)
            reasons[result.reason] = reasons.get(result.reason, 0) + 1
            await next_calls_work(trainer)

    previous = signal.getsignal(signal.SIGINT)
    anyio.run(main, backend=backend)
    assert signal.getsignal(signal.SIGINT) is previous  # every fit restored the handler
    assert reasons.get("stopped", 0) >= 1, reasons


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_deadline_already_passed(backend: str, tmp_path: Path) -> None:
    async def main() -> None:
        trainer = make_cancelled_trainer(tmp_path)
        with anyio.move_on_after(0) as scope:
            await trainer.fit()
        assert scope.cancelled_caught
        assert trainer.result is None and trainer.bus.state == "new"
        await next_calls_work(trainer)

    anyio.run(main, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("k", [1, 2, 3, 5, 8, 13])
def test_two_fits_in_one_task_group_cancelled_together(
    backend: str, k: int, tmp_path: Path
) -> None:
    async def main() -> None:
        trainers = [make_cancelled_trainer(tmp_path / "a"), make_cancelled_trainer(tmp_path / "b")]
        async with anyio.create_task_group() as tg:
            # The first fit's k-th suspension cancels both.
            tg.start_soon(_awaiting, AtSuspension(trainers[0].fit(), k, tg.cancel_scope.cancel))
            tg.start_soon(trainers[1].fit)
        for trainer in trainers:
            await next_calls_work(trainer)

    anyio.run(main, backend=backend)


async def _awaiting(waiter: AtSuspension) -> None:
    await waiter


# fit() without await (the habit of a synchronous trainer): the coroutine is dropped unrun,
# and the warning at the line that called it names what to write there.


@pytest.mark.parametrize(("call", "twin"), [("fit", "fit_sync"), ("evaluate", "evaluate_sync")])
def test_a_call_never_awaited_warns_at_its_line_naming_the_sync_twin(call: str, twin: str) -> None:
    trainer = make_trainer()
    with pytest.warns(RuntimeWarning) as warned:
        getattr(trainer, call)()  # dropped at once: nothing ran
    (warning,) = warned
    assert str(warning.message) == (
        f"Trainer.{call}() was never awaited, so nothing ran: from synchronous code call "
        f"trainer.{twin}(); in async code, await trainer.{call}()"
    )
    assert warning.filename == __file__  # the caller's line, not trainbus'
    assert "getattr(trainer, call)()" in Path(__file__).read_text().splitlines()[warning.lineno - 1]
    assert trainer.result is None
    assert trainer.fit_sync().steps == 3  # the Trainer is as it was


def test_a_call_awaited_or_run_by_any_runner_does_not_warn(
    recwarn: pytest.WarningsRecorder,
) -> None:
    results = [
        asyncio.run(make_trainer().fit()),  # asyncio.run wants a coroutine: this is one
        anyio.run(make_trainer().fit),
        anyio.run(make_trainer().fit, backend="trio"),
    ]

    async def in_a_task() -> FitResult:
        return await asyncio.create_task(make_trainer().fit())

    results.append(asyncio.run(in_a_task()))
    assert [r.steps for r in results] == [3, 3, 3, 3]
    assert [w for w in recwarn if issubclass(w.category, RuntimeWarning)] == []


def test_an_unawaited_call_shows_what_to_do_in_a_notebook_cell() -> None:
    call = make_trainer().fit()  # a cell's last expression is shown, not dropped
    try:
        assert repr(call) == (
            "<the coroutine of Trainer.fit(): await it, or call trainer.fit_sync() from "
            "synchronous code>"
        )
    finally:
        call.close()  # closed: no warning


def test_reading_the_result_of_an_unawaited_call_says_where_the_result_comes_from() -> None:
    call = make_trainer().fit()  # `result = trainer.fit(); result.steps`, the Lightning habit
    try:
        said = r"'steps' of the coroutine Trainer\.fit\(\) returns: .*await trainer.*fit_sync"
        with pytest.raises(AttributeError, match=said):
            call.steps  # type: ignore[attr-defined]  # noqa: B018
    finally:
        call.close()


def test_evaluating_from_a_subscriber_during_fit_is_told_to_send_a_command() -> None:
    """The mistake a user makes: evaluate from a subscriber while fit() runs, sync or async.
    Each failure the bus logs names the command that does it."""
    from structlog.testing import capture_logs

    model = tiny_model()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_loader(4),
                      loss_fn=F.cross_entropy, eval_data=tiny_loader(2, seed=1), max_steps=4,
                      progress=False, on_signal=None)  # fmt: skip
    bus = trainer.bus

    async def evaluate_async(_: ev.StepEnded) -> None:
        await trainer.evaluate()

    bus.subscribe(bus.stream(ev.StepEnded).pipe(ops.take(1)), lambda _: trainer.evaluate_sync())
    bus.subscribe_async(bus.stream(ev.StepEnded).pipe(ops.take(1)), evaluate_async)
    with capture_logs() as logs:
        result = trainer.fit_sync()
    assert result.steps == 4
    failures = [str(x) for x in logs if x["event"] == "subscriber_failed"]
    assert len(failures) == 2, logs
    for failure in failures:
        assert "during fit() send a command" in failure or "during fit(), evaluate" in failure
        assert "trainer.bus.send(commands.Evaluate())" in failure


# ------------------------------------------------------------------ commands between calls
def _send_late(bus: EventBus) -> None:
    """A late time-budget thread's stop and an LR change, sent while no call runs: dropped,
    and logged (the stop at info, as a stop after the end; the other as a warning)."""
    with capture_logs() as logs:
        bus.send(cmd.StopTraining(reason="time budget"))
        bus.send(cmd.SetLearningRate(lr=0.5))
    (stop,) = [x for x in logs if x["event"] == "stop_after_the_end"]
    (lost,) = [x for x in logs if x["event"] == "commands_not_applied"]
    assert "no call is running" in stop["reason"] and "SetLearningRate" in lost["commands"][0]
    assert lost["log_level"] == "warning"


@pytest.mark.parametrize("with_block", [False, True])
def test_a_command_sent_between_calls_is_dropped_not_carried_into_the_next_call(
    with_block: bool,
) -> None:
    """No loop polls between calls, and the next call must not inherit what was sent then: an
    ``evaluate()`` over no batch, a ``fit()`` stopped at its first poll, an LR set at step 0."""
    trainer = make_trainer(eval_data=tiny_loader(4, seed=1))
    bus = trainer.bus
    applied = EventRecorder(bus)

    def calls() -> tuple[dict[str, float], dict[str, float], FitResult]:
        first = trainer.evaluate_sync()
        _send_late(bus)
        second = trainer.evaluate_sync()
        _send_late(bus)
        return first, second, trainer.fit_sync()

    if with_block:
        with trainer:
            first, second, fitted = calls()
    else:
        first, second, fitted = calls()
    assert len(applied.of_type(ev.EvaluationEnded)) == 2
    assert len(applied.of_type(ev.EvalBatchEnded)) == 8  # each over the whole set
    assert first == second != {}
    assert (fitted.reason, fitted.steps) == ("completed", 3)  # not stopped at its first poll
    assert [e.lr for e in applied.of_type(ev.StepEnded)] == [0.1] * 3  # no LR change
    assert applied.of_type(ev.CommandApplied) == []


@pytest.mark.asyncio
@pytest.mark.parametrize("async_with", [False, True])
async def test_a_request_between_calls_raises_at_once_instead_of_waiting_forever(
    async_with: bool,
) -> None:
    """Also where the bus runs across calls (``async with trainer``): between them, no loop
    polls; a stale stop does not empty the next ``evaluate()``."""
    trainer = make_trainer(eval_data=tiny_loader(4, seed=1))
    applied = EventRecorder(trainer.bus)

    async def calls() -> FitResult:
        first = await trainer.evaluate()
        with anyio.fail_after(5), pytest.raises(BusClosedError, match="no call is running"):
            await trainer.bus.request(cmd.SaveCheckpoint(tag="late"))
        _send_late(trainer.bus)
        assert await trainer.evaluate() == first != {}
        return await trainer.fit()  # the bus is as good as before

    if async_with:
        async with trainer:
            result = await calls()
    else:
        result = await calls()
    assert (result.reason, result.steps) == ("completed", 3)
    assert len(applied.of_type(ev.EvalBatchEnded)) == 8
    assert applied.of_type(ev.CommandApplied) == []

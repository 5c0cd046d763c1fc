"""The event-loop watchdog: a sync subscriber that blocks the loop thread is named, with its stack,
while it still blocks; the watchdog thread lives exactly as long as the bus runs."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, MutableMapping
from typing import Any

import anyio
import pytest
import torch
from reactivex import operators as ops
from structlog.testing import capture_logs
from torch.nn import functional as F

from trainbus import ConfigError, EventBus, Trainer
from trainbus import events as ev
from trainbus.testing import tiny_loader, tiny_model


def build_step(i: int) -> ev.StepEnded:
    return ev.StepEnded(step=i, epoch=0, loss=float(i), lr=0.1, grad_norm=None, samples=4,
                        duration_s=0.01)  # fmt: skip


WARNING = "subscriber_blocks_event_loop"
DEADLINE = 30.0  # seconds a blocked subscriber waits for the warning before giving up


def warnings_in(logs: list[MutableMapping[str, Any]]) -> list[MutableMapping[str, Any]]:
    return [e for e in list(logs) if e["event"] == WARNING]


def blocking_until_warned(
    logs: list[MutableMapping[str, Any]], seen: list[list[MutableMapping[str, Any]]]
) -> Callable[[object], None]:
    """A sync subscriber that blocks the loop thread until the watchdog's warning shows (or
    DEADLINE passes): what it saw while it was still blocking lands in ``seen``."""

    def slow_subscriber(_: object) -> None:
        end = time.monotonic() + DEADLINE
        while not warnings_in(logs) and time.monotonic() < end:
            time.sleep(0.01)  # blocks the event loop: no await
        seen.append(warnings_in(logs))

    return slow_subscriber


def watchdog_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "trainbus-watchdog"]


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_blocking_sync_subscriber_is_named_with_its_stack_while_it_blocks(backend: str) -> None:
    seen: list[list[MutableMapping[str, Any]]] = []

    async def main() -> EventBus:
        async with EventBus(watchdog_s=0.2, flush_interval=0.01) as bus:
            bus.subscribe(bus.stream(ev.StepEnded), blocking_until_warned(logs, seen),
                          name="slow-uploader")  # fmt: skip
            bus.subscribe(bus.stream(ev.StepEnded), lambda e: None, name="quick")
            bus.publish(build_step(1))
            await bus.wait_delivered(DEADLINE + 5)
        return bus

    with capture_logs() as logs:
        bus = anyio.run(main, backend=backend)
    assert len(seen) == 1 and len(seen[0]) == 1, "no warning while the subscriber blocked"
    warning = seen[0][0]
    assert warning["log_level"] == "warning"
    assert warning["subscription"] == "slow-uploader"
    assert warning["blocked_s"] >= 0.2
    assert warning["watchdog_s"] == 0.2
    # The loop thread's stack at that moment: inside the subscriber's own function.
    assert "in slow_subscriber" in warning["stack"]
    assert "time.sleep(0.01)" in warning["stack"]
    assert "subscribe_async" in warning["hint"]
    # Once it returned: one line with how long it blocked, and the counters.
    unblocked = [e for e in logs if e["event"] == "subscriber_unblocked"]
    assert [e["subscription"] for e in unblocked] == ["slow-uploader"]
    stats = {s.name: s for s in bus.statistics().subscriptions}
    assert stats["slow-uploader"].stalls == 1
    assert stats["slow-uploader"].blocked_s >= 0.2
    assert stats["quick"].stalls == 0 and stats["quick"].blocked_s == 0.0
    assert len(warnings_in(logs)) == 1  # one warning per blocked call, not one per poll


@pytest.mark.asyncio
async def test_many_short_calls_are_not_one_long_block() -> None:
    calls: list[int] = []

    def short(e: ev.StepEnded) -> None:
        time.sleep(0.002)  # 800 of them hold the loop >= 1.6 s in one slice, each only 2 ms
        calls.append(e.step)

    with capture_logs() as logs:
        async with EventBus(watchdog_s=1.0) as bus:
            sub = bus.subscribe(bus.stream(ev.StepEnded), short)
            for i in range(800):
                bus.publish(build_step(i))
            await bus.wait_delivered(60)
    assert len(calls) == 800
    assert warnings_in(logs) == []
    assert sub.statistics().stalls == 0


@pytest.mark.asyncio
async def test_the_watchdog_thread_runs_exactly_while_the_bus_runs() -> None:
    before = len(watchdog_threads())
    bus = EventBus(watchdog_s=1)
    assert len(watchdog_threads()) == before  # not at construction
    async with bus:
        (thread,) = watchdog_threads()[before:]
        assert thread.daemon and thread.is_alive()
    assert not thread.is_alive()  # stopped and joined at close, never leaked
    assert len(watchdog_threads()) == before


@pytest.mark.asyncio
async def test_none_disables_the_watchdog() -> None:
    before = len(watchdog_threads())
    with capture_logs() as logs:
        async with EventBus(watchdog_s=None) as bus:
            assert len(watchdog_threads()) == before
            sub = bus.subscribe(bus.stream(ev.StepEnded), lambda e: time.sleep(0.3))
            bus.publish(build_step(1))
            await bus.wait_delivered(30)
    assert warnings_in(logs) == [] and sub.statistics().stalls == 0
    assert bus.watchdog_s is None
    assert EventBus().watchdog_s == 5.0  # the documented default


@pytest.mark.parametrize("value", [-1, 0, "5", float("nan"), float("inf"), True])
def test_a_bad_threshold_is_a_config_error_naming_the_option(value: object) -> None:
    with pytest.raises(ConfigError, match="watchdog_s") as info:
        EventBus(watchdog_s=value)  # type: ignore[arg-type]
    assert repr(value) in str(info.value) or str(value) in str(info.value)
    with pytest.raises(ConfigError, match="watchdog_s"):
        trainer(watchdog_s=value)


def test_the_trainer_option_sets_the_bus_and_refuses_to_override_a_given_bus() -> None:
    assert trainer(watchdog_s=2).bus.watchdog_s == 2.0
    assert trainer(watchdog_s=None).bus.watchdog_s is None
    assert trainer().bus.watchdog_s == 5.0
    mine = EventBus(watchdog_s=None)
    assert trainer(bus=mine).bus is mine
    with pytest.raises(ConfigError, match=r"watchdog_s.*EventBus\(watchdog_s="):
        trainer(bus=mine, watchdog_s=3)


def test_a_trainer_run_names_its_blocking_subscriber_and_still_completes() -> None:
    seen: list[list[MutableMapping[str, Any]]] = []
    with capture_logs() as logs:
        t = trainer(watchdog_s=0.2)
        slow = blocking_until_warned(logs, seen)
        once = t.bus.stream(ev.StepEnded).pipe(ops.take(1))
        t.bus.subscribe(once, slow, name="blocking-on-step")
        result = t.fit_sync()
    assert result.reason == "completed" and result.steps == 3
    assert len(seen) == 1 and [w["subscription"] for w in seen[0]] == ["blocking-on-step"]
    assert "in slow_subscriber" in seen[0][0]["stack"]
    stats = {s.name: s for s in result.statistics.subscriptions}
    assert stats["blocking-on-step"].stalls == 1
    assert watchdog_threads() == []


def trainer(**kw: Any) -> Trainer:
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return Trainer(model, opt, tiny_loader(), loss_fn=F.cross_entropy, max_steps=3, progress=False,
                   handle_signals=False,
                   **kw)  # fmt: skip

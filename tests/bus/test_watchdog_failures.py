"""Faulty subscribers never stop training nor hang ``fit()``, and are reported in the result.

Real runs (100 optimizer steps over 2 epochs, a final checkpoint) with one faulty subscriber:
one that raises on every event (sync and async), an async one that awaits forever (with each
overflow policy), and slow ones (sync and async). The bus' ``close_timeout`` and the
``barrier_timeout`` are short so the bounds hold quickly; ``pytest-timeout`` guards a hang.
A sync subscriber that never returns blocks the event-loop thread: what the bus can and cannot
promise for it is in docs/reliability.md (it is not run here, since it would hang the process).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
import torch.nn.functional as F
from structlog.testing import capture_logs

from trainbus import EventBus, Trainer
from trainbus import commands as cmd
from trainbus import events as ev
from trainbus._hookpoints import StepContext
from trainbus.testing import EventRecorder, tiny_loader, tiny_model

STEPS = 100
pytestmark = pytest.mark.timeout(60)


def _trainer(tmp_path: Path) -> Trainer:
    model = tiny_model()
    bus = EventBus(close_timeout=1.0, barrier_timeout=0.5)
    # The tests compare with CPU copies of the model: pinned, so a GPU host runs them alike.
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_loader(STEPS // 2, 8),
                   loss_fn=F.cross_entropy, max_epochs=2, checkpoint_dir=tmp_path / "ckpt",
                   on_signal=None, bus=bus, device="cpu")  # fmt: skip


def _attach(trainer: Trainer, fault: str) -> None:
    bus = trainer.bus

    def boom(event: Any) -> None:
        raise RuntimeError(f"subscriber fault on {type(event).__name__}")

    async def aboom(event: Any) -> None:
        await anyio.lowlevel.checkpoint()
        raise RuntimeError(f"subscriber fault on {type(event).__name__}")

    async def hang(event: Any) -> None:
        await anyio.sleep_forever()

    def slow(event: Any) -> None:
        time.sleep(0.002)

    async def aslow(event: Any) -> None:
        await anyio.sleep(0.005)

    every = bus.events
    match fault:
        case "raises_sync":
            bus.subscribe(every, boom, name="fault")
        case "raises_async":
            # Every event of the run is buffered: on a loaded machine the default 64 could
            # drop some before the failures are counted.
            bus.subscribe_async(every, aboom, name="fault", buffer=64 * STEPS)
        case "hangs_async_block" | "hangs_async_latest" | "hangs_async_drop_oldest":
            overflow = fault.removeprefix("hangs_async_")
            bus.subscribe_async(every, hang, overflow=overflow, name="fault")  # type: ignore[arg-type]
        case "slow_sync":
            bus.subscribe(bus.stream(ev.StepEnded, ev.EpochEnded), slow, name="fault")
        case "slow_async":
            # A buffer for the whole run: no barrier drains its backlog (it does not decide),
            # so with the default 64 a loaded machine would drop (and report) some of it.
            bus.subscribe_async(bus.stream(ev.StepEnded, ev.EpochEnded), aslow, name="fault",
                                buffer=STEPS + 2)  # fmt: skip
        case _:
            raise AssertionError(fault)


FAULTS = [
    "raises_sync",
    "raises_async",
    "hangs_async_latest",
    "hangs_async_drop_oldest",
    "slow_sync",
    "slow_async",
]


@pytest.mark.parametrize("fault", FAULTS)
def test_a_faulty_subscriber_never_stops_training_nor_hangs_fit(tmp_path: Path, fault: str) -> None:
    trainer = _trainer(tmp_path)
    _attach(trainer, fault)
    rec = EventRecorder(trainer.bus)
    before = [p.detach().clone() for p in trainer.settings.model.parameters()]
    result = trainer.fit_sync()  # returns: a hang would trip the test's timeout

    # Training went on to the end, as without the subscriber.
    assert result.reason == "completed" and result.steps == STEPS and result.epochs == 2
    assert result.last_checkpoint is not None and Path(result.last_checkpoint).is_file()
    after = list(trainer.settings.model.parameters())
    assert not all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert [e.reason for e in rec.of_type(ev.FitEnded)] == ["completed"]
    assert len(rec.of_type(ev.StepEnded)) == STEPS  # the other subscribers lost nothing

    # ... and the fault is reported.
    (sub,) = [s for s in result.statistics.subscriptions if s.name == "fault"]
    if fault.startswith("raises"):
        assert result.subscriber_failures == {"fault": sub.failed}
        assert sub.failed == sub.completed >= STEPS and sub.last_error is not None
        assert "subscriber fault" in sub.last_error
        assert result.statistics.failed == sub.failed
    elif fault.startswith("hangs"):
        # Awaiting forever: cancelled when the bus closed past close_timeout, and counted.
        assert sub.cancelled >= 1 and result.statistics.cancelled >= 1
        assert sub.completed == 0 and result.subscriber_failures == {}
        assert sub.dropped > 0  # the buffer policy dropped what the hung worker never took
        assert result.lost_work == {"fault": sub.lost_work} and sub.lost_work.total > 0
        # A dropping policy never holds training, nor does any barrier: it takes every event,
        # barrier events included, but does not decide (decides=False).
        assert "fault" not in result.waited_s
    else:
        assert sub.failed == sub.cancelled == sub.dropped == 0
        assert sub.completed == sub.received == STEPS + 2  # every StepEnded and EpochEnded
        assert result.subscriber_failures == {}
        if fault == "slow_async":  # it does not decide: nothing waits for it
            assert "fault" not in result.waited_s
        else:  # on the event loop: the barriers waited for its backlog, at most all its calls
            assert result.waited_s.get("fault", 0.0) <= 0.002 * (STEPS + 2) * 2


def test_a_hung_block_subscriber_holds_training_says_so_and_a_stop_still_ends_the_run(
    tmp_path: Path,
) -> None:
    """``overflow="block"`` asks that nothing be dropped: a subscriber that never finishes then
    holds training at its poll points (that is the policy), a warning names it, the wait is
    counted, and a ``StopTraining`` (what a first Ctrl-C sends) still ends the run."""
    trainer = _trainer(tmp_path)
    bus = trainer.bus

    async def hang(event: Any) -> None:
        await anyio.sleep_forever()

    sub = bus.subscribe_async(bus.stream(ev.StepEnded), hang, buffer=4, overflow="block",
                              name="fault")  # fmt: skip

    def stop_when_held() -> None:
        while sub.statistics().waited_s < 0.2:
            time.sleep(0.01)
        bus.send(cmd.StopTraining(reason="user"))

    watcher = threading.Thread(target=stop_when_held, daemon=True)
    watcher.start()
    with capture_logs() as logs:
        result = trainer.fit_sync()
    watcher.join(5)
    assert result.reason == "stopped" and result.stop_reason == "user"
    assert 0 < result.steps < STEPS  # held, then stopped
    assert result.waited_s["fault"] >= 0.2
    held = [x for x in logs if x["event"] == "training_waits_for_subscriber"]
    assert [x["subscription"] for x in held] == ["fault"]
    # Nothing dropped; what it never finished was cancelled at close_timeout, and reported.
    lost = result.lost_work["fault"]
    assert lost.dropped == 0 and lost.cancelled == sub.statistics().received >= 5
    assert [x["lost_work"]["fault"]["cancelled"] for x in logs
            if x["event"] == "bus_closed_with_lost_work"] == [lost.cancelled]  # fmt: skip


def test_lost_work_of_subscriptions_sharing_a_name_is_reported_once_in_full() -> None:
    """Two subscriptions with the same name (two lambdas), the first failing once under
    ``on_error="log"``: the end of ``fit`` reports that one failure under the name, and the
    close after it reports nothing more (no negative counts from one overwriting the other)."""
    model = tiny_model()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_loader(6, 4),
                      loss_fn=F.cross_entropy, max_epochs=1, on_signal=None,
                      progress=False)  # fmt: skip
    failed: list[int] = []

    def fail_once(e: ev.StepEnded) -> None:
        if not failed:
            failed.append(e.step)
            raise RuntimeError("once")

    trainer.bus.stream(ev.StepEnded).subscribe(lambda e: fail_once(e), on_error="log")
    trainer.bus.stream(ev.StepEnded).subscribe(lambda e: None, on_error="log")
    with capture_logs() as logs:
        result = trainer.fit_sync()
        trainer.close()
    assert result.reason == "completed" and failed == [1]
    (report,) = [x for x in logs if x["event"] == "bus_closed_with_lost_work"]
    ((name, counts),) = report["lost_work"].items()  # both lambdas' qualified name
    assert name.endswith("<lambda>")
    assert counts == {"dropped": 0, "cancelled": 0, "failed": 1}
    assert report["total"] == 1 and report["failed"] == 1


# The user's exception reaches the caller as itself: a subscriber with on_error="raise" or a
# hook that raises fails the run with that exception (``except MyError`` matches at fit() and
# run()), a note saying where trainbus caught it, and the run's end as for any failure.


class TrialPruned(Exception):
    """A user's own exception type (as optuna.TrialPruned is)."""


def make_trainer(tmp: Path, **overrides: Any) -> Trainer:
    model = tiny_model()
    kwargs: dict[str, Any] = dict(
        loss_fn=F.cross_entropy, max_steps=6, device="cpu", on_signal=None,
        progress=False, checkpoint_dir=tmp,
    )  # fmt: skip
    kwargs.update(overrides)
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_loader(6), **kwargs)


def trainbus_notes(exc: BaseException) -> list[str]:
    return [n for n in getattr(exc, "__notes__", []) if n.startswith("trainbus:")]


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_a_subscribers_exception_comes_out_of_fit_as_itself(
    kind: str, tmp_path: Path
) -> None:
    trainer = make_trainer(tmp_path)
    bus = trainer.bus
    recorder = EventRecorder(bus)

    def prune(e: ev.StepEnded) -> None:
        if e.step == 2:
            raise TrialPruned(f"pruned at {e.step}")

    async def prune_async(e: ev.StepEnded) -> None:
        prune(e)

    if kind == "sync":
        bus.subscribe(bus.stream(ev.StepEnded), prune, on_error="raise", name="pruner")
    else:
        bus.subscribe_async(bus.stream(ev.StepEnded), prune_async, on_error="raise",
                            name="pruner")  # fmt: skip
    try:
        await trainer.fit()
    except TrialPruned as exc:
        caught: TrialPruned = exc
    else:
        pytest.fail("fit() returned")
    assert str(caught) == "pruned at 2"
    (note,) = trainbus_notes(caught)
    assert "subscriber 'pruner'" in note and "StepEnded (step 2, epoch 0)" in note
    (end,) = recorder.of_type(ev.FitEnded)
    assert end.reason == "failed" and end.error is caught
    assert trainer.result is not None and trainer.result.reason == "failed"
    # A failed run writes no final checkpoint (as before): nothing was saved.
    assert not any(name.endswith(".pt") for name in os.listdir(tmp_path))
    # The next call on the same Trainer starts without the failure.
    metrics = await trainer.evaluate(tiny_loader(1, seed=1))
    assert "val_loss" in metrics


def test_a_hooks_exception_comes_out_of_run_as_itself(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path)
    recorder = EventRecorder(trainer.bus)

    def scale_loss(ctx: StepContext) -> None:
        if ctx.step == 3:
            raise TrialPruned("from a hook")

    trainer.add_hook("loss", scale_loss)
    with pytest.raises(TrialPruned, match="from a hook") as caught:
        trainer.fit_sync()
    (note,) = trainbus_notes(caught.value)
    assert "hook" in note and "scale_loss" in note and "'loss'" in note and "step 3" in note
    (end,) = recorder.of_type(ev.FitEnded)
    assert end.reason == "failed" and end.error is caught.value

"""Barriers: where the loop waits for its subscribers, and where it never does.

Every assertion is on the *order* in which things happened (one list, appended to on the
event-loop thread by a recorder and by the subscribers), never on durations.
"""

from __future__ import annotations

from typing import Any

import anyio
import anyio.lowlevel
import pytest
import torch
import torch.nn.functional as F
from structlog.testing import capture_logs

from trainbus import Trainer
from trainbus import commands as cmd
from trainbus import events as ev
from trainbus.testing import tiny_loader, tiny_model

DONE = "SubscriberDone"


def make_trainer(**overrides: Any) -> Trainer:
    """5 steps in one epoch, one evaluation at step 3 (a barrier by default)."""
    model = tiny_model()
    kwargs: dict[str, Any] = dict(
        loss_fn=F.cross_entropy,
        eval_data=tiny_loader(1, seed=1),
        eval_every=3,
        eval_at_epoch_end=False,
        max_epochs=1,
        log_every=1,
        device="cpu",
        handle_signals=False,
    )
    kwargs.update(overrides)
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_loader(5), **kwargs)


class Order:
    """One ordered log: every event as (name, step) (``BatchFetched(train)`` etc. for events with a
    phase), plus the subscribers' side effects."""

    def __init__(self, trainer: Trainer) -> None:
        self.items: list[tuple[str, int]] = []
        self.went_on = anyio.Event()  # set once the loop published a step after the evaluation
        trainer.bus.subscribe(trainer.bus.events, self._record)

    def _record(self, e: ev.BaseEvent) -> None:
        phase = getattr(e, "phase", None)
        self.items.append((type(e).__name__ + (f"({phase})" if phase else ""), e.step))
        if isinstance(e, ev.StepEnded) and e.step > 3:
            self.went_on.set()

    def index(self, item: tuple[str, int]) -> int:
        assert item in self.items, f"{item} never happened: {self.items}"
        return self.items.index(item)

    def assert_order(self, *items: tuple[str, int]) -> None:
        """Each item happened (first occurrence), in this order."""
        at = [self.index(item) for item in items]
        assert at == sorted(at), f"expected {items} in this order; got {self.items}"


GAVE_UP = "SubscriberGaveUp"


def waited_s(trainer: Trainer, name: str) -> float:
    """Seconds the training thread waited on subscription ``name`` (its public statistics)."""
    (sub,) = [s for s in trainer.bus.statistics().subscriptions if s.name == name]
    return sub.waited_s


@pytest.mark.asyncio
async def test_the_loop_waits_at_a_barrier() -> None:
    trainer = make_trainer()
    order = Order(trainer)

    async def slow(e: ev.EvaluationEnded) -> None:
        for _ in range(100):  # yield to the event loop many times: room for a loop not held
            await anyio.lowlevel.checkpoint()
        order.items.append((DONE, e.step))

    trainer.bus.subscribe_async(trainer.bus.stream(ev.EvaluationEnded), slow, name="slow")
    result = await trainer.fit()
    assert result.reason == "completed" and result.steps == 5
    # The subscriber's side effect lands between the evaluation and the next step.
    # (Not even the next fetch happened before it.)
    order.assert_order(
        ("EvaluationEnded", 3), (DONE, 3), ("BatchFetched(train)", 3), ("StepEnded", 4)
    )
    # And the training thread did wait for it (a loop that never waited has 0 here, however
    # fast or slow the machine).
    assert waited_s(trainer, "slow") > 0


@pytest.mark.asyncio
async def test_without_barriers_the_loop_does_not_wait() -> None:
    trainer = make_trainer(barriers=())
    order = Order(trainer)

    async def slow(e: ev.EvaluationEnded) -> None:
        # Finishes only once the loop has published a later step: a loop that waited here for
        # it would never get there (the subscriber gives up after 30 s and says so).
        with anyio.move_on_after(30):
            await order.went_on.wait()
        order.items.append((DONE if order.went_on.is_set() else GAVE_UP, e.step))

    trainer.bus.subscribe_async(trainer.bus.stream(ev.EvaluationEnded), slow, name="slow")
    result = await trainer.fit()
    assert result.reason == "completed" and result.steps == 5
    order.assert_order(("EvaluationEnded", 3), ("StepEnded", 4), (DONE, 3))


@pytest.mark.asyncio
async def test_barrier_timeout_lets_the_loop_go_on_with_a_warning() -> None:
    trainer = make_trainer(barrier_timeout=0.05)
    order = Order(trainer)

    async def stuck(e: ev.EvaluationEnded) -> None:
        # Finishes only once the loop has gone on: the barrier can only end by its timeout.
        with anyio.move_on_after(30):
            await order.went_on.wait()
        order.items.append((DONE, e.step))

    trainer.bus.subscribe_async(trainer.bus.stream(ev.EvaluationEnded), stuck, name="stuck")
    with capture_logs() as logs:
        result = await trainer.fit()

    assert result.reason == "completed" and result.steps == 5
    order.assert_order(("EvaluationEnded", 3), ("StepEnded", 4), (DONE, 3))
    timeouts = [entry for entry in logs if entry["event"] == "barrier_timeout"]
    assert timeouts, [entry["event"] for entry in logs]
    assert timeouts[0]["log_level"] == "warning"
    assert timeouts[0]["timeout"] == 0.05 and timeouts[0]["waiting"] == ["stuck"]


@pytest.mark.asyncio
async def test_a_slow_subscriber_of_another_event_does_not_hold_the_barrier() -> None:
    trainer = make_trainer()
    order = Order(trainer)

    async def slow_step(e: ev.StepEnded) -> None:
        if e.step == 3:  # delivered with the evaluation's barrier; finishes after the loop goes on
            with anyio.move_on_after(30):
                await order.went_on.wait()
            order.items.append((DONE, e.step))

    trainer.bus.subscribe_async(trainer.bus.stream(ev.StepEnded), slow_step)
    with capture_logs() as logs:
        result = await trainer.fit()

    assert result.reason == "completed"
    order.assert_order(("EvaluationEnded", 3), ("StepEnded", 4), (DONE, 3))
    assert not [entry for entry in logs if entry["event"] == "barrier_timeout"]


@pytest.mark.asyncio
async def test_a_sync_subscriber_runs_before_the_loop_goes_on() -> None:
    trainer = make_trainer()
    order = Order(trainer)
    trainer.bus.subscribe(trainer.bus.stream(ev.EvaluationEnded),
                          lambda e: order.items.append((DONE, e.step)))  # fmt: skip
    await trainer.fit()
    order.assert_order(("EvaluationEnded", 3), (DONE, 3), ("BatchFetched(train)", 3))


@pytest.mark.asyncio
@pytest.mark.parametrize("barrier", [ev.StepEnded, ev.MetricsLogged])
@pytest.mark.parametrize("decision_step", [False, True], ids=["plain", "decision"])
async def test_an_async_subscriber_of_a_per_step_barrier_is_waited_for(
    barrier: type[ev.BaseEvent], decision_step: bool
) -> None:
    """``barriers=(StepEnded,)`` (or ``MetricsLogged``) makes the loop wait for every async
    subscription that received the event, not only for deciders: a stop it sends at step 3
    is applied at step 3, also when step 3 is a declared decision step (whose own barrier
    waits only for deciders)."""
    trainer = make_trainer(barriers=(barrier,), eval_data=None, eval_every=None, max_epochs=3)
    order = Order(trainer)
    if decision_step:
        trainer.bus.decides(at=[3])

    async def stopper(e: ev.BaseEvent) -> None:
        if e.step == 3:
            # A service's answer: a loop not held has published its next steps by then (the
            # barrier's delivery alone runs a subscriber that only yields to the event loop).
            await anyio.sleep(0.2)
            order.items.append((DONE, e.step))
            trainer.bus.send(cmd.StopTraining(reason="seen step 3"))

    trainer.bus.subscribe_async(trainer.bus.stream(barrier), stopper, name="stopper")
    result = await trainer.fit()
    assert (result.reason, result.steps) == ("stopped", 3)
    order.assert_order((barrier.__name__, 3), (DONE, 3), ("CommandApplied", 3))
    assert ("StepEnded", 4) not in order.items
    assert waited_s(trainer, "stopper") > 0

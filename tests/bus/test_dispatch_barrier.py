"""Barriers: where the loop waits for its subscribers, for whom, and where it never does.

Every assertion is on the *order* in which things happened (one list, appended to on the
event-loop thread by a recorder and by the subscribers) or on the seconds the bus counted as
waited (``FitResult.waited_s``, zero for a loop that never waited), never on durations.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import torch
import torch.nn.functional as F
from structlog.testing import capture_logs

from trainbus import EvalSchedule, EventBus, Trainer
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
        eval_schedule=EvalSchedule(every_steps=3, epoch_end=False),
        max_epochs=1,
        log_every=1,
        device="cpu",
        on_signal=None,
        trace={"data_wait"},
    )
    kwargs.update(overrides)
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_loader(5), **kwargs)


class Order:
    """One ordered log: every event as (name, step) (``SpanTraced(train)`` etc. for events with
    a phase), plus the subscribers' side effects."""

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

    trainer.bus.subscribe_async(trainer.bus.stream(ev.EvaluationEnded), slow, name="slow",
                                decides=True)  # fmt: skip
    result = await trainer.fit()
    assert result.reason == "completed" and result.steps == 5
    # The subscriber's side effect lands between the evaluation and the next step.
    # (Not even the next fetch happened before it.)
    order.assert_order(
        ("EvaluationEnded", 3), (DONE, 3), ("SpanTraced(train)", 3), ("StepEnded", 4)
    )
    # And the training thread did wait for it (a loop that never waited has 0 here, however
    # fast or slow the machine).
    assert waited_s(trainer, "slow") > 0


@pytest.mark.asyncio
async def test_without_barriers_the_loop_does_not_wait() -> None:
    trainer = make_trainer(bus=EventBus(barriers=()))
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
    trainer = make_trainer(bus=EventBus(barrier_timeout=0.05))
    order = Order(trainer)

    async def stuck(e: ev.EvaluationEnded) -> None:
        # Finishes only once the loop has gone on: the barrier can only end by its timeout.
        with anyio.move_on_after(30):
            await order.went_on.wait()
        order.items.append((DONE, e.step))

    trainer.bus.subscribe_async(trainer.bus.stream(ev.EvaluationEnded), stuck, name="stuck",
                                decides=True)  # fmt: skip
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
    order.assert_order(("EvaluationEnded", 3), (DONE, 3), ("SpanTraced(train)", 3))


@pytest.mark.asyncio
@pytest.mark.parametrize("barrier", [ev.StepEnded, ev.MetricsLogged])
@pytest.mark.parametrize("decision_step", [False, True], ids=["plain", "decision"])
async def test_an_async_decider_of_a_per_step_barrier_is_waited_for(
    barrier: type[ev.BaseEvent], decision_step: bool
) -> None:
    """``barriers=(StepEnded,)`` (or ``MetricsLogged``) makes the loop wait for the async
    deciders that received the event: a stop one sends at step 3 is applied at step 3, also
    when step 3 is a declared decision step."""
    trainer = make_trainer(
        bus=EventBus(barriers=(barrier,)),
        eval_data=None,
        eval_schedule=EvalSchedule(every_steps=None),
        max_epochs=3,
    )
    order = Order(trainer)
    if decision_step:
        trainer.bus.declare_decision_steps(at=[3])

    async def stopper(e: ev.BaseEvent) -> None:
        if e.step == 3:
            # A service's answer: a loop not held has published its next steps by then (the
            # barrier's delivery alone runs a subscriber that only yields to the event loop).
            await anyio.sleep(0.2)
            order.items.append((DONE, e.step))
            trainer.bus.send(cmd.StopTraining(reason="seen step 3"))

    trainer.bus.subscribe_async(trainer.bus.stream(barrier), stopper, name="stopper",
                                decides=True)  # fmt: skip
    result = await trainer.fit()
    assert (result.reason, result.steps) == ("stopped", 3)
    order.assert_order((barrier.__name__, 3), (DONE, 3), ("CommandApplied", 3))
    assert ("StepEnded", 4) not in order.items
    assert waited_s(trainer, "stopper") > 0


# ------------------------------------------------------------------ who is never waited for
@pytest.mark.asyncio
@pytest.mark.parametrize("barrier", [ev.EvaluationEnded, ev.StepEnded, ev.MetricsLogged])
async def test_an_async_subscriber_that_does_not_decide_is_never_waited_for(
    barrier: type[ev.BaseEvent],
) -> None:
    """Whatever barrier event it receives: it finishes only once the loop has gone past the
    barrier (a loop that waited for it would reach the barrier's timeout, 30 s, first)."""
    trainer = make_trainer(bus=EventBus(barriers=(barrier,), barrier_timeout=30))
    order = Order(trainer)

    async def slow(e: ev.BaseEvent) -> None:
        if e.step == 3:
            with anyio.move_on_after(30):
                await order.went_on.wait()
            order.items.append((DONE if order.went_on.is_set() else GAVE_UP, e.step))

    trainer.bus.subscribe_async(trainer.bus.stream(barrier), slow, name="slow")
    with capture_logs() as logs:
        result = await trainer.fit()
    assert result.reason == "completed" and result.steps == 5
    order.assert_order((barrier.__name__, 3), ("StepEnded", 4), (DONE, 3))
    assert "slow" not in result.waited_s
    assert not [x for x in logs if x["event"] in ("barrier_timeout",
                                                 "training_waits_for_subscriber")]  # fmt: skip


POST_S = 0.1
"""What a remote metrics service takes per request (an HTTP poster: ~100 ms)."""


@pytest.mark.asyncio
async def test_a_metrics_poster_never_holds_training_nor_hands_it_its_backlog() -> None:
    """The poster of ``MetricsLogged`` + ``EvaluationEnded`` (log_every=1) receives every
    barrier event; its backlog at each evaluation is several requests long. Training never
    waits for it: the bus counts no wait at all, against the poster's seconds of work."""
    model = tiny_model()
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        tiny_loader(12),
        loss_fn=F.cross_entropy,
        eval_data=tiny_loader(1, seed=1),
        eval_schedule=EvalSchedule(every_steps=4, epoch_end=False),
        max_epochs=1,
        log_every=1,
        device="cpu",
        on_signal=None,
    )
    bus = trainer.bus
    posted: list[str] = []
    behind_at_barrier: list[int] = []

    async def post(e: ev.BaseEvent) -> None:
        await anyio.sleep(POST_S)  # the request
        posted.append(type(e).__name__)

    poster = bus.subscribe_async(bus.stream(ev.MetricsLogged, ev.EvaluationEnded), post,
                                 name="poster")  # fmt: skip

    def backlog(e: ev.EvaluationEnded) -> None:  # a sync subscriber: runs in the barrier
        s = poster.statistics()
        behind_at_barrier.append(s.received - s.completed - s.dropped)

    bus.subscribe(bus.stream(ev.EvaluationEnded), backlog)
    with capture_logs() as logs:
        result = await trainer.fit()

    assert result.reason == "completed" and result.steps == 12
    # Everything was posted (the close waited for it), nothing lost...
    assert posted.count("MetricsLogged") == 12
    assert posted.count("EvaluationEnded") == len(behind_at_barrier) == 3  # steps 4, 8, 12
    assert result.lost_work == {}
    # ...the poster was behind at every barrier (the first already has 4 metrics + 1 eval)...
    assert min(behind_at_barrier) >= 1
    # ...and none of its 1.5 s of requests was training's: no wait counted, nothing said.
    assert POST_S * len(posted) >= 1.5
    assert result.waited_s == {}
    assert not [x for x in logs if x["event"] == "training_waits_for_subscriber"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ScoresPublished(ev.BaseEvent):
    """A user's own event: the evaluation's metrics, re-published for a reporting service."""

    scores: dict[str, float]


@pytest.mark.asyncio
async def test_metrics_republished_by_a_sync_subscriber_are_not_waited_for() -> None:
    trainer = make_trainer()
    bus = trainer.bus
    order = Order(trainer)

    def republish(e: ev.EvaluationEnded) -> None:
        bus.publish(ScoresPublished(step=e.step, epoch=e.epoch, scores=dict(e.metrics)))

    async def report(e: ScoresPublished) -> None:
        # Finishes only once the loop went on: a loop that waited would hit the 60 s timeout.
        with anyio.move_on_after(30):
            await order.went_on.wait()
        order.items.append((DONE if order.went_on.is_set() else GAVE_UP, e.step))

    bus.subscribe(bus.stream(ev.EvaluationEnded), republish)
    bus.subscribe_async(bus.stream(ScoresPublished), report, name="report")
    result = await trainer.fit()
    assert result.reason == "completed" and result.steps == 5
    order.assert_order(("EvaluationEnded", 3), ("ScoresPublished", 3), ("StepEnded", 4),
                       (DONE, 3))  # fmt: skip
    assert result.waited_s == {}


@pytest.mark.asyncio
async def test_a_decider_is_waited_for_and_named_while_training_waits() -> None:
    """A ``decides=True`` subscriber of ``EvaluationEnded`` holds training until it answers;
    it answers only once the warning naming it was logged, so the warning came during the wait
    (within about a second of it), not after."""
    trainer = make_trainer(bus=EventBus(barrier_timeout=60))
    bus = trainer.bus
    order = Order(trainer)
    with capture_logs() as logs:

        def named() -> list[dict[str, Any]]:
            return [x for x in logs if x["event"] == "training_waits_for_subscriber"]

        async def judge(e: ev.EvaluationEnded) -> None:
            with anyio.fail_after(30):
                while not named():  # noqa: ASYNC110 (a log line, not an event)
                    await anyio.sleep(0.02)
            order.items.append((DONE, e.step))
            bus.send(cmd.StopTraining(reason="judged"))

        bus.subscribe_async(bus.stream(ev.EvaluationEnded), judge, name="judge", decides=True)
        result = await trainer.fit()

    # Its decision landed on the evaluation's step: training waited for it.
    assert (result.reason, result.steps) == ("stopped", 3)
    order.assert_order(("EvaluationEnded", 3), (DONE, 3), ("CommandApplied", 3))
    assert ("StepEnded", 4) not in order.items
    assert result.waited_s["judge"] >= 0.5  # at least until the warning (0.5 s into the wait)
    (warning,) = named()
    assert warning["log_level"] == "warning" and warning["subscription"] == "judge"
    assert "decides=True" in warning["reason"] and "decides=False" in warning["remedies"]
    assert not [x for x in logs if x["event"] == "barrier_timeout"]


@pytest.mark.asyncio
async def test_short_waits_on_a_decider_add_up_to_one_warning() -> None:
    """A decider answering each evaluation in 0.2 s: no single wait is long, but together they
    hold training, and it is named once (not at every barrier)."""
    trainer = make_trainer(
        eval_schedule=EvalSchedule(every_steps=1)
    )  # five evaluations, five barriers
    bus = trainer.bus

    async def judge(e: ev.EvaluationEnded) -> None:
        await anyio.sleep(0.2)

    bus.subscribe_async(bus.stream(ev.EvaluationEnded), judge, name="judge", decides=True)
    with capture_logs() as logs:
        result = await trainer.fit()
    assert result.reason == "completed" and result.steps == 5
    assert result.waited_s["judge"] >= 0.5  # five waits of about 0.2 s each
    (warning,) = [x for x in logs if x["event"] == "training_waits_for_subscriber"]
    assert warning["subscription"] == "judge"


# ------------------------------------------------------------------ a slow sync subscriber
POST_SYNC_S = 0.015


def _slow_sync_run(barriers: tuple[type[ev.BaseEvent], ...] | None, epochs: int) -> Any:
    """A user's sync logger that takes 15 ms per StepEnded (a blocking HTTP post, a file write)
    on 40 steps an epoch, slower than its events arrive; and a fast sync recorder."""
    model = tiny_model()
    bus = EventBus() if barriers is None else EventBus(barriers=barriers)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_loader(40),
                      loss_fn=F.cross_entropy, max_epochs=epochs, on_signal=None, bus=bus,
                      progress=False)  # fmt: skip
    posted: list[int] = []
    seen: list[int] = []

    def post(e: ev.StepEnded) -> None:
        time.sleep(POST_SYNC_S)
        posted.append(e.step)

    trainer.bus.subscribe(trainer.bus.stream(ev.StepEnded), post, name="post")
    trainer.bus.subscribe(
        trainer.bus.stream(ev.StepEnded), lambda e: seen.append(e.step), name="recorder"
    )
    with capture_logs() as logs:
        result = trainer.fit_sync()
    assert posted == seen == list(range(1, 40 * epochs + 1))  # nothing lost
    return result, [x for x in logs if x["event"] == "training_waits_for_subscriber"]


@pytest.mark.parametrize(
    ("barriers", "epochs"),
    [(None, 1), (None, 2), ((), 2), ((ev.StepEnded,), 1), ((ev.EpochEnded,), 1)],
)
def test_a_slow_sync_subscriber_that_holds_training_at_barriers_is_counted_and_named(
    barriers: tuple[type[ev.BaseEvent], ...] | None, epochs: int
) -> None:
    """Training outruns it; each barrier (an epoch's end, every step, or only the run's last)
    delivers its backlog while training waits: the seconds are its ``waited_s``, and the
    warning names it once, with the remedy. The fast recorder beside it is never charged."""
    result, warnings = _slow_sync_run(barriers, epochs)
    # 40 * epochs calls of at least 15 ms (0.6 s an epoch, over the warning's 0.5 s): training
    # waited for the part it did not overlap, at most all of it (sleeps overshoot: x2).
    calls_s = POST_SYNC_S * 40 * epochs
    assert calls_s / 2 < result.waited_s["post"] <= calls_s * 2
    assert "recorder" not in result.waited_s
    assert [w["subscription"] for w in warnings] == ["post"]
    assert "make it async def" in warnings[0]["remedies"]
    assert "sync subscriber" in warnings[0]["reason"]


def test_a_sync_subscriber_that_keeps_up_is_never_counted_nor_named() -> None:
    """A sync subscriber as fast as the delivery: the barriers find no backlog."""
    model = tiny_model()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_loader(40),
                      loss_fn=F.cross_entropy, max_epochs=3, on_signal=None, progress=False,
                      eval_data=tiny_loader(2, seed=1))  # fmt: skip
    seen: list[ev.BaseEvent] = []
    trainer.bus.events.subscribe(seen.append)
    with capture_logs() as logs:
        result = trainer.fit_sync()
    assert result.steps == 120 and len(seen) > 120
    assert result.waited_s == {}
    assert not [x for x in logs if x["event"] == "training_waits_for_subscriber"]

"""A slow async subscriber slows only itself, and nothing it loses goes unsaid.

The scenario users write: an ``async def`` subscriber posting every 20th ``StepEnded`` to a
real local HTTP service (stdlib ``ThreadingHTTPServer`` on 127.0.0.1, answering after 200 ms),
next to a fast sync subscriber and ``Checkpointing`` with the default barriers. Everything is
asserted structurally (counts, which subscription waited, what the server received), never on
wall-clock ratios: those are in ``benchmarks/slow_subscriber.py``.

The machines are noisy (a loaded runner trains slower than the service answers), so "the
subscriber is behind" is made structural: the service holds its answers behind a gate the test
opens at a known point (the end of the run, or the moment training first waits on it), then
answers each post after 200 ms.
"""

from __future__ import annotations

import json
import threading
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest
import torch
import torch.nn.functional as F
from reactivex import operators as ops
from structlog.testing import capture_logs

from trainbus import ConfigError, EvalSchedule, EventBus, LostWorkError, Trainer
from trainbus import events as ev
from trainbus.bus import LostWork
from trainbus.callbacks import Checkpointing
from trainbus.testing import tiny_loader, tiny_model

pytestmark = pytest.mark.timeout(120)

EPOCHS, BATCHES = 2, 100  # 200 optimizer steps: 10 posts, 2 EpochEnded barriers
STEPS = EPOCHS * BATCHES
POSTS = STEPS // 20
DELAY = 0.2  # the service answers after 200 ms


@dataclass
class Service:
    """A local HTTP service that answers each POST after ``DELAY`` and counts what arrived."""

    url: str
    arrived: list[int] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    gate: threading.Event = field(default_factory=threading.Event)
    """Answers wait for it (then DELAY more); open unless a test closes it."""


@pytest.fixture
def service() -> Iterator[Service]:
    box: list[Service] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            box[0].gate.wait(60)
            threading.Event().wait(DELAY)  # the slow part of a real service
            with box[0].lock:
                box[0].arrived.append(json.loads(body)["step"])
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:  # quiet test output
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    box.append(Service(url=f"http://127.0.0.1:{server.server_address[1]}/steps"))
    box[0].gate.set()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield box[0]
    finally:
        box[0].gate.set()
        server.shutdown()
        server.server_close()
        thread.join(5)


def _post(url: str, step: int) -> None:
    request = urllib.request.Request(url, data=json.dumps({"step": step}).encode(),
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=90) as response:
        response.read()


@dataclass
class Run:
    trainer: Trainer
    fast: list[int]
    """Steps the fast (sync) subscriber received, in order."""
    behind: list[int]
    """For each StepEnded the fast subscriber received: posts handed to the slow subscriber
    and not finished yet (its backlog at that moment)."""
    saved: list[int]
    """Steps of every CheckpointSaved."""


def _run(tmp_path: Path, service: Service, open_at: str = "fit_ended", **options: Any) -> Run:
    """Build the scenario: the slow poster (``subscribe_async`` with ``options``), a fast
    sync subscriber of every StepEnded, Checkpointing every 100 steps, default barriers.

    ``open_at``: when the service starts answering: ``"fit_ended"`` (every post is published
    while the first one is still unanswered) or ``"training_waits"`` (the first time the
    training thread waits on the poster)."""
    bus_options = {k: options.pop(k) for k in ("on_lost", "close_timeout") if k in options}
    service.gate.clear()
    model = tiny_model()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                      tiny_loader(BATCHES, batch_size=8), loss_fn=F.cross_entropy,
                      max_epochs=EPOCHS, checkpoint_dir=tmp_path / "ckpt", device="cpu",
                      callbacks=[Checkpointing(every_steps=100, every_epochs=None)],
                      bus=EventBus(barrier_timeout=10, **bus_options), on_signal=None,
                      progress=False)  # fmt: skip
    bus = trainer.bus

    async def poster(e: ev.StepEnded) -> None:
        await anyio.to_thread.run_sync(_post, service.url, e.step)

    every_20th = bus.stream(ev.StepEnded).pipe(ops.filter(lambda e: e.step % 20 == 0))
    slow = bus.subscribe_async(every_20th, poster, name="poster", **options)
    run = Run(trainer, [], [], [])

    def fast(e: ev.StepEnded) -> None:
        run.fast.append(e.step)
        s = slow.statistics()
        run.behind.append(s.received - s.completed - s.dropped - s.cancelled)

    bus.subscribe(bus.stream(ev.StepEnded), fast, name="fast")
    bus.subscribe(bus.stream(ev.CheckpointSaved), lambda e: run.saved.append(e.step))
    if open_at == "fit_ended":
        bus.subscribe(bus.stream(ev.FitEnded), lambda e: service.gate.set())
    else:

        def open_when_training_waits() -> None:
            while slow.statistics().waited_s == 0 and not service.gate.is_set():
                service.gate.wait(0.01)
            service.gate.set()

        threading.Thread(target=open_when_training_waits, daemon=True).start()
    return run


def _events(logs: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [x for x in logs if x["event"] == name]


def test_default_policy_never_holds_training_and_reports_what_it_dropped(
    tmp_path: Path, service: Service
) -> None:
    # A small buffer, the default policy; the service answers nothing before the run ends.
    run = _run(tmp_path, service, buffer=2)
    with capture_logs() as logs:
        result = run.trainer.fit_sync()

    assert result.reason == "completed" and result.steps == STEPS
    # The fast subscriber received every event, in order, while the slow one was behind.
    assert run.fast == list(range(1, STEPS + 1))
    assert run.behind[-1] == 3  # one in flight, a full buffer of two
    # Neither the EpochEnded barriers, the decision steps of Checkpointing, nor the last
    # barrier waited for it: training never waited on the poster.
    assert "poster" not in result.waited_s
    assert _events(logs, "training_waits_for_subscriber") == []
    assert run.saved == [100, 200]  # each save at its declared step
    # What it could not keep up with was dropped, and the run says so.
    lost = result.lost_work["poster"]
    assert lost == LostWork(dropped=POSTS - 3)  # all but the one in flight and the buffer
    assert sum(x.total for x in result.lost_work.values()) == POSTS - 3
    (warning,) = _events(logs, "bus_closed_with_lost_work")
    assert warning["lost_work"]["poster"]["dropped"] == lost.dropped
    # Everything not dropped was posted and arrived: the close waited for it.
    stats = next(s for s in result.statistics.subscriptions if s.name == "poster")
    assert stats.received == POSTS and stats.cancelled == 0
    assert sorted(service.arrived) == sorted(set(service.arrived))
    assert len(service.arrived) == stats.completed == POSTS - lost.dropped


def test_block_holds_training_says_so_and_loses_nothing(tmp_path: Path, service: Service) -> None:
    run = _run(tmp_path, service, "training_waits", buffer=2, overflow="block")
    with capture_logs() as logs:
        result = run.trainer.fit_sync()

    assert result.reason == "completed" and result.steps == STEPS
    # Lossless: every post arrived, in order (concurrency 1), nothing lost.
    assert service.arrived == list(range(20, STEPS + 1, 20))
    assert result.lost_work == {}
    assert _events(logs, "bus_closed_with_lost_work") == []
    # Training waited for it, was told, and the wait is counted.
    assert result.waited_s["poster"] > 0
    assert set(result.waited_s) == {"poster"}
    (warning,) = _events(logs, "training_waits_for_subscriber")
    assert warning["subscription"] == "poster" and warning["log_level"] == "warning"
    assert warning["received"] > warning["completed"]
    for remedy in ("buffer=", "concurrency=", "overflow=", "every_steps", "every_s"):
        assert remedy in warning["remedies"]
    # Delivery to the fast subscriber never waited for the poster's buffer.
    assert run.fast == list(range(1, STEPS + 1))
    assert run.saved == [100, 200]
    stats = next(s for s in result.statistics.subscriptions if s.name == "poster")
    assert stats.waited_s == result.waited_s["poster"]


def test_on_lost_raise_fails_the_run_after_delivery(tmp_path: Path, service: Service) -> None:
    run = _run(tmp_path, service, buffer=2, on_lost="raise")
    with pytest.raises(LostWorkError, match=r"poster: \d+ dropped, 0 cancelled, 0 failed") as info:
        run.trainer.fit_sync()
    result = run.trainer.result
    assert result is not None and info.value.result is result
    assert result.reason == "completed" and info.value.lost_work == dict(result.lost_work)
    # Posts were dropped (how many depends on when the poster's worker took its first one: the
    # exact count of a full buffer is test_default_policy_...'s) and nothing else was lost.
    dropped = result.lost_work["poster"].dropped
    assert result.lost_work["poster"] == LostWork(dropped=dropped) and 0 < dropped < POSTS
    assert run.fast == list(range(1, STEPS + 1))  # everything was delivered first
    # ...and the close waited for every post that was not dropped.
    assert len(service.arrived) == POSTS - dropped


def test_close_waits_for_every_post_by_default_and_says_so(
    tmp_path: Path, service: Service
) -> None:
    run = _run(tmp_path, service, buffer=POSTS)  # room for all: nothing dropped
    with capture_logs() as logs:
        result = run.trainer.fit_sync()
    assert result.reason == "completed" and result.lost_work == {}
    assert service.arrived == list(range(20, STEPS + 1, 20))  # every post arrived
    # The end of the run waited at the close, not at the last barrier nor the final save.
    assert "poster" not in result.waited_s
    (notice,) = _events(logs, "bus_close_waiting")  # the next would come 30 s later
    assert notice["log_level"] == "info" and notice["close_timeout"] == 300.0  # the first
    # Said once the wait lasted 1 s: what was still pending then (each post takes 200 ms).
    assert set(notice["pending"]) == {"poster"} and 0 < notice["pending"]["poster"] <= POSTS


def test_close_timeout_cancels_what_is_left_and_reports_it(
    tmp_path: Path, service: Service
) -> None:
    run = _run(tmp_path, service, buffer=POSTS, close_timeout=0.3)
    assert run.trainer.bus.close_timeout == 0.3
    with capture_logs() as logs:
        result = run.trainer.fit_sync()
    lost = result.lost_work["poster"]
    assert lost.cancelled > 0 and lost.dropped == lost.failed == 0
    assert len(service.arrived) + lost.cancelled == POSTS
    (warning,) = _events(logs, "bus_closed_with_lost_work")
    assert warning["lost_work"]["poster"]["cancelled"] == lost.cancelled


@pytest.mark.asyncio
async def test_cancel_pending_during_the_close_counts_cancelled(
    tmp_path: Path, service: Service
) -> None:
    run = _run(tmp_path, service, buffer=POSTS)
    bus = run.trainer.bus
    cancelled: dict[str, int] = {}
    with capture_logs() as logs:
        async with anyio.create_task_group() as tg:

            async def first_ctrl_c_during_close() -> None:
                while not _events(logs, "bus_close_waiting"):  # noqa: ASYNC110 (a log, not an event)
                    await anyio.sleep(0.01)
                cancelled.update(bus.cancel_pending())

            tg.start_soon(first_ctrl_c_during_close)
            result = await run.trainer.fit()
    assert result.reason == "completed"
    # Cancelled once the wait had lasted 1 s (the notice): what was pending then.
    assert set(cancelled) == {"poster"} and 0 < cancelled["poster"] <= POSTS
    # The post in flight ran in a worker thread, which cannot be interrupted: it may still
    # have finished (and arrived); everything else pending was cancelled and is reported.
    lost = result.lost_work["poster"]
    assert lost == LostWork(cancelled=lost.cancelled)
    assert cancelled["poster"] - 1 <= lost.cancelled <= cancelled["poster"]
    assert len(service.arrived) + lost.cancelled == POSTS
    assert _events(logs, "bus_pending_cancelled")[0]["cancelled"] == cancelled


@pytest.mark.parametrize("value", [-1, "10", float("nan"), True])
def test_close_timeout_is_checked_up_front(value: Any) -> None:
    model = tiny_model()
    with pytest.raises(ConfigError, match=r"^close_timeout="):
        Trainer(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            tiny_loader(1),
            loss_fn=F.cross_entropy,
            max_steps=1,
            bus=EventBus(close_timeout=value),
        )


def test_close_timeout_given_to_the_trainer_names_the_bus() -> None:
    model = tiny_model()
    with pytest.raises(TypeError, match=r"'close_timeout'.*bus=EventBus\(close_timeout=5\)"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_loader(1),  # type: ignore[call-arg]
                loss_fn=F.cross_entropy, max_steps=1, bus=EventBus(), close_timeout=5)  # fmt: skip


@pytest.mark.parametrize("value", ["ignore", None, True])
def test_on_lost_is_checked_up_front(value: Any) -> None:
    model = tiny_model()
    with pytest.raises(ConfigError, match=r"^on_lost="):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_loader(1),
                loss_fn=F.cross_entropy, max_steps=1, bus=EventBus(on_lost=value))  # fmt: skip


@pytest.mark.parametrize("value", ["log", "stop"])
def test_an_error_policy_given_as_on_lost_says_where_it_goes(value: str) -> None:
    with pytest.raises(ConfigError) as info:
        EventBus(on_lost=value)  # type: ignore[arg-type]
    message = str(info.value)
    assert message.startswith(f"on_lost={value!r} is invalid: 'warn'")
    assert f"{value!r} is an error policy: it goes in on_error=" in message
    EventBus(on_error=value, on_lost="warn")  # where it belongs, it is accepted


# ------------------------------------------------------------------ a bounded end
def test_the_end_of_a_call_waits_a_bounded_time_by_default() -> None:
    model = tiny_model()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_loader(1),
                      loss_fn=F.cross_entropy, max_steps=1)  # fmt: skip
    assert trainer.bus.close_timeout == EventBus().close_timeout == 300.0


@pytest.mark.parametrize("on_lost", ["warn", "raise"])
def test_a_subscriber_that_never_returns_is_said_again_then_cancelled_and_reported(
    on_lost: str,
) -> None:
    """An upload awaiting a call that never returns (an HTTP client without a timeout): the
    end of ``fit()`` says what it waits for, again and again while it waits, cancels it at
    ``close_timeout`` and reports it; ``on_lost="raise"`` fails the run."""
    model = tiny_model()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_loader(4),
                      loss_fn=F.cross_entropy, max_epochs=1, device="cpu", progress=False,
                      on_signal=None, bus=EventBus(close_timeout=0.6, on_lost=on_lost))  # fmt: skip
    started: list[int] = []
    never = anyio.Event()  # never set

    async def upload(e: ev.StepEnded) -> None:
        started.append(e.step)
        await never.wait()

    trainer.bus.subscribe_async(trainer.bus.stream(ev.StepEnded), upload, name="upload",
                                buffer=8)  # fmt: skip
    with capture_logs() as logs:
        if on_lost == "raise":
            with pytest.raises(LostWorkError, match=r"upload: 0 dropped, 4 cancelled, 0 failed"):
                trainer.fit_sync()
        else:
            trainer.fit_sync()
    result = trainer.result
    assert result is not None and result.reason == "completed" and result.steps == 4
    # Training never waited for it; the end of the call did, then cancelled it: the item in
    # flight and the three behind it.
    assert started == [1] and "upload" not in result.waited_s
    assert result.lost_work == {"upload": LostWork(cancelled=4)}
    (lost,) = _events(logs, "bus_closed_with_lost_work")
    assert lost["lost_work"]["upload"] == {"dropped": 0, "cancelled": 4, "failed": 0}
    # Said more than once while it waited (every tenth of close_timeout), each time naming
    # what was pending, how long it had waited and that it would cancel.
    notices = _events(logs, "bus_close_waiting")
    assert len(notices) >= 2, notices
    # The first is said (info), a wait that lasts is warned about.
    assert [n["log_level"] for n in notices] == ["info"] + ["warning"] * (len(notices) - 1)
    for notice in notices:
        assert notice["pending"] == {"upload": 4}
        assert notice["close_timeout"] == 0.6 and "then cancelling" in notice["action"]
    waited = [notice["waited_s"] for notice in notices]
    assert waited == sorted(waited) and len(set(waited)) == len(waited)
    # Every notice came before the cancel was reported.
    assert logs.index(notices[-1]) < logs.index(lost)


def test_a_metrics_poster_over_http_never_holds_training_while_best_and_stopping_decide(
    tmp_path: Path, service: Service
) -> None:
    """The HF-style job: a poster of ``MetricsLogged`` + ``EvaluationEnded`` (log_every=1) to a
    real HTTP service that answers nothing before the run ends, beside ``Checkpointing``
    choosing the best and ``EarlyStopping``, default barriers. The deciders decide at each
    evaluation's own step; the poster, stuck for the whole run, never made training wait (a
    loop waiting for it at a barrier would count ``barrier_timeout`` there)."""
    from trainbus.callbacks import EarlyStopping

    service.gate.clear()
    model = tiny_model()
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        tiny_loader(20),
        loss_fn=F.cross_entropy,
        eval_data=tiny_loader(1, seed=1),
        eval_schedule=EvalSchedule(every_steps=5, epoch_end=False),
        max_epochs=1,
        log_every=1,
        device="cpu",
        checkpoint_dir=tmp_path / "ckpt",
        bus=EventBus(barrier_timeout=10),
        progress=False,
        on_signal=None,
        callbacks=[
            Checkpointing(every_epochs=None, monitor="val_loss"),
            EarlyStopping("val_loss", patience=2),
        ],
    )
    bus = trainer.bus

    async def post(e: ev.BaseEvent) -> None:
        await anyio.to_thread.run_sync(_post, service.url, e.step)

    bus.subscribe_async(bus.stream(ev.MetricsLogged, ev.EvaluationEnded), post, name="poster",
                        concurrency=4)  # fmt: skip
    evaluations: list[tuple[int, float]] = []
    best: list[int] = []
    bus.subscribe(bus.stream(ev.EvaluationEnded),
                  lambda e: evaluations.append((e.step, e.metrics["val_loss"])))  # fmt: skip
    bus.subscribe(bus.stream(ev.CheckpointSaved),
                  lambda e: best.append(e.step) if e.tag == "best" else None)  # fmt: skip
    bus.subscribe(bus.stream(ev.FitEnded), lambda e: service.gate.set())
    with capture_logs() as logs:
        result = trainer.fit_sync()

    assert result.steps in (20, *(step for step, _ in evaluations))
    # Every post arrived (the close waited for them), none while training ran.
    assert len(service.arrived) == result.steps + len(evaluations) and result.lost_work == {}
    # Training never waited for the poster, nor for anything else; nothing was said.
    assert result.waited_s == {}
    assert _events(logs, "barrier_timeout") == _events(logs, "training_waits_for_subscriber") == []
    # The best checkpoint was written at each improving evaluation's own step.
    improving, low = [], float("inf")
    for step, loss in evaluations:
        if loss < low:
            improving.append(step)
            low = loss
    assert best == improving and best


def test_a_dropping_subscriber_says_so_at_its_first_drop() -> None:
    # A poster of every step, slower than training, with the default overflow: it drops, and
    # says so when it starts to (once), not only in the end's lost-work report. A "latest"
    # subscription drops by design and says nothing.
    model = tiny_model()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_loader(12),
                      loss_fn=F.cross_entropy, max_steps=12, progress=False,
                      on_signal=None, attach=False)  # fmt: skip
    ended = threading.Event()
    bus = trainer.bus
    bus.stream(ev.FitEnded).subscribe(lambda _: ended.set())

    async def post(e: ev.StepEnded) -> None:  # held until the run has ended
        while not ended.is_set():  # noqa: ASYNC110
            await anyio.sleep(0.001)

    bus.subscribe_async(bus.stream(ev.StepEnded), post, buffer=2, name="poster")
    bus.subscribe_async(bus.stream(ev.StepEnded), post, overflow="latest", name="dashboard")
    with capture_logs() as logs:
        result = trainer.fit_sync()
    assert (
        result.steps == 12 and result.lost_work["poster"].dropped >= 9
    )  # 12 - 2 - (0 or 1) running
    (said,) = [x for x in logs if x["event"] == "subscriber_dropping"]
    assert said["subscription"] == "poster" and said["buffer"] == 2
    # Counts, not rates over the microseconds before the first drop: 2 waiting, 0 or 1 running.
    assert said["received"] in (3, 4) and said["completed"] == 0
    assert "rate_per_s" not in said and "events_per_s" not in said
    assert "overflow='block'" in said["remedies"]
    assert said["log_level"] == "warning"

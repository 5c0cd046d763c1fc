"""The bus rings its doorbell after every change the training loop must act on between steps
(a stretch of ordinary steps reads nothing else), and for nothing else."""

from __future__ import annotations

import sys
import threading

from trainbus import EventBus
from trainbus import commands as cmd
from trainbus import events as ev
from trainbus._bus.commands import Doorbell


def test_rings_from_many_threads_all_count() -> None:
    bell = Doorbell()
    start = threading.Barrier(4)
    old_interval = sys.getswitchinterval()

    def ring_many() -> None:
        start.wait()  # all four ring at once
        for _ in range(20_000):
            bell.ring()

    threads = [threading.Thread(target=ring_many) for _ in range(4)]
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter allows
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old_interval)
    # Exact: every ring adds one under the bell's lock. (A ring that read, yielded the thread
    # and wrote back, as an unlocked += may on other interpreters, loses thousands here.)
    assert bell.rings == 4 * 20_000


def test_a_subscription_coming_and_going_rings() -> None:
    bus = EventBus()
    before = bus.port().doorbell.rings
    sub = bus.stream(ev.StepEnded).subscribe(lambda e: None)
    after_subscribe = bus.port().doorbell.rings
    sub.dispose()
    assert before < after_subscribe < bus.port().doorbell.rings


def test_a_decision_schedule_rings() -> None:
    bus = EventBus()
    before = bus.port().doorbell.rings
    declared = bus.declare_decision_steps(every=5)
    declared_at = bus.port().doorbell.rings
    declared.dispose()
    assert before < declared_at < bus.port().doorbell.rings


def test_a_command_rings_after_it_is_queued() -> None:
    bus = EventBus()
    heard: list[bool] = []
    before = bus.port().doorbell.rings
    bus.send(cmd.StopTraining(reason="test"))
    heard.append(bus.port().has_commands())
    assert bus.port().doorbell.rings == before + 1 and heard == [True]


def test_a_raise_failure_rings_and_a_logged_one_does_not() -> None:
    bus = EventBus()

    def boom(e: ev.BaseEvent) -> None:
        raise RuntimeError("boom")

    bus.stream(ev.StepEnded).subscribe(boom, on_error="log")
    logged = bus.port().doorbell.rings
    bus.publish(ev.StepEnded(step=1, epoch=0, loss=1.0, lr=0.1, grad_norm=None, samples=1,
                             data_wait_s=0.0, duration_s=0.0))  # fmt: skip
    bus.flush()
    assert bus.port().doorbell.rings == logged and bus.port().failure is None
    bus.stream(ev.EpochEnded).subscribe(boom, on_error="raise")
    raised = bus.port().doorbell.rings
    bus.publish(ev.EpochEnded(step=1, epoch=0, batches=1))
    bus.flush()
    assert bus.port().failure is not None and bus.port().doorbell.rings == raised + 1


def test_publishing_does_not_ring() -> None:
    bus = EventBus()
    bus.stream(ev.EpochEnded).subscribe(lambda e: None)
    before = bus.port().doorbell.rings
    for step in range(10):
        bus.publish(ev.EpochEnded(step=step, epoch=0, batches=1))
    bus.flush()
    assert bus.port().doorbell.rings == before

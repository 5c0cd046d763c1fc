"""Monitors: gradient norm, optimizer statistics, memory, runtime estimate (real runs)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from trainbus import ConfigError, EventBus
from trainbus import events as ev
from trainbus.callbacks import (
    GradientNormMonitor,
    MemoryMonitor,
    OptimizerMonitor,
    RuntimeEstimator,
)
from trainbus.callbacks._monitors import read_rss, total_grad_norm
from trainbus.testing import EventRecorder, VirtualTimeScheduler


@pytest.mark.parametrize(
    ("build", "name"),
    [
        (lambda: GradientNormMonitor(0), "every"),
        (lambda: GradientNormMonitor(2.5), "every"),  # type: ignore[arg-type]
        (lambda: GradientNormMonitor(norm_type=0), "norm_type"),
        (lambda: GradientNormMonitor(norm_type="l2"), "norm_type"),  # type: ignore[arg-type]
        (lambda: OptimizerMonitor(every=-1), "every"),
        (lambda: MemoryMonitor(every=True), "every"),  # type: ignore[arg-type]
        (lambda: RuntimeEstimator(every_s=0), "every_s"),
        (lambda: RuntimeEstimator(window=1), "window"),
    ],
)
def test_invalid_options_fail_at_construction(build: Any, name: str) -> None:
    with pytest.raises(ConfigError, match=f"^{name}="):
        build()


def test_gradient_norm_is_measured_on_sampled_steps_as_a_device_tensor(
    trainer_factory: Any,
) -> None:
    trainer = trainer_factory([GradientNormMonitor(every=3)], epochs=2, batches=4)
    rec = EventRecorder(trainer.bus, trainer.bus.stream(ev.GradientNormMeasured))
    expected: dict[int, float] = {}

    def reference(ctx: Any) -> None:  # the same norm, computed independently (user tier: after)
        if (ctx.step + 1) % 3 == 0:
            grads = [p.grad.flatten() for p in ctx.model.parameters()]
            expected[ctx.step] = float(torch.cat(grads).norm())

    trainer.add_hook("before_optimizer_step", reference)
    trainer.fit_sync()
    events = rec.items
    assert [e.step for e in events] == [2, 5]  # updates that end steps 3 and 6
    for e in events:
        assert isinstance(e.grad_norm, torch.Tensor) and not e.grad_norm.requires_grad
        assert float(e.grad_norm) == pytest.approx(expected[e.step], rel=1e-5)


def test_gradient_norm_costs_nothing_without_a_subscriber(trainer_factory: Any) -> None:
    monitor = GradientNormMonitor(every=1)
    trainer = trainer_factory([monitor], epochs=1, batches=2)
    published: list[ev.BaseEvent] = []
    real_publish = trainer.bus.publish

    def spy(event: ev.BaseEvent) -> None:
        published.append(event)
        real_publish(event)

    trainer.bus.publish = spy  # type: ignore[method-assign]
    trainer.fit_sync()
    assert not any(isinstance(e, ev.GradientNormMeasured) for e in published)


def test_total_grad_norm_matches_clipping() -> None:
    model = torch.nn.Linear(4, 3)
    model(torch.randn(5, 4)).pow(2).sum().backward()
    for norm_type in (1.0, 2.0, math.inf):
        clipped = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9, norm_type)
        got = total_grad_norm(model.parameters(), norm_type)
        assert got is not None and float(got) == pytest.approx(float(clipped), rel=1e-6)
    assert total_grad_norm(torch.nn.Linear(2, 2).parameters()) is None


def test_optimizer_stats_per_group() -> None:
    import torch.nn.functional as F

    from trainbus import Trainer
    from trainbus.testing import tiny_loader, tiny_model

    model = tiny_model()
    first, second = model[0], model[2]
    opt = torch.optim.AdamW(
        [{"params": first.parameters()}, {"params": second.parameters(), "lr": 0.01}],
        lr=0.001, betas=(0.8, 0.95), weight_decay=0.1,
    )  # fmt: skip
    trainer = Trainer(model, opt, tiny_loader(4), loss_fn=F.cross_entropy, max_epochs=1,
                      on_signal=None, callbacks=[OptimizerMonitor(every=2)])  # fmt: skip
    rec = EventRecorder(trainer.bus, trainer.bus.stream(ev.OptimizerStatsMeasured))
    trainer.fit_sync()
    assert [e.step for e in rec.items] == [2, 4]
    e = rec.items[0]
    assert dict(e.lr_by_group) == {"group0": 0.001, "group1": 0.01}
    assert dict(e.momentum_by_group) == {"group0": 0.8, "group1": 0.8}
    assert dict(e.beta2_by_group) == {"group0": 0.95, "group1": 0.95}
    assert dict(e.weight_decay_by_group) == {"group0": 0.1, "group1": 0.1}


def test_optimizer_stats_follow_lr_changes_sgd(trainer_factory: Any) -> None:
    trainer = trainer_factory([OptimizerMonitor(every=1)], epochs=1, batches=2, lr=0.2)
    rec = EventRecorder(trainer.bus, trainer.bus.stream(ev.OptimizerStatsMeasured))
    trainer.fit_sync()
    assert [dict(e.lr_by_group) for e in rec.items] == [{"group0": 0.2}] * 2
    assert dict(rec.items[0].momentum_by_group) == {"group0": 0.0}
    assert dict(rec.items[0].beta2_by_group) == {}  # SGD has no betas


def test_memory_is_published_every_n_steps(trainer_factory: Any) -> None:
    monitor = MemoryMonitor(every=2)
    trainer = trainer_factory([monitor], epochs=1, batches=4, device="cpu")
    rec = EventRecorder(trainer.bus, trainer.bus.stream(ev.MemoryMeasured))
    trainer.fit_sync()
    assert [e.step for e in rec.items] == [2, 4]
    _, source = read_rss()
    for e in rec.items:
        assert e.rss_source == source and e.rss_bytes is not None and e.rss_bytes > 1 << 20
        assert e.device == "cpu" and e.cuda_allocated_bytes is None  # CPU run: no CUDA figures
    assert monitor.last is rec.items[-1]


def test_the_memory_monitor_alone_has_step_ended_built_only_at_its_steps(
    trainer_factory: Any,
) -> None:
    # Its stream is sampled by the bus (every_steps): the loop builds StepEnded at steps 10, 20
    # and 30 only, not at each of the 30 steps.
    trainer = trainer_factory([MemoryMonitor(every=10)], epochs=1, batches=30)
    rec = EventRecorder(trainer.bus, trainer.bus.stream(ev.MemoryMeasured))
    result = trainer.fit_sync()
    assert [e.step for e in rec.items] == [10, 20, 30]
    # 3 StepEnded, 3 MemoryMeasured and a handful of run and epoch events: not 30 StepEnded.
    assert result.statistics.published < 30, result.statistics.published


def test_rss_fallbacks(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "psutil", None)  # not installed
    rss, source = read_rss()
    assert source in ("statm", "resource") and rss is not None and rss > 0


def test_runtime_estimate_in_virtual_time(
    vbus: EventBus, vts: VirtualTimeScheduler, step_event: Any
) -> None:
    est = RuntimeEstimator(every_s=1.0)
    est.setup(vbus)
    rec = EventRecorder(vbus, vbus.stream(ev.RuntimeEstimated))
    vbus.publish(ev.FitStarted(step=0, epoch=0, max_steps=None, max_epochs=2, device="cpu",
                               time=100.0))  # fmt: skip
    vbus.publish(ev.EpochStarted(step=0, epoch=0, time=100.0))
    for i in range(1, 6):  # 2 steps per second
        vbus.publish(step_event(i, time=100.0 + i / 2, duration_s=0.5))
    vbus.flush()
    vbus.flush()  # deliver what the estimator published
    first = rec.items[0]
    assert first.step == 1 and first.remaining_s is None and first.total_steps is None
    assert first.steps_per_s == pytest.approx(2.0) and first.elapsed_s == pytest.approx(0.5)
    vbus.publish(ev.EpochEnded(step=5, epoch=0, batches=5, time=102.5))  # total: 10 steps
    vts.advance_by(1.0)
    vbus.publish(step_event(6, time=103.0, duration_s=0.5))
    vbus.flush()
    vbus.flush()
    last = rec.items[-1]
    assert last.step == 6 and last.total_steps == 10
    assert last.steps_per_s == pytest.approx(2.0)
    assert last.remaining_s == pytest.approx(2.0) and last.elapsed_s == pytest.approx(3.0)
    assert last.eta is not None and est.last is last


def test_runtime_estimate_in_a_run(trainer_factory: Any) -> None:
    trainer = trainer_factory([RuntimeEstimator(every_s=1e-6)], epochs=1, batches=4, max_steps=4)
    rec = EventRecorder(trainer.bus, trainer.bus.stream(ev.RuntimeEstimated))
    trainer.fit_sync()
    assert rec.items and all(e.total_steps == 4 for e in rec.items)
    assert all(e.remaining_s is not None and e.steps_per_s > 0 for e in rec.items)

"""Shared fixtures: event factories, a virtual-time bus, and a condition waiter.

Async tests run on asyncio through pytest-asyncio (strict mode, ``@pytest.mark.asyncio``); the
trio backend is exercised from plain sync tests with ``anyio.run(main, backend="trio")``.
"""

from __future__ import annotations

import dataclasses
import signal
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Any

import anyio
import pytest

from trainbus import EventBus
from trainbus import commands as cmd
from trainbus import events as ev
from trainbus.testing import VirtualTimeScheduler

# The tests that signal a training process expect it to take SIGINT, as a terminal's
# foreground job does. A suite started as a script's background job (`make test &`, or a CI
# runner that does the same) inherits SIGINT ignored, and a run leaves an ignored signal
# ignored (docs/trainer.md, "Signals"): give this process a handler, so that every process the
# tests start begins with SIGINT at its default, whatever started the suite.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# A value for every required field of every event class, by field name. A new event class with a
# new required field makes ``make_event`` raise KeyError: extend this table (and the tests).
FIELD_VALUES: Mapping[str, Any] = {
    "step": 1,
    "epoch": 0,
    "max_steps": None,
    "max_epochs": None,
    "device": "cpu",
    "reason": "completed",
    "batches": 3,
    "phase": "train",
    "batch_index": 0,
    "data_wait_s": 0.0,
    "loss": 1.0,
    "micro_batch": 0,
    "accumulation_steps": 1,
    "grad_norm": None,
    "lr": 0.1,
    "samples": 32,
    "duration_s": 0.01,
    "trigger": "epoch",
    "path": "runs/step-1.pt",
    "checkpoint": "runs/step-1.pt",
    "metrics": {"val_loss": 1.0},
    "command": cmd.StopTraining(reason="test"),
    "datasets": ("val",),
    "outputs": 1.0,
    "attempt": 2,
    # kit monitors
    "norm_type": 2.0,
    "lr_by_group": {"group0": 0.1},
    "rss_bytes": 1 << 20,
    "elapsed_s": 1.0,
    "remaining_s": 2.0,
    "eta": 0.0,
    "steps_per_s": 10.0,
    "span": "forward",
    "started": 1.0,
    "ended": 1.5,
}


def build_event(cls: type[ev.BaseEvent], **overrides: Any) -> ev.BaseEvent:
    """An instance of ``cls`` with every required field filled (``overrides`` win)."""
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in overrides:
            kwargs[f.name] = overrides[f.name]
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            kwargs[f.name] = FIELD_VALUES[f.name]
    return cls(**kwargs)


def build_step(i: int, **overrides: Any) -> ev.StepEnded:
    """``StepEnded`` number ``i`` (``step=i``, ``loss=float(i)``)."""
    fields: dict[str, Any] = {
        "step": i,
        "epoch": 0,
        "loss": float(i),
        "lr": 0.1,
        "grad_norm": None,
        "samples": 32,
        "duration_s": 0.01,
    }
    fields.update(overrides)
    return ev.StepEnded(**fields)


def build_eval(metrics: Mapping[str, float], step: int = 0, **overrides: Any) -> ev.EvaluationEnded:
    """``EvaluationEnded`` carrying ``metrics``."""
    return ev.EvaluationEnded(step=step, epoch=0, metrics=metrics, **overrides)


@pytest.fixture
def make_event() -> Callable[..., ev.BaseEvent]:
    """Factory: ``make_event(ev.CheckpointSaved, path="x.pt")``."""
    return build_event


@pytest.fixture
def step_event() -> Callable[..., ev.StepEnded]:
    """Factory: ``step_event(i)`` builds ``ev.StepEnded(step=i, ...)``."""
    return build_step


@pytest.fixture
def eval_event() -> Callable[..., ev.EvaluationEnded]:
    """Factory: ``eval_event({"val_loss": 0.5}, step=3)``."""
    return build_eval


@pytest.fixture
def vts() -> VirtualTimeScheduler:
    """A fresh virtual-time scheduler (seconds from 0)."""
    return VirtualTimeScheduler()


@pytest.fixture
def vbus(vts: VirtualTimeScheduler) -> EventBus:
    """A bus on virtual time: ``publish`` + ``bus.flush()`` + ``vts.advance_by(s)``."""
    return EventBus(rx_scheduler=vts)


async def until(condition: Callable[[], bool], *, limit_s: float = 10.0) -> None:
    """Yield to the event loop until ``condition()`` holds; fail after ``limit_s`` (a deadlock
    guard, not a timer).

    Tests use it to wait for a state the bus reaches asynchronously (the poller has dispatched,
    a worker picked an item), never to measure time. Polling, because most of these states
    (counters in ``statistics()``) have no event to await.
    """
    with anyio.fail_after(limit_s):
        while not condition():  # noqa: ASYNC110
            await anyio.sleep(0.001)


@pytest.fixture
def wait_until() -> Callable[..., Awaitable[None]]:
    """``await wait_until(lambda: cond)``: see :func:`until`."""
    return until


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``cuda`` run only where a CUDA GPU is available (skipped elsewhere)."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture
def cpu_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Child processes started by the test see no GPU (``CUDA_VISIBLE_DEVICES=""``): tests that
    start 2 torchrun ranks on localhost mean gloo ranks on the CPU. On a host with one GPU, rank 1
    would otherwise default to ``cuda:1`` (a ``ConfigError``, tests/distributed/test_group.py
    pins it) and FSDP2 to a CUDA mesh. This process is not affected: it read the visible devices
    when collection asked ``torch.cuda.is_available()``."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Two pretend GPUs (``tests/_fake_cuda.py``): ``torch.cuda`` patched for this test."""
    from tests._fake_cuda import FakeCuda

    return FakeCuda(monkeypatch)


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[Any]:
    """One local Ray for the session (``num_cpus=2``: Ray Train's 2 workers of 1 CPU each, no
    dashboard), shut down at its end; skipped when the ``ray`` extra is not installed."""
    pytest.importorskip(
        "ray.train.torch", reason="Ray Train is missing: pip install 'trainbus[ray]'"
    )
    import os

    import ray

    # The workers import this checkout's trainbus (the driver's sys.path is not theirs).
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    path = os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))
    # A report collective a rank never joins fails in a minute instead of hanging.
    env = {"PYTHONPATH": path, "RAY_TRAIN_COLLECTIVE_TIMEOUT_S": "60"}
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": env})
    try:
        yield ray
    finally:
        ray.shutdown()

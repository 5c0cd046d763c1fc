"""Monitors: measurements published as events or logged, sampled so the training thread pays
for them only on the steps they are taken (gradient norm, optimizer hyper-parameters, memory,
throughput)."""

from __future__ import annotations

import os
import sys
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal

import structlog
import torch
from reactivex import operators as ops

from .. import events as ev
from .._exceptions import ConfigError
from .._tensors import is_dtensor, is_sharded_model, plain_value
from .._validate import check_bool, check_int, check_seconds
from ._base import Callback

if TYPE_CHECKING:
    from .._bus import EventBus
    from .._hookpoints import StepContext

__all__ = [
    "GradientNormMonitor",
    "MemoryMonitor",
    "OptimizerMonitor",
    "Throughput",
    "ThroughputMonitor",
    "optimizer_stats",
    "read_rss",
    "total_grad_norm",
]


def total_grad_norm(parameters: object, norm_type: float = 2.0) -> torch.Tensor | None:
    """The total gradient norm (as clipping computes it), a detached 0-dim tensor; None without
    gradients. A collective for sharded (DTensor) gradients."""
    grads = [p.grad.detach() for p in parameters if p.grad is not None]  # type: ignore[attr-defined]
    if not grads:
        return None
    if any(is_dtensor(g) for g in grads):
        # torch's own total norm reduces the DTensor shards' norms.
        return plain_value(torch.nn.utils.get_total_norm(grads, norm_type))
    norms = torch.stack([torch.linalg.vector_norm(g, norm_type) for g in grads])
    total: torch.Tensor = torch.linalg.vector_norm(norms, norm_type)
    return total


class GradientNormMonitor(Callback):
    """Publishes ``GradientNormMeasured`` with the total gradient norm (before clipping, a
    device tensor) every ``every`` steps, while some subscriber wants it. See
    docs/callbacks/gradient-norm.md.

    Args:
        every: Measure the steps ``every``, ``2 * every``, ... (>= 1).
        norm_type: The norm's order (> 0, ``math.inf`` for the max norm).

    Raises:
        ConfigError: ``every`` is not an int >= 1, or ``norm_type`` not a positive number.
    """

    def __init__(self, every: int = 50, *, norm_type: float = 2.0) -> None:
        self.every = check_int("every", every, 1)
        if isinstance(norm_type, bool) or not isinstance(norm_type, int | float) or norm_type <= 0:
            raise ConfigError.invalid("norm_type", norm_type, "a number > 0 or math.inf")
        self.norm_type = float(norm_type)
        self._bus: EventBus | None = None

    def setup(self, bus: EventBus) -> None:
        """Keep the bus the hook publishes on."""
        self._bus = bus

    def hook_before_optimizer_step(self, ctx: StepContext) -> None:
        """On sampled steps, measure the gradients and publish ``GradientNormMeasured``."""
        bus = self._bus
        # ctx.step counts completed steps: this update ends step ctx.step + 1.
        if bus is None or (ctx.step + 1) % self.every:
            return
        wanted = bus.wants(ev.GradientNormMeasured)
        # The same on every rank (the model's sharding), so the collective runs on all or none.
        if not wanted and not is_sharded_model(ctx.model):
            return
        norm = total_grad_norm(ctx.model.parameters(), self.norm_type)
        if norm is not None and wanted:
            bus.publish(
                ev.GradientNormMeasured(
                    step=ctx.step, epoch=ctx.epoch, grad_norm=norm, norm_type=self.norm_type
                )
            )


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    try:
        # A tensor hyper-parameter (capturable optimizers): on CUDA this read waits for it.
        return float(value)
    except (TypeError, ValueError, RuntimeError):
        return None


def optimizer_stats(
    param_groups: list[dict[str, Any]], *, step: int, epoch: int
) -> ev.OptimizerStatsMeasured:
    """``OptimizerStatsMeasured`` of ``param_groups`` (docs/callbacks/optimizer-monitor.md)."""
    stats: dict[str, dict[str, float]] = {"lr": {}, "momentum": {}, "beta2": {}, "weight_decay": {}}
    for i, group in enumerate(param_groups):
        betas = group.get("betas") or (group.get("momentum"), None)
        values = (group.get("lr"), betas[0], betas[1], group.get("weight_decay"))
        for name, raw in zip(stats, values, strict=True):
            if (number := _number(raw)) is not None:
                stats[name][f"group{i}"] = number
    return ev.OptimizerStatsMeasured(
        step=step,
        epoch=epoch,
        lr_by_group=stats["lr"],
        momentum_by_group=stats["momentum"],
        beta2_by_group=stats["beta2"],
        weight_decay_by_group=stats["weight_decay"],
    )


class OptimizerMonitor(Callback):
    """Publishes ``OptimizerStatsMeasured`` (per-group LR, momentum/betas, weight decay) every
    ``every`` steps, while some subscriber wants it.

    Args:
        every: Sample the steps ``every``, ``2 * every``, ... (>= 1).

    Raises:
        ConfigError: ``every`` is not an int >= 1.
    """

    def __init__(self, every: int = 50) -> None:
        self.every = check_int("every", every, 1)
        self._bus: EventBus | None = None

    def setup(self, bus: EventBus) -> None:
        """Keep the bus the hook publishes on."""
        self._bus = bus

    def hook_after_optimizer_step(self, ctx: StepContext) -> None:
        """On sampled steps, publish the optimizer's hyper-parameters."""
        bus = self._bus
        if bus is None or ctx.step % self.every or not bus.wants(ev.OptimizerStatsMeasured):
            return
        bus.publish(optimizer_stats(ctx.optimizer.param_groups, step=ctx.step, epoch=ctx.epoch))


RssSource = Literal["psutil", "statm", "resource"]


def read_rss() -> tuple[int | None, RssSource | None]:
    """The process' RSS in bytes and its source (docs/callbacks/memory-monitor.md), or
    ``(None, None)``."""
    try:
        import psutil  # type: ignore[import-untyped,unused-ignore]
    except ImportError:
        pass
    else:
        return int(psutil.Process().memory_info().rss), "psutil"
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            resident_pages = int(f.read().split()[1])
        return resident_pages * os.sysconf("SC_PAGE_SIZE"), "statm"
    except (OSError, ValueError, IndexError, AttributeError):
        pass
    try:
        import resource
    except ImportError:
        return None, None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # ru_maxrss is in bytes on macOS, in kibibytes on the other platforms.
    return int(peak if sys.platform == "darwin" else peak * 1024), "resource"


class MemoryMonitor(Callback):
    """Publishes ``MemoryMeasured`` (the RSS and, on CUDA, the allocator's bytes) every
    ``every`` steps, from the event-loop thread. See docs/callbacks/memory-monitor.md.

    Args:
        every: Sample on the steps ``every``, ``2 * every``, ... (>= 1).

    Attributes:
        last: The last ``MemoryMeasured`` published (None before the first).

    Raises:
        ConfigError: ``every`` is not an int >= 1.
    """

    def __init__(self, every: int = 50) -> None:
        self.every = check_int("every", every, 1)
        self.last: ev.MemoryMeasured | None = None

    def setup(self, bus: EventBus) -> None:
        """Subscribe the sampling pipeline."""
        device = ["cpu"]

        def started(e: ev.FitStarted) -> None:
            device[0] = e.device

        def sample(e: ev.StepEnded) -> None:
            rss, source = read_rss()
            cuda = device[0].startswith("cuda") and torch.cuda.is_available()
            # Host-side allocator counters: no device sync.
            self.last = ev.MemoryMeasured(
                step=e.step,
                epoch=e.epoch,
                rss_bytes=rss,
                rss_source=source,
                device=device[0],
                cuda_allocated_bytes=torch.cuda.memory_allocated(device[0]) if cuda else None,
                cuda_reserved_bytes=torch.cuda.memory_reserved(device[0]) if cuda else None,
                cuda_peak_bytes=torch.cuda.max_memory_allocated(device[0]) if cuda else None,
            )
            bus.publish(self.last)

        bus.stream(ev.FitStarted).subscribe(started, name="MemoryMonitor.fit_started")
        bus.stream(ev.StepEnded, every_steps=self.every).subscribe(sample, name="MemoryMonitor")


@dataclass(frozen=True, slots=True, kw_only=True)
class Throughput:
    """The figures of one window."""

    step: int
    """Step of the window's last ``StepEnded``."""
    epoch: int
    steps: int
    """Optimizer steps that ended in the window."""
    samples: int
    elapsed_s: float
    """Wall time from the previous window's last step end (the first window: from its first
    step's start) to this window's last step end."""
    steps_per_s: float
    samples_per_s: float
    data_wait_s: float
    """Mean seconds a step waited for the data iterable (``StepEnded.data_wait_s``)."""
    data_wait_fraction: float
    """Share of the steps' own time spent waiting for data (above a few percent: the loader is
    the bottleneck)."""


class _Meter:
    """A window of ``StepEnded`` -> :class:`Throughput` (None for an empty one)."""

    def __init__(self) -> None:
        self.last_end: float | None = None

    def __call__(self, window: list[Any]) -> Throughput | None:
        steps: list[ev.StepEnded] = window
        if not steps:
            return None  # nothing trained (an evaluation, or the run is over): no figures
        first, last = steps[0], steps[-1]
        start = self.last_end if self.last_end is not None else first.time - first.duration_s
        self.last_end = last.time
        elapsed = last.time - start
        if elapsed <= 0:  # coarse clock: fall back on the steps' own durations
            elapsed = sum(e.duration_s for e in steps)
        elapsed = max(elapsed, 1e-9)
        samples = sum(e.samples for e in steps)
        wait = sum(e.data_wait_s for e in steps)
        busy = sum(e.duration_s for e in steps)
        return Throughput(
            step=last.step,
            epoch=last.epoch,
            steps=len(steps),
            samples=samples,
            elapsed_s=elapsed,
            steps_per_s=len(steps) / elapsed,
            samples_per_s=samples / elapsed,
            data_wait_s=wait / len(steps),
            data_wait_fraction=wait / busy if busy > 0 else 0.0,
        )


class ThroughputMonitor(Callback):
    """Logs training throughput (a ``"throughput"`` line of :class:`Throughput`'s fields) once
    per ``window_s`` seconds. See docs/callbacks/throughput-monitor.md.

    Args:
        window_s: Seconds per window (> 0).
        log: Log a ``"throughput"`` line per window with the ``"trainbus"`` structlog logger.

    Attributes:
        last: The :class:`Throughput` of the last window (None before the first).

    Raises:
        ConfigError: ``window_s`` is not a positive number, or ``log`` not a bool.
    """

    def __init__(self, window_s: float = 5.0, *, log: bool = True) -> None:
        self.window_s = check_seconds("window_s", window_s)
        self.log = check_bool("log", log)
        self.last: Throughput | None = None

    def setup(self, bus: EventBus) -> None:
        """Subscribe the windowed measuring pipeline."""
        logger = structlog.get_logger("trainbus")

        def report(t: Throughput) -> None:
            self.last = t
            if self.log:
                logger.info("throughput", **asdict(t))

        bus.stream(ev.StepEnded).pipe(
            ops.buffer_with_time(self.window_s),
            ops.map(_Meter()),  # one meter per setup (per run)
            ops.filter(lambda t: t is not None),
        ).subscribe(report, name="ThroughputMonitor")

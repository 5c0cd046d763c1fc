"""Memory: process RSS and, on CUDA, the allocator's allocated / reserved / peak bytes."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Literal

from .. import events as ev
from .._validate import check_int
from ._base import Callback

if TYPE_CHECKING:
    from .._bus import EventBus

__all__ = ["MemoryMonitor", "read_rss"]

RssSource = Literal["psutil", "statm", "resource"]


def read_rss() -> tuple[int | None, RssSource | None]:
    """The process' resident set size in bytes, and its source: ``psutil`` when installed,
    ``/proc/self/statm`` on Linux, else ``resource`` (peak RSS only); ``(None, None)`` when none
    works.
    """
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


def measure(step: int, epoch: int, device: str) -> ev.MemoryMeasured:
    """Read the memory now and build the event; CUDA figures (host-side allocator counters:
    no device sync) only when ``device`` is CUDA."""
    rss, source = read_rss()
    allocated = reserved = peak = None
    if device.startswith("cuda"):
        import torch

        if torch.cuda.is_available():
            allocated = torch.cuda.memory_allocated(device)
            reserved = torch.cuda.memory_reserved(device)
            peak = torch.cuda.max_memory_allocated(device)
    return ev.MemoryMeasured(step=step, epoch=epoch, rss_bytes=rss, rss_source=source,
                             device=device, cuda_allocated_bytes=allocated,
                             cuda_reserved_bytes=reserved, cuda_peak_bytes=peak)  # fmt: skip


class MemoryMonitor(Callback):
    """Publishes ``MemoryMeasured`` every ``every`` steps, from the event-loop thread: the RSS
    (see :func:`read_rss`; ``rss_source`` says which) and, on CUDA, the device's allocated,
    reserved and peak bytes. The event follows its ``StepEnded`` by one delivery, so the last
    ones of a run can arrive after ``FitEnded``.

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
            self.last = measure(e.step, e.epoch, device[0])
            bus.publish(self.last)

        bus.stream(ev.FitStarted).subscribe(started, name="MemoryMonitor.fit_started")
        bus.stream(ev.StepEnded, every_steps=self.every).subscribe(sample, name="MemoryMonitor")

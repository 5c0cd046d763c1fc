"""Shared helpers for the benchmarks: interleaved rounds, medians, ratio tables, machine info.

The machines these run on are small (2 cores) and shared, so no single timing means anything.
Every benchmark here runs its variants in *interleaved rounds* (each round runs every variant
once, in an order rotated from round to round, so slow phases of the machine hit all variants
alike), then reports the median over rounds and the ratio of medians to a baseline variant.

Generic on purpose: ``benchmarks/bus.py`` and ``benchmarks/step_overhead.py`` both use it.
"""

from __future__ import annotations

import datetime as _dt
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "RESULTS_DIR",
    "Stopwatch",
    "bare_loop_s",
    "format_table",
    "interleaved_rounds",
    "load_average",
    "machine_info",
    "median",
    "median_ci",
    "paired_ratios",
    "percentile",
    "ratio",
    "run_queue_wait_s",
    "summarize",
    "write_json",
]

RESULTS_DIR = Path(__file__).resolve().parent / "results"

Measurement = float | Mapping[str, float]


def interleaved_rounds(
    variants: Mapping[str, Callable[[], Measurement]],
    rounds: int,
    *,
    warmup: int = 1,
    rotate: bool = True,
    collect: bool = True,
    progress: Callable[[int, str], None] | None = None,
    deadline: float | None = None,
    min_rounds: int = 3,
) -> dict[str, list[Measurement]]:
    """Run every variant once per round, rotating the order each round.

    Args:
        variants: name -> zero-argument callable returning one measurement (a float, or a
            mapping of named floats when one run measures several things).
        rounds: Measured rounds.
        warmup: Unmeasured rounds first (imports, allocator, caches, JIT-free but still warm).
        rotate: Round ``r`` starts at variant ``r mod n`` (so no variant is always first).
        collect: ``gc.collect()`` before every run, so one variant's garbage is not another's.
        progress: Called as ``progress(round, name)`` before each measured run.
        deadline: A ``time.perf_counter()`` value: once passed, no new round starts (after at
            least ``min_rounds`` measured rounds), so a loaded machine cannot stretch a run
            past its time budget. Every variant always has the same number of rounds.
        min_rounds: Rounds measured even past the deadline.

    Returns:
        name -> list of the measurements, one per round, in round order.
    """
    names = list(variants)
    out: dict[str, list[Measurement]] = {n: [] for n in names}
    for r in range(-warmup, rounds):
        if deadline is not None and r >= min_rounds and time.perf_counter() > deadline:
            break
        k = r % len(names) if rotate and r >= 0 else 0
        order = names[k:] + names[:k]
        for name in order:
            if collect:
                gc.collect()
            if progress is not None and r >= 0:
                progress(r, name)
            value = variants[name]()
            if r >= 0:
                out[name].append(value)
    return out


def bare_loop_s(model: Any, data: Iterable[tuple[Any, Any]], lr: float) -> float:
    """Seconds of the hand-written training loop the benchmarks compare against, on the calling
    thread: per batch the forward, cross-entropy, backward, an SGD step (``lr``) and
    ``zero_grad(set_to_none=True)``."""
    import torch
    import torch.nn.functional as F

    opt = torch.optim.SGD(model.parameters(), lr=lr)
    start = time.perf_counter()
    for x, y in data:
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def median(values: Iterable[float]) -> float:
    """Median, NaN for no values."""
    vals = [v for v in values if not math.isnan(v)]
    return statistics.median(vals) if vals else math.nan


def median_ci(values: Sequence[float], level: float = 0.95) -> tuple[float, float]:
    """A bootstrap confidence interval of the median of ``values`` (scipy's percentile method,
    2,000 resamples, a fixed seed: the same values give the same interval).

    What a target read off a median of per-round ratios needs: on a shared machine the rounds
    scatter by several percent, and a median of 15 rounds is good to a few points only. NaN,
    NaN for fewer than 3 values, or without scipy (``pip install -e .[bench]``).
    """
    vals = [v for v in values if not math.isnan(v)]
    if len(vals) < 3:
        return math.nan, math.nan
    if min(vals) == max(vals):  # the base against itself: nothing to resample
        return vals[0], vals[0]
    try:
        import numpy as np
        from scipy import stats
    except ImportError:
        return math.nan, math.nan
    res = stats.bootstrap((np.asarray(vals),), np.median, confidence_level=level,
                          n_resamples=2000, method="percentile", random_state=0)  # fmt: skip
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100), linear interpolation; NaN for no values."""
    if not values:
        return math.nan
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def ratio(value: float, base: float) -> float:
    """``value / base``, NaN when the base is zero or missing."""
    return value / base if base and not math.isnan(base) else math.nan


def summarize(
    samples: Mapping[str, Sequence[Measurement]], key: str | None = None
) -> dict[str, dict[str, float]]:
    """Per variant: median, min, max and relative spread of one measured quantity.

    ``key`` picks the quantity when a run returns a mapping.
    """
    out: dict[str, dict[str, float]] = {}
    for name, runs in samples.items():
        vals = [float(r[key]) if key is not None else float(r) for r in runs]  # type: ignore[index,arg-type]
        med = median(vals)
        out[name] = {
            "median": med,
            "min": min(vals) if vals else math.nan,
            "max": max(vals) if vals else math.nan,
            "spread": ratio(max(vals) - min(vals), med) if vals else math.nan,
            "n": float(len(vals)),
        }
    return out


def paired_ratios(
    samples: Mapping[str, Sequence[Measurement]], base: str, key: str | None = None
) -> dict[str, dict[str, Any]]:
    """Per variant, the ratio to ``base`` *within each round*, then its median and quartiles.

    Pairing runs of the same round cancels slow phases of the machine that hit the whole round;
    the median of the paired ratios is the figure to quote, the quartiles show the noise.
    """

    def values(runs: Sequence[Measurement]) -> list[float]:
        return [float(r[key]) if key is not None else float(r) for r in runs]  # type: ignore[index,arg-type]

    base_vals = values(samples[base])
    out: dict[str, dict[str, Any]] = {}
    for name, runs in samples.items():
        rs = [ratio(v, b) for v, b in zip(values(runs), base_vals, strict=True)]
        out[name] = {
            "median": median(rs),
            "p25": percentile(rs, 25),
            "p75": percentile(rs, 75),
            "ci95": median_ci(rs),
            "min": min(rs) if rs else math.nan,
            "max": max(rs) if rs else math.nan,
            "values": rs,
        }
    return out


def format_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A plain-text table (also valid Markdown) with right-aligned numbers."""
    cells = [[_cell(c) for c in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        for i, c in enumerate(row):
            widths[i] = max(widths[i], len(c))

    def line(row: Sequence[str], numeric: Sequence[bool]) -> str:
        cols = zip(row, widths, numeric, strict=False)
        parts = [c.rjust(w) if num else c.ljust(w) for c, w, num in cols]
        return "| " + " | ".join(parts) + " |"

    numeric_cols = [
        bool(cells) and all(_is_number(row[i]) for row in cells if i < len(row))
        for i in range(len(headers))
    ]
    sep = (
        "|"
        + "|".join(
            ("-" * (w + 1) + ":") if num else (":" + "-" * (w + 1))
            for w, num in zip(widths, numeric_cols, strict=True)
        )
        + "|"
    )
    return "\n".join(
        [line(list(headers), [False] * len(headers)), sep]
        + [line(row, numeric_cols) for row in cells]
    )


def _cell(value: Any) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        if abs(value) >= 100:
            return f"{value:,.0f}"
        if abs(value) >= 10:
            return f"{value:.1f}"
        return f"{value:.3f}" if abs(value) < 1 else f"{value:.2f}"
    return str(value)


def _is_number(text: str) -> bool:
    t = text.replace(",", "").rstrip("x%").lstrip("+")
    if t in ("-", ""):
        return True
    try:
        float(t)
    except ValueError:
        return False
    return True


def run_queue_wait_s() -> float:
    """Seconds the calling thread has spent runnable but waiting for a CPU (Linux schedstat).

    The difference over a timed section is the time other processes (or threads) took the CPU
    from this thread; ``wall - that`` is a wall time less sensitive to a busy shared machine.
    Time blocked on a lock (the GIL included) is *not* in it. NaN where unavailable.
    """
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return math.nan


def load_average() -> list[float]:
    """1, 5 and 15 minute load averages (empty where the OS has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on: CPUs, Python, library versions, load."""
    info: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_model": _cpu_model(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "python_implementation": platform.python_implementation(),
        "switch_interval_s": sys.getswitchinterval(),
        "load_average": load_average(),
    }
    for mod in ("torch", "reactivex", "anyio", "trainbus"):
        try:
            m = __import__(mod)
            info[f"{mod}_version"] = getattr(m, "__version__", None) or _dist_version(mod)
        except ImportError:
            info[f"{mod}_version"] = None
    try:
        import torch

        info["torch_num_threads"] = torch.get_num_threads()
        info["cuda_available"] = torch.cuda.is_available()
    except ImportError:
        pass
    return info


def _dist_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def write_json(path: Path, data: Any) -> Path:
    """Write ``data`` as indented JSON (NaN as null), creating the folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_clean(data), indent=2, sort_keys=False) + "\n")
    return path


def _clean(obj: Any) -> Any:
    if isinstance(obj, float):
        return None if math.isnan(obj) or math.isinf(obj) else obj
    if isinstance(obj, Mapping):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_clean(v) for v in obj]
    return obj


class Stopwatch:
    """``with Stopwatch() as sw: ...`` then ``sw.wall_s`` / ``sw.cpu_s`` (this thread)."""

    def __enter__(self) -> Stopwatch:
        self._w = time.perf_counter()
        self._c = time.thread_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall_s = time.perf_counter() - self._w
        self.cpu_s = time.thread_time() - self._c

"""What the event-loop watchdog's marks cost per sync subscriber call.

Run: ``.venv/bin/python benchmarks/watchdog.py`` (about 20 s; ``--rounds``, ``--calls``).

Every sync subscriber call goes through ``Subscription.on_next``, which now marks the running
subscription on the bus' :class:`~trainbus._bus.watchdog.Watchdog` (read the outer mark, write
the subscription, restore the mark in a ``finally``; the call is named by the subscription's
``received`` count, which it bumps anyway). Variants, in
interleaved rounds (see ``_common.py``), each calling ``on_next`` ``--calls`` times with a
no-op subscriber function:

- ``unmarked``: the guard's body without the marks (what it was before the watchdog);
- ``marked``: the real ``Subscription.on_next``.

Printed: the median nanoseconds per call over rounds, and the ratio to ``unmarked``. The
watchdog thread itself is not in the loop: it polls every ``watchdog_s / 10`` (at most 0.5 s),
a wake-up a few times a second. Nothing here is a pass/fail test.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from _common import format_table, interleaved_rounds, median, ratio

from trainbus._bus.commands import Doorbell
from trainbus._bus.subscriptions import Subscription
from trainbus._bus.watchdog import FailureLedger, Watchdog


class Unmarked(Subscription):
    """The guard as it was before the watchdog: counts and isolation, no marks."""

    def on_next(self, value: Any) -> None:
        self.received += 1
        try:
            self._fn(value)
        except Exception as exc:
            self.fail(exc, value)
        self.completed += 1


def per_call_ns(guard: Subscription, calls: int) -> float:
    on_next = guard.on_next
    item = object()
    start = time.perf_counter_ns()
    for _ in range(calls):
        on_next(item)
    return (time.perf_counter_ns() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=200_000)
    args = parser.parse_args()
    ledger = FailureLedger("log", lambda c: None, Doorbell())

    def noop(_: object) -> None:
        return None

    def guard(cls: type[Subscription]) -> Subscription:
        return cls(ledger, "bench", None, noop, Watchdog(5.0))

    unmarked, marked = guard(Unmarked), guard(Subscription)
    results = interleaved_rounds(
        {"unmarked": lambda: per_call_ns(unmarked, args.calls),
         "marked": lambda: per_call_ns(marked, args.calls)},
        args.rounds,
    )  # fmt: skip
    base = median(results["unmarked"])  # type: ignore[arg-type]
    rows = []
    for name, values in results.items():
        m = median(values)  # type: ignore[arg-type]
        rows.append([name, f"{m:.1f}", f"{m - base:+.1f}", f"{ratio(m, base):.3f}"])
    print(format_table(["variant", "ns/call (median)", "vs unmarked", "ratio"], rows))


if __name__ == "__main__":
    main()

"""A slow async subscriber against a real local HTTP service: does it hold training back?

The scenario users write: the tiny MLP (32-64-10, batch 32, torch on 1 thread), ``Checkpointing``
every 500 steps, the default barriers, a fast sync subscriber of every ``StepEnded``, and an
``async def`` subscriber posting every 20th ``StepEnded`` (``ops.filter(step % 20 == 0)``) to a
local stdlib ``ThreadingHTTPServer`` answering each POST after 200 ms (``urllib`` in
``anyio.to_thread``). Variants, one per run, interleaved in rounds:

- ``bare``: the hand-written PyTorch loop over the same batches (the baseline)
- ``trainbus``: the Trainer with Checkpointing and the fast subscriber, no poster
- ``default``: plus the poster with the default options (``buffer=64``,
  ``overflow="drop_oldest"``, concurrency 1)
- ``block``: plus the poster with ``overflow="block"`` (lossless: training waits for it)

Reported per variant: ``loop`` steps/s (``FitStarted.time`` to ``FitEnded.time``, stamped on the
training thread: the training itself) and its ratio to ``bare`` in the same round; ``fit_s``, the
whole ``trainer.fit_sync()`` (adds the close, which by default waits for the posts still pending);
posts sent (items the poster received), arrived (counted by the server), dropped, and the
seconds training waited on the poster (``FitResult.waited_s``).

Run: ``.venv/bin/python benchmarks/slow_subscriber.py [--steps 2000] [--rounds 3] [--quick]``.
"""

from __future__ import annotations

import argparse
import logging
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import anyio.to_thread
import torch
import torch.nn.functional as F
from _common import (
    RESULTS_DIR,
    bare_loop_s,
    format_table,
    interleaved_rounds,
    machine_info,
    median,
    paired_ratios,
    write_json,
)
from reactivex import operators as ops

from trainbus import Trainer
from trainbus import events as ev
from trainbus.callbacks import Checkpointing
from trainbus.testing import tiny_loader, tiny_model

VARIANTS = ("bare", "trainbus", "default", "block")


class _Counter:
    """Posts that arrived at the service (handler threads add to it)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.n = 0

    def add(self) -> None:
        with self.lock:
            self.n += 1


@contextmanager
def service(delay: float) -> Iterator[tuple[str, _Counter]]:
    """A local HTTP service answering each POST after ``delay`` seconds."""
    counter = _Counter()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            time.sleep(delay)
            counter.add()
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/steps", counter
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def _post(url: str, step: int) -> None:
    request = urllib.request.Request(url, data=b'{"step": %d}' % step)
    with urllib.request.urlopen(request, timeout=60) as response:
        response.read()


def bare(steps: int) -> dict[str, float]:
    loop = bare_loop_s(tiny_model(), tiny_loader(steps, batch_size=32), lr=0.1)
    return {"steps_per_s": steps / loop, "fit_s": loop}


def trainbus_run(steps: int, url: str, counter: _Counter, poster: str | None) -> dict[str, float]:
    model = tiny_model()
    with TemporaryDirectory() as tmp:
        trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                          tiny_loader(steps, batch_size=32), loss_fn=F.cross_entropy,
                          max_epochs=1, checkpoint_dir=Path(tmp),
                          callbacks=[Checkpointing(every_steps=500, every_epochs=None)],
                          device="cpu", handle_signals=False, progress=False)  # fmt: skip
        bus = trainer.bus
        span: dict[str, float] = {}
        seen = [0]

        def fast(e: ev.StepEnded) -> None:
            seen[0] += 1

        bus.subscribe(bus.stream(ev.StepEnded), fast, name="fast")
        bus.subscribe(bus.stream(ev.FitStarted, ev.FitEnded),
                      lambda e: span.__setitem__(type(e).__name__, e.time))  # fmt: skip
        if poster is not None:

            async def post(e: ev.StepEnded) -> None:
                await anyio.to_thread.run_sync(_post, url, e.step)

            every_20th = bus.stream(ev.StepEnded).pipe(ops.filter(lambda e: e.step % 20 == 0))
            options: dict[str, Any] = {"overflow": "block"} if poster == "block" else {}
            bus.subscribe_async(every_20th, post, name="poster", **options)
        before = counter.n
        t0 = time.perf_counter()
        result = trainer.fit_sync()
        fit_s = time.perf_counter() - t0
    assert seen[0] == steps, (seen[0], steps)  # the fast subscriber got every step
    loop = span["FitEnded"] - span["FitStarted"]
    stats = {s.name: s for s in result.statistics.subscriptions}
    sent = stats["poster"].received if poster else 0
    return {
        "steps_per_s": steps / loop,
        "fit_s": fit_s,
        "posts_sent": sent,
        "posts_arrived": counter.n - before,
        "dropped": stats["poster"].dropped if poster else 0,
        "waited_s": result.waited_s.get("poster", 0.0),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--delay", type=float, default=0.2, help="service answer time, s")
    parser.add_argument("--quick", action="store_true", help="500 steps, 1 round")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "slow_subscriber.json")
    args = parser.parse_args(argv)
    steps, rounds = (500, 1) if args.quick else (args.steps, args.rounds)
    torch.set_num_threads(1)
    logging.getLogger().setLevel(logging.ERROR)  # the runs' warnings are the point, not output
    with service(args.delay) as (url, counter):

        def variant(name: str) -> Callable[[], dict[str, float]]:
            if name == "bare":
                return lambda: bare(steps)
            poster = None if name == "trainbus" else name
            return lambda: trainbus_run(steps, url, counter, poster)

        def progress(r: int, name: str) -> None:
            print(f"round {r}: {name}", flush=True)

        samples = interleaved_rounds({n: variant(n) for n in VARIANTS}, rounds, warmup=0,
                                     progress=progress)  # fmt: skip
    ratios = paired_ratios(samples, "bare", key="steps_per_s")
    rows = []
    for name in VARIANTS:
        runs = samples[name]

        def med(key: str, runs: Any = runs) -> float:
            return median(float(r.get(key, 0.0)) for r in runs)

        rows.append([name, round(med("steps_per_s")), round(ratios[name]["median"], 3),
                     round(med("fit_s"), 2), int(med("posts_sent")), int(med("posts_arrived")),
                     int(med("dropped")), round(med("waited_s"), 2)])  # fmt: skip
    headers = ["variant", "loop steps/s", "x bare", "fit s", "posts sent", "arrived",
               "dropped", "waited s"]  # fmt: skip
    print(f"\n{steps} steps, {rounds} round(s), service {args.delay * 1000:.0f} ms, medians:")
    print(format_table(headers, rows))
    write_json(args.out, {"machine": machine_info(), "steps": steps, "rounds": rounds,
                          "delay_s": args.delay, "samples": samples, "ratios": ratios})  # fmt: skip
    print(f"written: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

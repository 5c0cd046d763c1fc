"""Step overhead of the Trainer against a bare PyTorch loop and pytorch-ignite, in one process.

Two models: a tiny MLP (32-64-10, batch 32: where overhead shows) and a wider MLP with a step
of a few milliseconds (256-768-768-10, batch 96: where the GIL is released inside kernels).
torch runs on 1 thread. Variants, all with the same update (forward, cross-entropy, backward,
SGD step, ``zero_grad(set_to_none=True)``) and no ``.item()`` on the hot path:

- ``bare``: the hand-written ``for x, y in data:`` loop on the main thread (the baseline)
- ``bare_thread``: the same loop on a worker thread (where the Trainer runs its loop)
- ``ignite``: pytorch-ignite 0.5's ``Engine`` with the same update function, no handlers
- ``ignite_typical``: ignite with the handlers a user typically adds: a step logger throttled to
  once a second (``ITERATION_COMPLETED``, by time), one on ``EPOCH_COMPLETED`` and ``COMPLETED``
- ``trainbus``: the Trainer with no subscriber (events nobody wants are never built)
- ``typical``: what a user typically hangs on the bus: a ``StepEnded`` logger through
  ``ops.throttle_first(1.0)``, subscribers on ``EpochEnded``, ``FitEnded``, ``CheckpointSaved``
- ``floor_tuple``, ``floor_event``, ``floor_async``: no trainbus, the floor under ``typical`` and
  ``slow_async``. The bare loop on a worker thread while an anyio event loop runs on the main
  thread and a task there empties a deque every 20 ms (what it takes is freed back on the
  training thread, as the bus does). Each step appends ``(step, loss.detach())``
  (``floor_tuple``), or a ``StepEnded`` built as the loop builds it (``floor_event``);
  ``floor_async`` is ``floor_event`` plus a task awaiting 20 ms in a loop, the async
  subscriber's timer. What any design that hands every step's event to an event-loop thread
  pays on this machine before its own code runs. The summary also prints each per-step variant
  against its floor in the same round ("trainbus over the floor"): trainbus' own share
- ``every_event``: one no-op subscriber on ``bus.events`` (every event of every step built)
- ``slow_async``: an async subscriber awaiting 20 ms on every 10th ``StepEnded``
  (``ops.filter(step % 10 == 0)``, ``overflow="latest"``: a slow consumer that only wants the
  newest, which the loop does not wait for. With ``tbops.every(10)`` instead, every 10th step
  is a decision step and the loop waits the 20 ms there by design: ~10x on the tiny model)

Each variant runs once per round, the order rotated each round; the figure quoted is the median
over rounds of the ratio to ``bare`` in the same round. Two times per run: ``loop`` (the
training loop alone: for trainbus ``FitStarted.time`` to ``FitEnded.time``, both stamped on the
training thread; for ignite ``STARTED`` to ``COMPLETED``) and ``fit`` (the whole
``trainer.fit_sync()`` / ``engine.run()``: adds trainbus' bus start and close and the thread
hand-off, a fixed cost per run); and ``cpu``, the process' CPU time over the whole run, all
threads (a busy neighbour inflates it less, as it excludes time spent waiting for a core; GIL
waits are excluded too, so it is a cross-check, not the figure). No trainbus internals are
touched: the loop time comes from the public events. Then the delivery lag of ``StepEnded``
(publish to subscriber, p50/p99).

Run: ``.venv/bin/python benchmarks/step_overhead.py [--quick] [--device cpu|cuda]`` (needs the
``bench`` extra: ``pip install -e '.[bench]'``, for pytorch-ignite).
"""

from __future__ import annotations

import argparse
import io
import logging
import resource
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from contextlib import redirect_stderr
from pathlib import Path
from typing import Any

import anyio
import structlog
import torch
import torch.nn.functional as F
from ignite.engine import Engine, Events
from reactivex import operators as ops

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    RESULTS_DIR,
    format_table,
    interleaved_rounds,
    load_average,
    machine_info,
    median,
    paired_ratios,
    percentile,
    write_json,
)

from trainbus import EvalSchedule, EventBus, Trainer
from trainbus import events as ev

Batch = tuple[torch.Tensor, torch.Tensor]
Times = dict[str, float]

# Where the "typical" loggers write: a real logging call with a real handler, kept off the
# terminal so the benchmark's own output stays readable.
_LOG_SINK = io.StringIO()
_log = logging.getLogger("bench.step_overhead")
_log.addHandler(logging.StreamHandler(_LOG_SINK))
_log.setLevel(logging.INFO)
_log.propagate = False


def make_model(kind: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    if kind == "tiny":
        return torch.nn.Sequential(
            torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)
        )
    return torch.nn.Sequential(
        torch.nn.Linear(256, 768), torch.nn.ReLU(), torch.nn.Linear(768, 768), torch.nn.ReLU(),
        torch.nn.Linear(768, 10),
    )  # fmt: skip


def make_data(kind: str, steps: int, device: torch.device) -> list[Batch]:
    g = torch.Generator().manual_seed(1)
    d, b = (32, 32) if kind == "tiny" else (256, 96)
    return [
        (
            torch.randn(b, d, generator=g).to(device),
            torch.randint(0, 10, (b,), generator=g).to(device),
        )
        for _ in range(steps)
    ]


def _switches() -> float:
    """Voluntary context switches of the whole process so far (every thread). A thread that
    waits for the GIL sleeps on a futex, a voluntary switch: each hand-over between the training
    thread and the event-loop thread shows here, while a neighbour process preempting us
    (involuntary switches) does not."""
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


# --------------------------------------------------------------------------- bare loops
def _timed(loop: Callable[[], None], device: torch.device) -> Times:
    """Run a hand-written training loop; its wall time (to the device's last kernel), the
    process' CPU time and its voluntary context switches."""
    s0 = _switches()
    c0 = time.process_time()
    t0 = time.perf_counter()
    loop()
    _sync(device)
    t = time.perf_counter() - t0
    return {"loop": t, "fit": t, "cpu": time.process_time() - c0, "switches": _switches() - s0}


def bare(kind: str, data: list[Batch], device: torch.device) -> Times:
    model = make_model(kind).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def loop() -> None:
        for x, y in data:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    return _timed(loop, device)


def bare_in_thread(kind: str, data: list[Batch], device: torch.device) -> Times:
    """The bare loop on a worker thread, as the Trainer runs its loop: separates the cost of
    trainbus from the difference between the main thread and a worker thread (glibc gives
    each thread its own malloc arena, which shows with the wide model's multi-MB grads)."""
    out: list[Times] = []
    worker = threading.Thread(target=lambda: out.append(bare(kind, data, device)))
    worker.start()
    worker.join()
    return out[0]


# --------------------------------------------------------------------------- ignite
def _ignite_typical(engine: Engine) -> None:
    """The ignite counterpart of ``_typical``: a step logger throttled to once a second (ignite
    has no time-based event filter, so the handler checks the clock on every iteration, as a
    user would write it), and handlers on the epoch's and the run's end."""
    last = [-float("inf")]

    def log_step(e: Engine) -> None:
        now = time.monotonic()
        if now - last[0] >= 1.0:
            last[0] = now
            _log.info("step %d loss %.4f", e.state.iteration, float(e.state.output))

    engine.add_event_handler(Events.ITERATION_COMPLETED, log_step)
    engine.add_event_handler(
        Events.EPOCH_COMPLETED, lambda e: _log.info("epoch %d ended", e.state.epoch)
    )
    engine.add_event_handler(
        Events.COMPLETED, lambda e: _log.info("fit ended at %d", e.state.iteration)
    )


def ignite_update(
    model: torch.nn.Module, opt: torch.optim.Optimizer
) -> Callable[[Engine, Batch], torch.Tensor]:
    """ignite's update function for the same step as the bare loop."""

    def update(engine: Engine, batch: Batch) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()  # no .item(): the bare loop and the Trainer never sync either

    return update


def with_ignite(
    kind: str, data: list[Batch], device: torch.device, setup: Callable[[Engine], None] | None
) -> Times:
    model = make_model(kind).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    engine = Engine(ignite_update(model, opt))
    stamps: dict[str, float] = {}
    engine.add_event_handler(
        Events.STARTED, lambda e: stamps.__setitem__("start", time.monotonic())
    )
    engine.add_event_handler(
        Events.COMPLETED, lambda e: stamps.__setitem__("end", time.monotonic())
    )
    if setup is not None:
        setup(engine)
    s0 = _switches()
    c0 = time.process_time()
    t0 = time.perf_counter()
    engine.run(data, max_epochs=1)
    _sync(device)
    fit = time.perf_counter() - t0
    cpu = time.process_time() - c0
    switches = _switches() - s0
    return {"loop": stamps["end"] - stamps["start"], "fit": fit, "cpu": cpu, "switches": switches}


# --------------------------------------------------------------------------- the floor
def floor(kind: str, data: list[Batch], device: torch.device, *, event: bool, timer: bool) -> Times:
    """The bare loop handing each step's loss (a tuple, or a ``StepEnded`` when ``event``) to
    an anyio event loop on another thread, with nothing else; ``timer`` adds a task awaiting
    20 ms in a loop. What any thread-and-event-loop design pays (see the module docstring)."""
    model = make_model(kind).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    handed: deque[object] = deque()
    spent: deque[object] = deque()

    def loop() -> None:
        for step, (x, y) in enumerate(data, start=1):
            start = time.monotonic()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if event:
                handed.append(ev.StepEnded(step=step, epoch=0, loss=loss.detach(), lr=0.01,
                                           grad_norm=None, samples=x.shape[0],
                                           duration_s=time.monotonic() - start))  # fmt: skip
            else:
                handed.append((step, loss.detach()))
            if spent:
                spent.clear()  # freed here, not on the loop thread (trainbus/_bus/subscriptions.py)

    async def poll() -> None:
        while True:
            await anyio.sleep(0.02)
            while handed:
                spent.append(handed.popleft())

    async def slow() -> None:  # the async subscriber's worker, always in its 20 ms await
        while True:  # noqa: ASYNC110 - a timer on purpose, not a wait for a condition
            await anyio.sleep(0.02)

    async def main() -> Times:
        async with anyio.create_task_group() as tg:
            tg.start_soon(poll)
            if timer:
                tg.start_soon(slow)
            times = await anyio.to_thread.run_sync(_timed, loop, device)
            tg.cancel_scope.cancel()
        return times

    return anyio.run(main)


# --------------------------------------------------------------------------- trainbus
def _typical(trainer: Trainer) -> None:
    """What a user typically hangs on the bus: a throttled step logger and subscribers on the
    rare events (epoch end, fit end, checkpoint saved)."""
    bus = trainer.bus
    bus.stream(ev.StepEnded).pipe(ops.throttle_first(1.0)).subscribe(
        lambda e: _log.info("step %d loss %.4f", e.step, float(e.loss))
    )
    bus.stream(ev.EpochEnded).subscribe(lambda e: _log.info("epoch %d ended", e.epoch))
    bus.stream(ev.FitEnded).subscribe(lambda e: _log.info("fit ended at %d", e.step))
    bus.stream(ev.CheckpointSaved).subscribe(lambda e: _log.info("saved %s", e.path))


def _typical_sampled(trainer: Trainer) -> None:
    """The typical kit with the step logger sampled by the bus (``stream(..., every_s=1.0)``)
    instead of ``ops.throttle_first(1.0)`` in a pipe: the loop then builds one ``StepEnded`` a
    second instead of one a step."""
    bus = trainer.bus
    bus.stream(ev.StepEnded, every_s=1.0).subscribe(
        lambda e: _log.info("step %d loss %.4f", e.step, float(e.loss))
    )
    bus.stream(ev.EpochEnded).subscribe(lambda e: _log.info("epoch %d ended", e.epoch))
    bus.stream(ev.FitEnded).subscribe(lambda e: _log.info("fit ended at %d", e.step))
    bus.stream(ev.CheckpointSaved).subscribe(lambda e: _log.info("saved %s", e.path))


def _slow_async_sampled(trainer: Trainer) -> None:
    """``slow_async`` with every 10th step taken by the bus' step sampling
    (``stream(..., every_steps=10)``) instead of an ``ops.filter`` the loop cannot see: the
    loop builds a ``StepEnded`` at those steps only."""

    async def slow(e: ev.StepEnded) -> None:
        await anyio.sleep(0.02)

    bus = trainer.bus
    bus.subscribe_async(bus.stream(ev.StepEnded, every_steps=10), slow, overflow="latest")


def _every_event(trainer: Trainer) -> None:
    trainer.bus.events.subscribe(lambda e: None)


def _slow_async(trainer: Trainer) -> None:
    async def slow(e: ev.StepEnded) -> None:
        await anyio.sleep(0.02)

    bus = trainer.bus
    # A plain filter, not tbops.every(10): tbops.every declares decision steps, at which the loop
    # waits for the async subscriber by design (20 ms every 10 steps). This variant measures a
    # slow consumer the loop does not wait for; "decides" measures the decision steps.
    bus.subscribe_async(
        bus.stream(ev.StepEnded).pipe(ops.filter(lambda e: e.step % 10 == 0)),
        slow,
        overflow="latest",
    )


def with_trainbus(
    kind: str, data: list[Batch], device: torch.device, setup: Callable[[Trainer], None] | None
) -> Times:
    model = make_model(kind).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    trainer = Trainer(model, opt, data, loss_fn=F.cross_entropy, max_epochs=1, device=device,
                      on_signal=None, eval_schedule=EvalSchedule(epoch_end=False))  # fmt: skip
    # The loop's time from the public events: both are stamped (time.monotonic) on the training
    # thread when built, whenever the subscriber sees them. Two once-per-run events: no
    # per-step cost, and wants(StepEnded) stays false for the "no subscriber" variant.
    stamps: dict[type, float] = {}
    trainer.bus.stream(ev.FitStarted, ev.FitEnded).subscribe(
        lambda e: stamps.__setitem__(type(e), e.time)
    )
    if setup is not None:
        setup(trainer)
    s0 = _switches()
    c0 = time.process_time()
    t0 = time.perf_counter()
    with redirect_stderr(io.StringIO()):  # any progress output: not measured noise on the tty
        trainer.fit_sync()
    _sync(device)
    fit = time.perf_counter() - t0
    cpu = time.process_time() - c0
    loop = stamps[ev.FitEnded] - stamps[ev.FitStarted]
    return {"loop": loop, "fit": fit, "cpu": cpu, "switches": _switches() - s0}


VARIANTS: dict[str, Callable[[str, list[Batch], torch.device], Times]] = {
    "bare": bare,
    "bare_thread": bare_in_thread,
    "ignite": lambda k, d, dev: with_ignite(k, d, dev, None),
    "ignite_typical": lambda k, d, dev: with_ignite(k, d, dev, _ignite_typical),
    "trainbus": lambda k, d, dev: with_trainbus(k, d, dev, None),
    "typical": lambda k, d, dev: with_trainbus(k, d, dev, _typical),
    "typical_sampled": lambda k, d, dev: with_trainbus(k, d, dev, _typical_sampled),
    "floor_tuple": lambda k, d, dev: floor(k, d, dev, event=False, timer=False),
    "floor_event": lambda k, d, dev: floor(k, d, dev, event=True, timer=False),
    "floor_async": lambda k, d, dev: floor(k, d, dev, event=True, timer=True),
    "every_event": lambda k, d, dev: with_trainbus(k, d, dev, _every_event),
    "slow_async": lambda k, d, dev: with_trainbus(k, d, dev, _slow_async),
    "slow_async_sampled": lambda k, d, dev: with_trainbus(k, d, dev, _slow_async_sampled),
}


def _strip(r: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in r.items() if k != "values"}


def overhead(kind: str, steps: int, rounds: int, device: torch.device) -> dict[str, Any]:
    data = make_data(kind, steps, device)
    variants = {name: (lambda f=f: f(kind, data, device)) for name, f in VARIANTS.items()}
    load_before = load_average()
    t0 = time.perf_counter()
    samples = interleaved_rounds(variants, rounds)
    loop = paired_ratios(samples, "bare", key="loop")
    fit = paired_ratios(samples, "bare", key="fit")
    cpu = paired_ratios(samples, "bare", key="cpu")
    # trainbus' own share: each per-step variant against the floor under it, in the same round.
    over_event = paired_ratios(samples, "floor_event", key="loop")
    over_async = paired_ratios(samples, "floor_async", key="loop")
    over_floor = {n: _strip(over_event[n]) for n in ("typical", "every_event")}
    over_floor |= {n: _strip(over_async[n]) for n in ("slow_async", "slow_async_sampled")}
    return {
        "steps": steps,
        "rounds": rounds,
        "seconds": time.perf_counter() - t0,
        "load_average": {"before": load_before, "after": load_average()},
        "step_us": {
            n: 1e6 * median([r["loop"] for r in runs]) / steps  # type: ignore[index]
            for n, runs in samples.items()
        },
        "switches_per_step": {
            n: median([r["switches"] for r in runs]) / steps  # type: ignore[index]
            for n, runs in samples.items()
        },
        # The ratio of the medians: on a shared machine whose speed drifts within a round the
        # per-round pairing does not cancel the drift; with many rounds both estimators are
        # reported and should agree within the per-round IQR.
        "ratio_of_medians": {
            n: median([r["loop"] for r in runs]) / median([r["loop"] for r in samples["bare"]])  # type: ignore[index]
            for n, runs in samples.items()
        },
        "ratio_loop": {n: _strip(r) for n, r in loop.items()},
        "ratio_fit": {n: _strip(r) for n, r in fit.items()},
        "ratio_cpu": {n: _strip(r) for n, r in cpu.items()},
        "ratio_to_floor": over_floor,
        "ratio_loop_per_round": {n: r["values"] for n, r in loop.items()},
        "raw": {n: list(runs) for n, runs in samples.items()},
    }


def lag(kind: str, steps: int, device: torch.device, busy_us: float) -> dict[str, float]:
    """Publish-to-subscriber lag of StepEnded, with a subscriber that burns ``busy_us`` of CPU."""
    data = make_data(kind, steps, device)
    model = make_model(kind).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    trainer = Trainer(
        model,
        opt,
        data,
        loss_fn=F.cross_entropy,
        max_epochs=1,
        device=device,
        on_signal=None,
        eval_schedule=EvalSchedule(epoch_end=False),
        bus=EventBus(),
    )
    lags: list[float] = []

    def on_step(e: ev.StepEnded) -> None:
        lags.append(time.monotonic() - e.time)
        end = time.perf_counter() + busy_us * 1e-6
        while time.perf_counter() < end:
            pass

    trainer.bus.stream(ev.StepEnded).pipe(ops.map(lambda e: e)).subscribe(on_step)
    trainer.fit_sync()
    return {
        "p50_ms": 1e3 * percentile(lags, 50),
        "p99_ms": 1e3 * percentile(lags, 99),
        "max_ms": 1e3 * max(lags),
        "n": float(len(lags)),
    }


def _cell(r: dict[str, Any]) -> str:
    return f"{r['median']:.3f} [{r['p25']:.2f}-{r['p75']:.2f}]"


def _ci_cell(r: dict[str, Any]) -> str:
    """The median of per-round ratios with its 95 % bootstrap interval."""
    return f"{r['median']:.3f} [{r['ci95'][0]:.3f}-{r['ci95'][1]:.3f}]"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few steps and rounds (~1 min)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default: results/)")
    parser.add_argument(
        "--models", default="tiny,wide", help="comma-separated subset of tiny,wide (iteration)"
    )
    args = parser.parse_args(argv)
    models = [m for m in ("tiny", "wide") if m in args.models.split(",")]
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    torch.set_num_threads(1)
    device = torch.device(args.device)
    rounds = args.rounds or (3 if args.quick else 7)
    tiny_steps, wide_steps = (1000, 80) if args.quick else (3000, 300)

    results: dict[str, Any] = {
        "command": " ".join(["benchmarks/step_overhead.py", *(argv or sys.argv[1:])]),
        "machine": machine_info(),
        "device": str(device),
        "ignite_version": _ignite_version(),
    }
    for kind in models:
        results[kind] = overhead(kind, tiny_steps if kind == "tiny" else wide_steps, rounds, device)
    results["lag"] = {
        "light": lag("tiny", tiny_steps, device, 0.0),
        "busy_50us": lag("tiny", tiny_steps, device, 50.0),
    }
    results["load_average_end"] = load_average()

    for kind in models:
        r = results[kind]
        print(
            f"\n{kind}: {r['steps']} steps, {r['rounds']} rounds, device {device}, "
            f"load {r['load_average']['before']} -> {r['load_average']['after']}"
        )
        rows = [
            (
                n,
                r["step_us"][n],
                _cell(r["ratio_loop"][n]),
                r["ratio_fit"][n]["median"],
                _cell(r["ratio_cpu"][n]),
                r["switches_per_step"][n],
            )
            for n in r["step_us"]
        ]
        headers = ["variant", "µs/step", "loop ratio [p25-p75]", "fit() ratio", "CPU ratio",
                   "ctx switches/step"]  # fmt: skip
        print(format_table(headers, rows))
    print("\nsummary (loop ratio to bare: median of per-round ratios [its 95 % bootstrap interval]"
          " / ratio of the medians)")  # fmt: skip
    print(
        format_table(
            ["variant", *models],
            [
                (n, *(f"{_ci_cell(results[k]['ratio_loop'][n])} / "
                      f"{results[k]['ratio_of_medians'][n]:.3f}" for k in models))
                for n in VARIANTS
            ],
        )
    )  # fmt: skip
    print("\ntrainbus over the floor under it (typical, every_event: floor_event; slow_async*:"
          " floor_async), median of per-round ratios [95 % bootstrap interval]")  # fmt: skip
    print(
        format_table(
            ["variant", *models],
            [
                (n, *(_ci_cell(results[k]['ratio_to_floor'][n]) for k in models))
                for n in results[models[0]]["ratio_to_floor"]
            ],
        )
    )  # fmt: skip
    print("\ndelivery lag of StepEnded (tiny model)")
    lag_rows = [(k, v["p50_ms"], v["p99_ms"], v["max_ms"]) for k, v in results["lag"].items()]
    print(format_table(["subscriber", "p50 ms", "p99 ms", "max ms"], lag_rows))
    name = (
        "step_overhead"
        + ("_quick" if args.quick else "")
        + ("" if device.type == "cpu" else f"_{device.type}")
    )
    path = write_json(args.out or RESULTS_DIR / f"{name}.json", results)
    print(f"\nwritten: {path}")
    return 0


def _ignite_version() -> str | None:
    import ignite

    return getattr(ignite, "__version__", None)


if __name__ == "__main__":
    raise SystemExit(main())

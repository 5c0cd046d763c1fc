"""The Ray transport's cost: events/s end to end, and rank 0's step time with the driver.

0. **codec**: no Ray; what each end spends per event: the worker's encoding
   (``wire.dumps`` of a ``StepEnded`` with a tensor loss) and the driver's
   ``DriverLink.receive`` (batches of 1,000 lines: parse, decode, publish).
1. **events/s**: a Ray task (1 CPU) links to a driver in this process over the Ray mailbox
   transport (``trainbus/ray/_transport.py``) and publishes ``EVENTS`` ``StepEnded`` events as
   fast as its bus takes them; the driver's bus counts them. Events/s = events / (time of the
   last arrival - time of the first).
2. **step time**: ``TorchTrainer`` with ``--workers`` workers of 1 CPU (gloo) runs the same tiny-MLP
   Trainer (``STEPS`` steps) with and without the driver (``trainbus.ray.launch`` with a
   driver ``StepEnded`` subscriber, so every step's event streams; a plain ``TorchTrainer``,
   so rank 0 has no link). Rank 0's median ``StepEnded.duration_s`` and its fit wall time per
   step, alternating the two arms for ``--rounds`` rounds.

Run: ``PYTHONPATH=src .venv/bin/python benchmarks/ray_link.py [--rounds 2] [--steps 1500]
[--workers 2] [--skip-events | --skip-steps]``.
Writes ``benchmarks/results/ray_link.json``. A Ray Train launch takes 40-70 s on a loaded
2-core machine: each round is two of them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS_DIR, machine_info, write_json

EVENTS = 50_000
CODEC_EVENTS = 20_000


def codec() -> dict[str, float]:
    """Microseconds per event: the worker's encoding, the driver's receive (best of 3)."""
    import torch

    from trainbus import EventBus
    from trainbus import _wire as wire
    from trainbus import events as ev
    from trainbus._distributed.driver_link import DriverLink

    events = [ev.StepEnded(step=i, epoch=0, loss=torch.tensor(0.5), lr=0.1, grad_norm=None,
                           samples=32, duration_s=0.001) for i in range(CODEC_EVENTS)]  # fmt: skip
    encode, receive = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        lines = [wire.dumps(e) for e in events]
        encode.append((time.perf_counter() - t0) / CODEC_EVENTS)
        chunks = [b"".join(lines[i : i + 1000]) for i in range(0, CODEC_EVENTS, 1000)]
        bus = EventBus(max_queue=CODEC_EVENTS * 2)
        bus.stream(ev.StepEnded).subscribe(lambda e: None)
        link = DriverLink(bus, "bench-token")
        t0 = time.perf_counter()
        for chunk in chunks:
            link.receive(chunk)
        receive.append((time.perf_counter() - t0) / CODEC_EVENTS)
    return {"encode_us": min(encode) * 1e6, "driver_receive_us": min(receive) * 1e6}


def publish_over_ray(address: str, token: str, n: int) -> float:
    """In a Ray task: link to the driver, publish ``n`` StepEnded, close. Seconds spent."""
    import anyio

    import trainbus.ray  # noqa: F401  registers the transport
    from trainbus import EventBus
    from trainbus import events as ev
    from trainbus._distributed.link import WorkerLink

    link = WorkerLink(address, token, timeout=30)
    bus = EventBus(flush_interval=0.02)
    link.start(bus)

    async def main() -> float:
        async with bus:
            t0 = time.perf_counter()

            def run() -> None:
                for i in range(1, n + 1):
                    bus.publish(ev.StepEnded(step=i, epoch=0, loss=0.5, lr=0.1, grad_norm=None,
                                             samples=32, duration_s=0.001))  # fmt: skip

            await anyio.to_thread.run_sync(run)
            return time.perf_counter() - t0

    spent = anyio.run(main)
    link.close()
    return spent


def events_per_second(ray: Any) -> dict[str, float]:
    import anyio

    from trainbus import EventBus
    from trainbus import events as ev
    from trainbus._distributed.driver_link import DriverLink
    from trainbus.ray._transport import RayDriver

    arrivals: list[float] = []
    bus = EventBus(flush_interval=0.02)
    bus.stream(ev.StepEnded).subscribe(lambda e: arrivals.append(time.perf_counter()))
    task = ray.remote(num_cpus=1)(publish_over_ray)

    async def main() -> float:
        link = DriverLink(bus, "bench-token")
        driver = await RayDriver.start()
        async with bus, anyio.create_task_group() as tg:
            tg.start_soon(driver.serve, link)
            ref = task.remote(driver.address, "bench-token", EVENTS)
            spent: float = await anyio.to_thread.run_sync(ray.get, ref)
            await link.wait_unlinked(120)
            await bus.wait_delivered(30)
            tg.cancel_scope.cancel()
        await driver.aclose()
        return spent

    publish_s = anyio.run(main)
    span = arrivals[-1] - arrivals[0] if len(arrivals) > 1 else float("nan")
    return {"events": len(arrivals), "publish_s": publish_s, "arrival_span_s": span,
            "events_per_s": len(arrivals) / span}  # fmt: skip


def train_fn(config: dict[str, Any]) -> None:
    """Every worker: a tiny-MLP Trainer; rank 0 writes its step times."""
    import json

    import torch
    import torch.nn.functional as F

    from trainbus import Trainer
    from trainbus import events as ev
    from trainbus.testing import tiny_loader, tiny_model

    torch.manual_seed(0)
    model = tiny_model()
    t = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01),
                tiny_loader(config["steps"] * 2, 32), loss_fn=F.cross_entropy, max_epochs=1,
                on_signal=None, progress=False)  # fmt: skip
    durations: list[float] = []
    t.bus.stream(ev.StepEnded).subscribe(lambda e: durations.append(e.duration_s), ranks="all")
    t0 = time.perf_counter()
    r = t.fit_sync()
    wall = time.perf_counter() - t0
    if t.bus.rank == 0:
        out = {"steps": r.steps, "median_step_s": statistics.median(durations[50:]),
               "wall_per_step_s": wall / max(r.steps, 1)}  # fmt: skip
        Path(config["out"]).write_text(json.dumps(out))


def step_times(ray: Any, steps: int, rounds: int, workers: int) -> dict[str, Any]:
    import json

    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    import trainbus.ray
    from trainbus import events as ev

    scaling = ScalingConfig(num_workers=workers, resources_per_worker={"CPU": 1})
    arms: dict[str, list[dict[str, float]]] = {"without_driver": [], "with_driver": []}
    tmp = Path(tempfile.mkdtemp(prefix="ray_link_"))
    for i in range(rounds):
        order = ["without_driver", "with_driver"][:: 1 if i % 2 == 0 else -1]
        for arm in order:
            out = tmp / f"{arm}-{i}.json"
            config = {"steps": steps, "out": str(out)}
            run_config = RunConfig(storage_path=str(tmp / "ray"), name=f"{arm}-{i}")
            if arm == "with_driver":
                trainbus.ray.launch(train_fn, scaling_config=scaling, run_config=run_config,
                                    train_loop_config=config,
                                    setup=lambda bus: bus.stream(ev.StepEnded).subscribe(
                                        lambda e: None))  # fmt: skip
            else:
                TorchTrainer(train_fn, scaling_config=scaling, run_config=run_config,
                             train_loop_config=config).fit()  # fmt: skip
            arms[arm].append(json.loads(out.read_text()))
            print(arm, i, arms[arm][-1], flush=True)
    summary: dict[str, Any] = {"workers": workers, "rounds": arms}
    for key in ("median_step_s", "wall_per_step_s"):
        base = statistics.median(r[key] for r in arms["without_driver"])
        driven = statistics.median(r[key] for r in arms["with_driver"])
        summary[key] = {"without_driver": base, "with_driver": driven, "ratio": driven / base}
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--workers", type=int, default=2,
                        help="Ray Train workers of 1 CPU (1 leaves a core of a 2-core machine "
                        "to the driver, its mailbox actor and Ray itself)")  # fmt: skip
    parser.add_argument("--skip-steps", action="store_true", help="only the events/s part")
    parser.add_argument("--skip-events", action="store_true", help="only the step-time part")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "ray_link.json")
    args = parser.parse_args()
    import ray
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    src = str(Path(__file__).resolve().parents[1] / "src")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": src}})  # fmt: skip
    result: dict[str, Any] = {"machine": machine_info(), "codec": codec()}
    print("codec", result["codec"], flush=True)
    try:
        if not args.skip_events:
            result["events"] = events_per_second(ray)
            print("events", result["events"], flush=True)
        if not args.skip_steps:
            result["steps"] = step_times(ray, args.steps, args.rounds, args.workers)
            for key in ("median_step_s", "wall_per_step_s"):
                print(key, result["steps"][key], flush=True)
    finally:
        ray.shutdown()
    print(write_json(args.out, result))


if __name__ == "__main__":
    main()

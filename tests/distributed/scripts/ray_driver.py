"""A Ray driver script, as a user writes one: ``python ray_driver.py OUT TEMP_DIR [SLOW_S]``.

Starts its own local Ray (2 CPUs, its files under TEMP_DIR), launches 2 Ray Train workers with
``trainbus.ray.launch`` and prints ``training`` once the driver saw step 3, then
``result {...}`` when the launch returned or ``error {...}`` when it raised. Each rank writes
``OUT/rank<r>.json`` when its run ended and ``OUT/pid<r>`` when it started. SLOW_S: seconds
each step sleeps (so a graceful stop cannot finish before a second signal)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import ray
from ray.train import RunConfig, ScalingConfig

import trainbus.ray
from trainbus import EventBus, LaunchError
from trainbus import events as ev


def train_fn(config: dict[str, Any]) -> None:
    import time

    import torch
    from torch.nn import functional as F

    import trainbus
    from trainbus.testing import tiny_loader, tiny_model

    out = Path(config["out"])

    class Slow(trainbus.Callback):
        def hook_after_optimizer_step(self, ctx: Any) -> None:
            time.sleep(config["slow"])

    torch.manual_seed(0)
    model = tiny_model()
    t = trainbus.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01),
                         tiny_loader(20_000, 8), loss_fn=F.cross_entropy, max_epochs=1,
                         checkpoint_dir=out / "ckpt", progress=False, on_signal=None,
                         callbacks=[Slow()])  # fmt: skip
    (out / f"pid{t.bus.rank}").write_text(str(os.getpid()))
    saved: list[str | None] = []
    t.bus.stream(ev.CheckpointSaved).subscribe(lambda e: saved.append(e.tag), ranks="all")
    r = t.fit_sync()
    (out / f"rank{t.bus.rank}.json").write_text(
        json.dumps(
            {"reason": r.reason, "stop_reason": r.stop_reason, "steps": r.steps, "saved": saved}
        )
    )


def main() -> int:
    out, temp_dir = Path(sys.argv[1]), sys.argv[2]
    slow = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
    src = str(Path(trainbus.__file__).resolve().parents[1])
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=temp_dir,
             runtime_env={"env_vars": {"PYTHONPATH": src}})  # fmt: skip
    said: list[int] = []

    def setup(bus: EventBus) -> None:
        def training(e: ev.StepEnded) -> None:
            if e.step >= 3 and not said:
                said.append(e.step)
                print("training", flush=True)

        bus.stream(ev.StepEnded).subscribe(training)

    try:
        result = trainbus.ray.launch(
            train_fn, scaling_config=ScalingConfig(num_workers=2), setup=setup,
            run_config=RunConfig(storage_path=str(out / "ray"), name="signals"),
            train_loop_config={"out": str(out), "slow": slow},
        )  # fmt: skip
    except LaunchError as exc:
        print("error", json.dumps({"signal": exc.signal, "message": str(exc)[:300]}), flush=True)
        return 1
    last = result.last_event
    tags = [e.tag for e in result.events if isinstance(e, ev.CheckpointSaved)]
    said_result = {"signal": result.signal, "stop_reason": result.stop_reason,
                   "last": type(last).__name__ if last else None, "final": tags}  # fmt: skip
    print("result", json.dumps(said_result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

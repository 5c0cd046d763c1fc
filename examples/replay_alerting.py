"""Replay-testing a pipeline: the same divergence alert on a live run and on its recording.

A divergence alert is a small Rx pipeline over ``MetricsLogged``: it fires when the logged loss
is above ``FACTOR`` times the best loss seen so far. It is attached to a live run recorded by
``JsonlEventLog``; then ``trainbus.replay`` plays the recording on a virtual clock and the very
same pipeline runs on it in milliseconds. Both must take the same decisions at the same steps.

Run: ``python examples/replay_alerting.py``
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from reactivex import Observable
from reactivex import operators as ops

from trainbus import Trainer, replay
from trainbus import events as ev
from trainbus import operators as tbops
from trainbus.callbacks import JsonlEventLog
from trainbus.testing import VirtualTimeScheduler, tiny_loader, tiny_model

FACTOR = 1.02  # alert when the loss is 2 % above its best: the high LR below makes it bounce


def divergence_alerts(events: Observable[Any]) -> Observable[tuple[int, float, float]]:
    """``(step, loss, best)`` each time the logged loss exceeds ``FACTOR`` x the best so far."""

    def track(acc: tuple[float, Any], e: ev.MetricsLogged) -> tuple[float, Any]:
        loss = float(e.metrics["loss"])
        return min(acc[0], loss), (e.step, loss, acc[0])

    return events.pipe(
        tbops.of_type(ev.MetricsLogged),
        ops.scan(track, (float("inf"), None)),
        ops.map(lambda acc: acc[1]),
        ops.filter(lambda t: t[1] > FACTOR * t[2]),
    )


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = tiny_model()
    with tempfile.TemporaryDirectory() as tmp:
        log_path = Path(tmp) / "events.jsonl"
        trainer = Trainer(
            model, torch.optim.SGD(model.parameters(), lr=0.8), tiny_loader(batches=20),
            loss_fn=F.cross_entropy, max_epochs=3, log_every=2, progress=False,
            callbacks=[JsonlEventLog(log_path, events=[ev.MetricsLogged, ev.FitEnded])],
        )  # fmt: skip
        live: list[tuple[int, float, float]] = []
        trainer.bus.subscribe(divergence_alerts(trainer.bus.events), live.append, name="alerts")
        result = trainer.fit_sync()

        replayed: list[tuple[int, float, float]] = []
        scheduler = VirtualTimeScheduler()
        divergence_alerts(replay(log_path)).subscribe(replayed.append, scheduler=scheduler)
        scheduler.start()

    same = [s for s, *_ in live] == [s for s, *_ in replayed]
    print(f"replay alerting: {result.steps} steps, {len(live)} alerts live, "
          f"{len(replayed)} on the replay, same steps: {same}")  # fmt: skip
    if not same:
        raise SystemExit(f"live {live} != replayed {replayed}")


if __name__ == "__main__":
    main()

"""Sampled logging: a step logger the training loop does not pay for between two lines.

``bus.stream(ev.StepEnded).pipe(ops.throttle_first(0.5))`` logs one line per 0.5 s, but the bus
cannot see inside the pipe: the loop builds and publishes a ``StepEnded`` on every step for the
throttle to drop. ``bus.stream(ev.StepEnded, every_s=0.5)`` samples where the event is routed,
and the loop sees it: while no subscription takes every step, it builds a ``StepEnded`` only
when a sample is due. ``every_steps=n`` samples by step (every n-th step, the
``logging_steps`` of other trainers). The bus' statistics show how few events were published.

Run: ``python examples/sampled_logging.py``
"""

from __future__ import annotations

import structlog
import torch
import torch.nn.functional as F

from trainbus import Trainer
from trainbus import events as ev
from trainbus.testing import tiny_loader, tiny_model

# Examples may configure structlog (the library never does): one plain line per log call.
structlog.configure(
    processors=[structlog.processors.add_log_level, structlog.dev.ConsoleRenderer(colors=False)]
)
log = structlog.get_logger("sampled_logging")

STEPS = 2000


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = tiny_model()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05),
                      tiny_loader(batches=100), loss_fn=F.cross_entropy, max_steps=STEPS,
                      progress=False)  # fmt: skip
    bus = trainer.bus
    timed: list[int] = []
    stepped: list[int] = []

    def log_timed(e: ev.StepEnded) -> None:
        timed.append(e.step)  # the loss is read here, on the event-loop thread, only for these
        log.info("step", step=e.step, loss=round(float(e.loss), 4))

    bus.stream(ev.StepEnded, every_s=0.25).subscribe(log_timed)
    bus.stream(ev.StepEnded, every_steps=500).subscribe(lambda e: stepped.append(e.step))

    result = trainer.fit_sync()

    assert stepped == [500, 1000, 1500, 2000], stepped
    published = result.statistics.published
    # One StepEnded per 0.25 s and four by step, plus a handful of run events: far below one
    # per step.
    assert published < STEPS // 4, published
    print(
        f"sampled logging: {result.steps} steps, {len(timed)} timed lines, steps {stepped}, "
        f"{published} events published"
    )


if __name__ == "__main__":
    main()

"""Throttled logging: log at most one line per 0.5 s, however fast the steps are.

``bus.stream(ev.StepEnded)`` delivers every step, but a terminal (or a remote logger) cannot keep
up with thousands of lines a second, and formatting them would cost the loop for nothing.
``ops.throttle_first(0.5)`` passes the first step of each 0.5 s window and drops the rest. It
runs on the bus' event-loop thread (the bus hands its own scheduler to time-based operators), so
the training thread only appends each event to a queue and never waits for the logger.

Run: ``python examples/throttled_logging.py``
"""

from __future__ import annotations

import time

import structlog
import torch
import torch.nn.functional as F
from reactivex import operators as ops

from trainbus import Trainer
from trainbus import commands as cmd
from trainbus import events as ev
from trainbus.testing import tiny_loader, tiny_model

# Examples may configure structlog (the library never does): one plain line per log call.
structlog.configure(
    processors=[
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="%H:%M:%S.%f"),
        structlog.dev.ConsoleRenderer(colors=False),
    ]
)
log = structlog.get_logger("throttled_logging")

INTERVAL_S = 0.5
BUDGET_S = 3.0  # wall-clock budget: the run stops itself, however fast this machine is


def main() -> None:
    # A tiny model gains nothing from intra-op threads; on a small shared machine they only
    # compete with the bus' event-loop thread.
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = tiny_model()
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.05),
        tiny_loader(batches=50),  # 50 tiny batches per epoch; a step takes about a ms
        loss_fn=F.cross_entropy,
        max_steps=20_000,  # more than BUDGET_S allows: the time budget below ends the run
    )
    bus = trainer.bus
    steps_seen = 0
    lines_logged = 0

    def count_step(e: ev.StepEnded) -> None:
        # A second, unthrottled subscriber only counts, to compare with what was logged.
        nonlocal steps_seen
        steps_seen += 1

    def log_step(e: ev.StepEnded) -> None:
        # Reading the loss tensor happens here, on the event-loop thread, only for the steps
        # that get through the throttle: the training thread never syncs for a value nobody logs.
        nonlocal lines_logged
        lines_logged += 1
        log.info("step", step=e.step, epoch=e.epoch, loss=round(float(e.loss), 4), lr=e.lr)

    bus.stream(ev.StepEnded).subscribe(count_step)
    bus.stream(ev.StepEnded).pipe(ops.throttle_first(INTERVAL_S)).subscribe(log_step)

    # The time budget is itself a small pipeline: the first step past BUDGET_S becomes a
    # StopTraining command on the back-channel, applied at the loop's next poll point.
    started = time.monotonic()
    bus.stream(ev.StepEnded).pipe(
        ops.filter(lambda e: e.time - started > BUDGET_S),
        ops.take(1),
        ops.map(lambda e: cmd.StopTraining(reason=f"time budget of {BUDGET_S} s")),
    ).subscribe(bus.commands)

    result = trainer.fit_sync()

    # Every step reached the counter (the bus drains before fit() returns), yet the logger
    # wrote about one line per 0.5 s of training.
    assert steps_seen == result.steps, (steps_seen, result.steps)
    assert 1 <= lines_logged < steps_seen / 10, (lines_logged, steps_seen)
    print(
        f"throttled logging: {result.steps} steps ran, {lines_logged} lines logged "
        f"(at most one per {INTERVAL_S} s); run {result.reason}: {result.stop_reason}"
    )


if __name__ == "__main__":
    main()

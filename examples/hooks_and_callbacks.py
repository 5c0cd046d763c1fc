"""Class-based callbacks: subscribers and inline hooks in one class, plus a global callback.

A ``Callback`` subclass is sugar over the bus and the hooks:

- ``on_step_ended(self, e)`` becomes a subscriber to ``StepEnded`` (event-loop thread, sees a
  frozen event after the fact);
- ``async def on_evaluation_ended(self, e)`` becomes an async subscriber: training never waits
  for it (``subscribe_options = SubscribeOptions(decides=True)`` on the class would make each
  ``EvaluationEnded`` barrier wait, for a method whose commands must land on that evaluation's
  step), and ``fit()`` returns once it has run for every evaluation;
- ``hook_loss(self, ctx)`` runs inline on the training thread, between the loss and backward,
  and may change the step: here it scales the loss by 0.5.

``with counter:`` (``counter`` an ``EventCounter`` instance) registers a callback process-wide
(the "global" tier) for every run started inside the block. Each event reaches user callbacks
before global ones.

Run: ``python examples/hooks_and_callbacks.py``
"""

from __future__ import annotations

import threading
from collections import Counter

import anyio
import structlog
import torch
import torch.nn.functional as F

from trainbus import Callback, StepContext, Trainer
from trainbus import events as ev
from trainbus.testing import tiny_loader, tiny_model

structlog.configure(
    processors=[
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="%H:%M:%S"),
        structlog.dev.ConsoleRenderer(colors=False),
    ]
)
log = structlog.get_logger("hooks_and_callbacks")

LOSS_SCALE = 0.5
order: list[str] = []  # which callback saw StepEnded(step=1) first


class ScaledLoss(Callback):
    """A user callback: one hook, one sync subscriber, one async subscriber."""

    def __init__(self) -> None:
        self.raw_losses: dict[int, float] = {}  # by step, read in the hook
        self.reported: dict[int, float] = {}  # by step, read from StepEnded
        self.threads: dict[str, str] = {}
        self.evaluations = 0

    def hook_loss(self, ctx: StepContext) -> None:
        # Training thread, inside the step: the returned loss is what backward() sees and what
        # StepEnded reports. Reading .item() here syncs the device; fine on CPU,
        # and it is only done to check the example.
        assert ctx.loss is not None
        self.threads["hook_loss"] = threading.current_thread().name
        self.raw_losses[ctx.step + 1] = ctx.loss.item()
        ctx.loss = ctx.loss * LOSS_SCALE

    def on_step_ended(self, e: ev.StepEnded) -> None:
        self.threads["on_step_ended"] = threading.current_thread().name
        self.reported[e.step] = float(e.loss)
        if e.step == 1:
            order.append("user")

    async def on_evaluation_ended(self, e: ev.EvaluationEnded) -> None:
        # Any awaitable work fits here (a metrics service, a file write in a thread...).
        await anyio.sleep(0.05)
        self.evaluations += 1
        log.info("evaluated", epoch=e.epoch, step=e.step, val_loss=round(e.metrics["val_loss"], 4))


class EventCounter(Callback):
    """A global callback: counts every event type (``on_event`` takes all of them)."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

    def on_event(self, e: ev.BaseEvent) -> None:
        self.counts[type(e).__name__] += 1
        if isinstance(e, ev.StepEnded) and e.step == 1:
            order.append("global")


def main() -> None:
    torch.set_num_threads(1)  # tiny model: extra intra-op threads only compete for 2 cores
    data = tiny_loader(batches=12)
    model = tiny_model()
    scaled = ScaledLoss()
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.05),
        data[:10],
        loss_fn=F.cross_entropy,
        eval_data=data[10:],
        max_epochs=3,
        callbacks=[scaled],
    )
    # Registered for the runs started inside the block only; removed on exit.
    counter = EventCounter()
    with counter:
        result = trainer.fit_sync()

    # The hook really changed the step: every reported loss is the scaled raw loss.
    assert scaled.reported.keys() == scaled.raw_losses.keys()
    for step, raw in scaled.raw_losses.items():
        assert abs(scaled.reported[step] - raw * LOSS_SCALE) < 1e-6, (step, raw)
    assert scaled.threads["hook_loss"] != scaled.threads["on_step_ended"]
    assert scaled.evaluations == 3
    assert order == ["user", "global"], order
    assert counter.counts["StepEnded"] == result.steps and counter.counts["FitEnded"] == 1
    print(
        f"hooks and callbacks: {result.steps} steps, loss scaled by {LOSS_SCALE} in hook_loss "
        f"(thread {scaled.threads['hook_loss']!r}) and seen scaled by on_step_ended (thread "
        f"{scaled.threads['on_step_ended']!r}); {scaled.evaluations} async evaluations; global "
        f"EventCounter saw {sum(counter.counts.values())} events; delivery order {order}"
    )


if __name__ == "__main__":
    main()

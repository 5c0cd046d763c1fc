"""Early stopping as a reactive pipeline, on a run built to plateau.

``bus.stream(ev.EvaluationEnded).pipe(tbops.patience("val_loss", patience=2))`` emits one
``StopTraining`` once ``val_loss`` has not improved for two evaluations in a row; ending the
pipeline in ``.subscribe(bus.commands)`` sends it to the loop. ``EvaluationEnded`` is a barrier
event, so the loop waits for these pipelines before its next step: the stop (and the LR change
below) lands at exactly the step that decided it, run after run.

To make the plateau certain, a second pipeline sets the learning rate to 0 at the first
evaluation from step 30 on: the weights stop moving, ``val_loss`` repeats exactly, and patience
runs out two evaluations later (step 50). A baseline evaluation is also requested from outside
the loop with ``await bus.request(cmd.Evaluate())``, which returns its ``EvaluationEnded``.

Run: ``python examples/early_stopping_pipeline.py``
"""

from __future__ import annotations

import anyio
import structlog
import torch
import torch.nn.functional as F
from reactivex import operators as ops

from trainbus import EvalSchedule, Trainer
from trainbus import commands as cmd
from trainbus import events as ev
from trainbus import operators as tbops
from trainbus.testing import tiny_loader, tiny_model

structlog.configure(
    processors=[
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="%H:%M:%S"),
        structlog.dev.ConsoleRenderer(colors=False),
    ]
)
log = structlog.get_logger("early_stopping_pipeline")

EVAL_EVERY = 10
FREEZE_AT = 30


async def main() -> None:
    torch.set_num_threads(1)  # tiny model: extra intra-op threads only compete for 2 cores
    data = tiny_loader(batches=40, seed=0)
    model = tiny_model()
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.02),
        data[:32],
        loss_fn=F.cross_entropy,
        eval_data=data[32:],
        eval_schedule=EvalSchedule(every_steps=EVAL_EVERY, epoch_end=False),
        # evaluations every 10 steps only, for a regular rhythm
        max_steps=1_000,  # never reached: early stopping ends the run
    )
    bus = trainer.bus

    def log_evaluation(e: ev.EvaluationEnded) -> None:
        log.info("evaluated", step=e.step, trigger=e.trigger, val_loss=e.metrics["val_loss"])

    bus.stream(ev.EvaluationEnded).subscribe(log_evaluation)
    # The plateau maker: the first evaluation at step >= 30 becomes SetLearningRate(0).
    bus.stream(ev.EvaluationEnded).pipe(
        tbops.once(at=FREEZE_AT),
        ops.map(lambda e: cmd.SetLearningRate(lr=0.0)),
    ).subscribe(bus.commands)
    # Early stopping: the pipeline decides, the loop obeys.
    bus.stream(ev.EvaluationEnded).pipe(
        tbops.patience("val_loss", patience=2),
    ).subscribe(bus.commands)

    baseline: ev.EvaluationEnded | None = None

    async def evaluate_before_training() -> None:
        # request() sends the command and waits for the loop to apply it; the loop applies
        # commands waiting at its start before the first step, so this scores the initial model.
        nonlocal baseline
        result = await bus.request(cmd.Evaluate())
        assert isinstance(result, ev.EvaluationEnded)
        baseline = result

    async with anyio.create_task_group() as tg:
        tg.start_soon(evaluate_before_training)
        result = await trainer.fit()

    print(
        f"FitResult: reason={result.reason!r} steps={result.steps} "
        f"stop_reason={result.stop_reason!r} val_loss={result.eval_metrics['val_loss']:.6f}"
    )
    assert baseline is not None and baseline.trigger == "command"
    assert result.reason == "stopped" and result.stop_reason is not None
    assert result.stop_reason.startswith("early stopping"), result.stop_reason
    # Deterministic: LR set to 0 at the step-30 evaluation, no improvement at 40 and 50.
    assert result.steps == FREEZE_AT + 2 * EVAL_EVERY, result.steps
    assert result.eval_metrics["val_loss"] < baseline.metrics["val_loss"]
    print(
        f"early stopping: stopped at step {result.steps} after val_loss went "
        f"{baseline.metrics['val_loss']:.4f} (baseline, step {baseline.step}) -> "
        f"{result.eval_metrics['val_loss']:.4f} and plateaued"
    )


if __name__ == "__main__":
    anyio.run(main)

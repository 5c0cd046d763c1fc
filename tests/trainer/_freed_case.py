"""The cases of tests/trainer/test_holder_freed.py, run in a fresh interpreter:
``python _freed_case.py CASE...``.

Each case calls a Trainer once to warm up the process' lazy state (imports, caches), then
builds one with the garbage collector off, calls it, drops it, and reports which of its objects
are still alive, which objects of that kind a garbage-collector pass then finds in reference
cycles, and whether its training thread outlived the drop. Prints one JSON object:
``{case: {"alive": [...], "in_cycles": [...], "threads": [...]}}``.
"""

from __future__ import annotations

import gc
import json
import sys
import tempfile
import threading
import weakref
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import torch
import torch.nn.functional as F

from trainbus import Callback, EvalSchedule, EventBus, Trainer
from trainbus import commands as cmd
from trainbus import events as ev
from trainbus.callbacks import EarlyStopping
from trainbus.testing import tiny_loader, tiny_model


class Counting(Callback):
    """A user's class callback: a sync subscriber, an async one and an inline hook."""

    def __init__(self) -> None:
        self.steps = 0

    def on_step_ended(self, event: ev.StepEnded) -> None:
        self.steps += 1

    async def on_evaluation_ended(self, event: ev.EvaluationEnded) -> None:
        await anyio.lowlevel.checkpoint()

    def hook_loss(self, ctx: Any) -> None:
        pass


def build(tmp: str, case: str) -> Trainer:
    model = tiny_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)  # state (buffers) per parameter
    callbacks: list[Callback] = [Counting(), EarlyStopping("val_loss", patience=5)]
    if case == "pruned":
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        study = optuna.create_study(pruner=_AlwaysPrune())
        from trainbus.integrations.optuna import OptunaPruning

        callbacks.append(OptunaPruning(study.ask(), "val_loss"))
    trainer = Trainer(
        model,
        optimizer,
        tiny_loader(4),
        loss_fn=F.cross_entropy,
        eval_data=tiny_loader(1, seed=1),
        eval_schedule=EvalSchedule(every_steps=2),
        max_steps=6,
        checkpoint_dir=tmp,
        progress=False,
        on_signal=None,
        callbacks=callbacks,
    )
    bus: EventBus = trainer.bus
    # The habits of a user's program: a hook and subscribers that close over the bus.
    trainer.add_hook("after_optimizer_step", lambda ctx: bus.wants(ev.StepEnded) and None)
    bus.stream(ev.StepEnded).subscribe(lambda e: None)

    async def slow(e: ev.StepEnded) -> None:
        await anyio.lowlevel.checkpoint()

    bus.subscribe_async(bus.stream(ev.StepEnded), slow)
    if case == "stopped":
        trainer.add_hook("after_optimizer_step", lambda ctx: ctx.step == 3
                         and bus.send(cmd.StopTraining(reason="enough")))  # fmt: skip
    return trainer


class _Boom(Exception):
    pass


class _AlwaysPrune:
    """An Optuna pruner that prunes at the first report."""

    def prune(self, study: Any, trial: Any) -> bool:
        return True


def call(trainer: Trainer, case: str) -> None:
    if case in ("completed", "stopped"):
        trainer.fit_sync()
    elif case in ("asyncio", "trio"):

        async def main() -> None:
            await trainer.fit()
            await trainer.evaluate()

        anyio.run(main, backend=case)
    elif case == "evaluated":
        trainer.evaluate_sync()
        trainer.predict_sync(tiny_loader(1), return_outputs=True)
    elif case == "with":
        with trainer:
            trainer.fit_sync()
            trainer.evaluate_sync()
    elif case == "raised":

        def boom(ctx: Any) -> None:
            if ctx.step == 3:
                raise _Boom("a user's hook failed")

        trainer.add_hook("after_optimizer_step", boom)
        try:
            trainer.fit_sync()
        except _Boom:
            pass
        else:
            raise AssertionError("the run did not raise")
    elif case == "pruned":
        import optuna

        try:
            trainer.fit_sync()
        except optuna.TrialPruned:
            pass
        else:
            raise AssertionError("the trial was not pruned")
    else:
        raise SystemExit(f"unknown case {case!r}")


def main(case: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        call(build(str(Path(tmp) / "warm"), case), case)  # lazy imports and caches: not ours
        gc.collect()
        gc.disable()
        trainer = build(str(Path(tmp) / "run"), case)
        threads = set(threading.enumerate())
        call(trainer, case)
        new = set(threading.enumerate()) - threads
        training = {t for t in new if t.name.startswith("trainbus-training")}
        for thread in new - training:
            # The call's event-loop threads end after it returned: until they have, their last
            # frames may still refer to what they ran. The training thread idles until the
            # trainer closes or is dropped, holding nothing of the call.
            thread.join(timeout=30)
        settings = trainer.settings
        optimizer = settings.optimizers["default"]
        state = list(optimizer.state.values())  # Adam's buffers (none before a step)
        buffer = state[0]["exp_avg"] if state else next(settings.model.parameters())
        del state
        refs = {"trainer": weakref.ref(trainer), "bus": weakref.ref(trainer.bus),
                "model": weakref.ref(settings.model), "optimizer": weakref.ref(optimizer),
                "buffer": weakref.ref(buffer)}  # fmt: skip
        del trainer, settings, optimizer, buffer
        alive = sorted(name for name, ref in refs.items() if ref() is not None)
        if "trainer" not in alive:  # dropped: its training thread ends (no gc pass either)
            for thread in training:
                thread.join(timeout=30)
        left = sorted(t.name for t in training if t.is_alive())
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        heavy = (Trainer, EventBus, torch.nn.Module, torch.Tensor, torch.optim.Optimizer)
        cyclic = sorted({type(o).__name__ for o in gc.garbage if isinstance(o, heavy)})
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    return {"alive": alive, "in_cycles": cyclic, "threads": left}


if __name__ == "__main__":
    print(json.dumps({case: main(case) for case in sys.argv[1:]}))

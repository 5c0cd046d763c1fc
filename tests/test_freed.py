"""A dropped Trainer frees its model, optimizer and buffers without a garbage-collector pass:
no reference cycle through the bus, the hooks, the loop or the result (a sweep's previous
trials' weights must not wait for the next gc pass, on a GPU above all)."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from trainbus import Callback, Trainer
from trainbus import commands as cmd
from trainbus import events as ev
from trainbus.callbacks import EarlyStopping
from trainbus.testing import tiny_loader, tiny_model


@pytest.fixture
def no_gc() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


class Counting(Callback):
    def __init__(self) -> None:
        self.steps = 0

    def on_step_ended(self, event: ev.StepEnded) -> None:
        self.steps += 1

    def hook_loss(self, ctx: Any) -> None:
        pass


LEFT = pytest.mark.xfail(
    strict=True,
    reason="a run that completes still leaves a reference "
    "cycle holding the model (not found yet; a stopped run frees it)",
)


@pytest.mark.usefixtures("no_gc")
@pytest.mark.parametrize(
    "ending",
    [
        pytest.param("completed", marks=LEFT),
        "stopped",
        pytest.param("sync and async calls", marks=LEFT),
    ],
)
def test_a_dropped_trainer_frees_its_model_and_optimizer_without_gc(
    tmp_path: Path, ending: str
) -> None:
    model = tiny_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)  # state (buffers) per parameter
    trainer = Trainer(model, optimizer, tiny_loader(4), loss_fn=F.cross_entropy,
                      eval_data=tiny_loader(1, seed=1), eval_every=2, max_steps=6,
                      checkpoint_dir=tmp_path, progress=False, handle_signals=False,
                      callbacks=[Counting(), EarlyStopping("val_loss", patience=5)])  # fmt: skip
    trainer.add_hook("after_optimizer_step", lambda ctx: None)
    trainer.bus.stream(ev.StepEnded).subscribe(lambda e: None)
    if ending == "stopped":
        bus = trainer.bus
        trainer.add_hook("after_optimizer_step", lambda ctx: ctx.step == 3
                         and bus.send(cmd.StopTraining(reason="pruned")))  # fmt: skip
    result = trainer.run()
    if ending == "sync and async calls":
        trainer.evaluate_sync()
        trainer.predict_sync(tiny_loader(1), return_outputs=True)
    assert result.steps in (3, 6)
    refs = {"trainer": weakref.ref(trainer), "model": weakref.ref(model),
            "optimizer": weakref.ref(optimizer)}  # fmt: skip
    del trainer, model, optimizer, result
    alive = [name for name, ref in refs.items() if ref() is not None]
    assert alive == [], f"still alive without a gc pass: {alive}"

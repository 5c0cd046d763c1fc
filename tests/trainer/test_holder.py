"""One name, one meaning: each async call of the Trainer has one synchronous twin, spelt
``<call>_sync`` with the same parameters plus ``backend``; there is no other spelling (no
``run()``)."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F

from trainbus import Trainer
from trainbus.testing import tiny_loader, tiny_model

ASYNC_CALLS = ["fit", "evaluate", "predict"]


def _trainer() -> Trainer:
    model = tiny_model()
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_loader(batches=2),
                   loss_fn=F.cross_entropy, max_steps=1, device="cpu", progress=False,
                   on_signal=None)  # fmt: skip


def test_every_async_call_has_its_twin_named_call_sync() -> None:
    public_async = {name for name, fn in vars(Trainer).items()
                    if inspect.iscoroutinefunction(inspect.unwrap(fn))
                    and not name.startswith("_")}  # fmt: skip
    assert public_async - {"aclose"} == set(ASYNC_CALLS)  # aclose: the async twin of close()
    for name in ASYNC_CALLS:
        twin = getattr(Trainer, f"{name}_sync")
        assert not inspect.iscoroutinefunction(twin)
        params = dict(inspect.signature(getattr(Trainer, name)).parameters)
        twin_params = dict(inspect.signature(twin).parameters)
        assert twin_params.pop("backend").default == "asyncio", name
        assert twin_params == params, name


def test_run_is_not_a_second_name_for_fit_sync() -> None:
    trainer = _trainer()
    with pytest.raises(AttributeError, match="'run'"):
        trainer.run()  # type: ignore[attr-defined]
    assert trainer.fit_sync().steps == 1


def test_fit_sync_trains() -> None:
    trainer = _trainer()
    assert trainer.fit_sync().steps == 1
    assert trainer.evaluate_sync(tiny_loader(batches=1))["val_loss"] >= 0

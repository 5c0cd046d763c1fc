"""Where subscriptions run under torchrun, checked on one process with EventBus(rank=...)."""

from __future__ import annotations

from typing import Any

import pytest

from trainbus import Callback, ConfigError, EventBus, Trainer
from trainbus import events as ev
from trainbus._bus.subscriptions import env_rank


async def _noop(_: Any) -> None:
    return None


def test_subscriptions_run_on_rank_0_by_default_and_register_nothing_elsewhere() -> None:
    bus = EventBus(rank=1)
    assert bus.rank == 1
    sub = bus.stream(ev.StepEnded).subscribe(print)
    assert not sub.active and not bus.wants(ev.StepEnded)
    asub = bus.subscribe_async(bus.stream(ev.EpochEnded), _noop)
    assert not asub.active and not bus.wants(ev.EpochEnded)
    assert not bus.subscribe(bus.stream(ev.FitEnded), print).active
    assert not bus.wants(ev.FitEnded)


@pytest.mark.parametrize("ranks", ["all", 1, {0, 1}, [1]])
def test_ranks_place_a_subscription_on_this_rank(ranks: Any) -> None:
    bus = EventBus(rank=1)
    assert bus.stream(ev.StepEnded).subscribe(print, ranks=ranks).active
    assert bus.wants(ev.StepEnded)
    assert bus.subscribe_async(bus.stream(ev.EpochEnded), _noop, ranks=ranks).active


def test_on_ranks_sets_the_default_for_a_block() -> None:
    bus = EventBus(rank=2)
    with bus.on_ranks("all"):
        inside = bus.stream(ev.StepEnded).subscribe(print)
        pinned = bus.stream(ev.EpochEnded).subscribe(print, ranks=0)
    assert inside.active and not pinned.active
    assert not bus.stream(ev.FitEnded).subscribe(print).active  # restored afterwards


@pytest.mark.parametrize("bad", ["some", -1, True, [], [0, "1"], 1.5])
def test_bad_ranks_are_a_config_error(bad: Any) -> None:
    with pytest.raises(ConfigError, match="ranks"):
        EventBus().stream(ev.StepEnded).subscribe(print, ranks=bad)


def test_the_bus_reads_its_rank_from_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "3")
    assert EventBus().rank == 3
    monkeypatch.delenv("RANK")
    assert EventBus().rank == 0
    with pytest.raises(ConfigError, match="RANK"):
        env_rank({"RANK": "x"})
    with pytest.raises(ConfigError, match="rank"):
        EventBus(rank=-1)


class _Everywhere(Callback):
    ranks = "all"

    def on_step_ended(self, e: ev.StepEnded) -> None:
        pass


class _Main(Callback):
    def on_epoch_ended(self, e: ev.EpochEnded) -> None:
        pass


def test_a_callbacks_ranks_decide_where_its_methods_run() -> None:
    import torch

    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = [(torch.zeros(1, 2), torch.zeros(1, 1))]
    trainer = Trainer(model, opt, data, loss_fn=torch.nn.functional.mse_loss, max_steps=1,
                      progress=False, bus=EventBus(rank=1),
                      callbacks=[_Everywhere(), _Main()])  # fmt: skip
    assert trainer.bus.wants(ev.StepEnded) and not trainer.bus.wants(ev.EpochEnded)
    main = _Main()
    main.ranks = "all"  # per instance
    trainer.add_callback(main)
    assert trainer.bus.wants(ev.EpochEnded)

"""Seeds: ``seed_everything`` before the model makes two runs equal; ``Trainer(seed=)`` gives a
run a data order of its own that other threads' draws cannot change, resumable exactly."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

import trainbus
from trainbus import ConfigError, Trainer
from trainbus.testing import tiny_loader


def build_model() -> torch.nn.Module:
    # Drawn from the process-wide generator, as a user's model is.
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def shuffled(batch_size: int = 16) -> DataLoader[Any]:
    x, y = (torch.cat(t) for t in zip(*tiny_loader(8, 16), strict=True))
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=True)


def params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def train(model: torch.nn.Module, data: Any, *, resume: str | None = None,
          **kw: Any) -> Trainer:  # fmt: skip
    args: dict[str, Any] = dict(loss_fn=F.cross_entropy, max_epochs=3, progress=False,
                                on_signal=None, seed=5)  # fmt: skip
    args.update(kw)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), data, **args)
    trainer.fit_sync(resume=resume)
    return trainer


def test_seed_everything_before_the_model_makes_two_runs_equal() -> None:
    runs = []
    for _ in range(2):
        trainbus.seed_everything(3)
        model = build_model()  # the usual order: the model first, then the Trainer
        train(model, shuffled())
        runs.append(params(model))
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))

    torch.manual_seed(4)  # without it: other initial weights, another run
    other = build_model()
    train(other, shuffled())
    assert not all(torch.equal(a, b) for a, b in zip(runs[0], params(other), strict=True))


@pytest.mark.parametrize("bad", [-1, True, 1.5, "3"])
def test_seed_everything_refuses_what_is_not_a_seed(bad: object) -> None:
    with pytest.raises(ConfigError, match="seed"):
        trainbus.seed_everything(bad)  # type: ignore[arg-type]


def test_the_users_loader_is_left_as_it_is() -> None:
    data = shuffled()
    trainbus.seed_everything(0)
    train(build_model(), data)
    assert type(data.sampler) is RandomSampler and data.sampler.generator is None
    assert data.generator is None


def trial(seed: int, results: dict[int, list[torch.Tensor]], barrier: threading.Barrier) -> None:
    gen = torch.Generator().manual_seed(seed)  # a model built without the global generator
    model = build_model()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    barrier.wait()
    train(model, shuffled(), seed=seed)
    results[seed] = params(model)


def test_concurrent_trials_in_threads_train_as_they_do_alone() -> None:
    alone: dict[int, list[torch.Tensor]] = {}
    for seed in (1, 2):
        trial(seed, alone, threading.Barrier(1))

    together: dict[int, list[torch.Tensor]] = {}
    stop = threading.Event()

    def noise() -> None:  # another thread's use of the process-wide generator
        while not stop.is_set():
            torch.rand(8)

    barrier = threading.Barrier(3)
    threads = [threading.Thread(target=trial, args=(seed, together, barrier)) for seed in (1, 2)]
    noisy = threading.Thread(target=lambda: (barrier.wait(), noise()))
    for t in [*threads, noisy]:
        t.start()
    for t in threads:
        t.join(timeout=120)
    stop.set()
    noisy.join(timeout=10)
    assert set(together) == {1, 2}
    for seed in (1, 2):
        assert all(torch.equal(a, b) for a, b in zip(alone[seed], together[seed], strict=True))


@pytest.mark.parametrize("stop_at", [8, 12], ids=["epoch boundary", "mid-epoch"])
def test_a_seeded_shuffled_run_resumes_exactly(tmp_path: Path, stop_at: int) -> None:
    trainbus.seed_everything(0)
    start = build_model().state_dict()

    straight = build_model()
    straight.load_state_dict(start)
    train(straight, shuffled())

    first = build_model()
    first.load_state_dict(start)
    train(first, shuffled(), checkpoint_dir=tmp_path, max_steps=stop_at, max_epochs=None)
    torch.rand(100)  # the process-wide generator moves on meanwhile (another process' state)
    second = build_model()
    second.load_state_dict(start)
    resumed = train(second, shuffled(), checkpoint_dir=tmp_path, resume="latest")
    assert resumed.result is not None and resumed.result.resumed_from is not None
    assert all(torch.equal(a, b)
               for a, b in zip(params(straight), params(second), strict=True))  # fmt: skip

"""The training data's side of the run (EpochData): the one-time pin_memory hint for a CUDA
run's DataLoader (no GPU needed: only the device's type is read)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from structlog.testing import capture_logs
from torch.utils.data import DataLoader, TensorDataset

from trainbus._loop import data as data_module
from trainbus._loop.data import hint_pin_memory

CUDA = torch.device("cuda", 0)


def loader(pin: bool) -> DataLoader[Any]:
    data = TensorDataset(torch.zeros(4, 2), torch.zeros(4))
    # pin_memory=True without CUDA only warns when iterated; it is never iterated here
    return DataLoader(data, batch_size=2, pin_memory=pin)


@pytest.fixture(autouse=True)
def fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(data_module, "_hinted", False)


def test_a_cuda_run_with_an_unpinned_loader_is_hinted_once() -> None:
    with capture_logs() as logs:
        assert hint_pin_memory(loader(False), CUDA)
        assert not hint_pin_memory(loader(False), CUDA)  # one time per process
    hints = [e for e in logs if e["event"] == "pin_memory_hint"]
    assert len(hints) == 1 and hints[0]["log_level"] == "warning"
    assert "pin_memory=True" in hints[0]["reason"] and hints[0]["device"] == "cuda:0"


@pytest.mark.parametrize(
    ("data", "device"),
    [
        (loader(True), CUDA),  # already pinned
        (loader(False), torch.device("cpu")),  # a CPU run: nothing to overlap
        ([(torch.zeros(2, 2), torch.zeros(2))], CUDA),  # not a DataLoader
    ],
)
def test_no_hint_where_it_does_not_apply(data: Any, device: torch.device) -> None:
    with capture_logs() as logs:
        assert not hint_pin_memory(data, device)
    assert logs == []


def test_the_loop_asks_for_the_hint_with_the_runs_data_and_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch.nn.functional as F

    from trainbus import Trainer
    from trainbus.testing import tiny_model

    seen: list[tuple[Any, torch.device]] = []
    monkeypatch.setattr(data_module, "hint_pin_memory", lambda d, dev: seen.append((d, dev)))
    model = tiny_model()
    data = DataLoader(TensorDataset(torch.randn(8, 32), torch.randint(0, 10, (8,))), batch_size=4)
    Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), data, loss_fn=F.cross_entropy,
            max_steps=1, device="cpu", progress=False, on_signal=None).fit_sync()  # fmt: skip
    assert seen == [(data, torch.device("cpu"))]

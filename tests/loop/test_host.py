"""predict(return_outputs=True) keeps outputs on the host as they come (HostOutputs): pinned,
non-blocking copies on CUDA, one wait at the end, concatenated on the host."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from trainbus import Trainer
from trainbus._loop.host import HostOutputs
from trainbus.testing import tiny_loader, tiny_model


def trainer(device: str) -> Trainer:
    model = tiny_model()
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_loader(2),
                   loss_fn=F.cross_entropy, max_steps=1, device=device, progress=False,
                   handle_signals=False)  # fmt: skip


def test_host_outputs_keep_cpu_tensors_and_structures_without_waiting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    waits: list[Any] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waits.append(device))
    kept = HostOutputs(torch.device("cpu"))
    a, b = torch.ones(2, 3), torch.zeros(1)
    kept.add({"logits": a, "extra": (b, "name")})
    kept.add([a, 3])
    out = kept.batches()
    assert out[0]["logits"] is a and out[0]["extra"][0] is b and out[0]["extra"][1] == "name"
    assert out[1][0] is a and out[1][1] == 3
    assert waits == []  # nothing was queued: no device wait


def test_predict_returns_host_outputs_joined_on_the_host() -> None:
    data = tiny_loader(3, batch_size=4)
    out = trainer("cpu").predict_sync(data, return_outputs=True)
    assert out.device.type == "cpu" and out.shape == (12, 10)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_predict_outputs_come_back_pinned_on_the_host() -> None:
    t = trainer("cuda")
    data = tiny_loader(3, batch_size=4)
    kept = HostOutputs(torch.device("cuda", torch.cuda.current_device()))
    on_device = torch.randn(4, 10, device="cuda")
    kept.add(on_device)
    (copy,) = kept.batches()
    assert copy.device.type == "cpu" and copy.is_pinned() and torch.equal(copy, on_device.cpu())
    out = t.predict_sync(data, return_outputs=True)
    assert out.device.type == "cpu" and out.shape == (12, 10)

"""A pretend CUDA for CPU-only tests: ``torch.cuda``'s device, RNG and property functions patched.

Only what trainbus itself calls is faked; a tensor cannot go to a fake GPU. Tests pair it with
:class:`HostModel` (stays on the host whatever ``.to()`` says) and :class:`Placed` batches (a
``.to()`` that records the device instead of copying), so a whole ``fit()`` runs "on CUDA" and
shows which device each batch was sent to and which device each thread made current.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F


class FakeCuda:
    """``count`` pretend GPUs of compute capability ``major``.0.

    CUDA's current device is per thread and starts at 0 on each thread, as in CUDA: ``current``
    is the main thread's, others start at 0 until they call ``torch.cuda.set_device``.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch, count: int = 2, major: int = 9) -> None:
        self.count = count
        self.major = major
        self._local = threading.local()
        self.set_calls: list[tuple[str, int]] = []
        """``(thread name, index)`` of each ``torch.cuda.set_device`` call."""
        gen = torch.Generator().manual_seed(1)
        self.rng = [torch.randint(0, 255, (16,), dtype=torch.uint8, generator=gen)
                    for _ in range(count)]  # fmt: skip
        self.restored: dict[int, torch.Tensor] = {}
        """``{index: state}`` set by ``torch.cuda.set_rng_state``."""
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "is_available", lambda: True)
        monkeypatch.setattr(cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(cuda, "device_count", lambda: self.count)
        monkeypatch.setattr(cuda, "current_device", self.current_device)
        monkeypatch.setattr(cuda, "set_device", self.set_device)
        monkeypatch.setattr(cuda, "get_device_properties", self.properties)
        monkeypatch.setattr(cuda, "get_rng_state_all", self.get_rng_state_all)
        monkeypatch.setattr(cuda, "set_rng_state", self.set_rng_state)
        monkeypatch.setattr(torch.version, "hip", None)

    def current_device(self) -> int:
        return int(getattr(self._local, "index", 0))

    def set_device(self, device: Any) -> None:
        index = torch.device(device).index if not isinstance(device, int) else device
        assert index is not None and 0 <= index < self.count, f"invalid device ordinal {device}"
        self._local.index = index
        self.set_calls.append((threading.current_thread().name, index))

    def properties(self, device: Any) -> SimpleNamespace:
        return SimpleNamespace(name="Fake GPU", major=self.major, minor=0)

    def get_rng_state_all(self) -> list[torch.Tensor]:
        return [s.clone() for s in self.rng[: self.count]]

    def set_rng_state(self, state: torch.Tensor, device: int | str = "cuda") -> None:
        assert isinstance(state, torch.Tensor) and state.device.type == "cpu", (
            "RNG state must be a torch.ByteTensor"  # what torch says of a state on the GPU
        )
        index = device if isinstance(device, int) else torch.device(device).index or 0
        assert 0 <= index < self.count, f"invalid device ordinal {index}"
        self.restored[index] = state.clone()


class Placed:
    """A batch with its own ``.to()``: records where it was sent; its tensors stay on the host."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, device: torch.device | None = None):
        self.x, self.y, self.device = x, y, device

    def to(self, device: Any) -> Placed:
        return Placed(self.x, self.y, torch.device(device))


class HostModel(torch.nn.Module):
    """A linear regression that stays on the host (``.to()`` is a no-op) and records, for each
    batch, where it was sent and the calling thread's current CUDA device (``seen``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)
        self.seen: list[tuple[torch.device | None, int, str]] = []

    def to(self, *args: Any, **kwargs: Any) -> HostModel:
        return self

    def forward(self, batch: Placed) -> torch.Tensor:
        self.seen.append(
            (batch.device, torch.cuda.current_device(), threading.current_thread().name)
        )
        return F.mse_loss(self.lin(batch.x), batch.y)


def placed_batches(n: int, seed: int = 0) -> list[Placed]:
    """``n`` host batches of 8 samples for :class:`HostModel`."""
    gen = torch.Generator().manual_seed(seed)
    return [Placed(torch.randn(8, 4, generator=gen), torch.randn(8, 1, generator=gen))
            for _ in range(n)]  # fmt: skip

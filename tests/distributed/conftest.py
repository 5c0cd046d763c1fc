"""Every test here runs its ranks as gloo processes on the CPU, on any host."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ._torchrun import env


@pytest.fixture(scope="package", autouse=True)
def _cpu_ranks() -> Iterator[None]:
    """``cpu_ranks`` (tests/conftest.py) for the whole package: package-scoped, so the ranks
    that the module-scoped fixtures start (test_fsdp, test_agreement, test_trainer_ddp) see no
    GPU either; a function-scoped fixture would only be set up after them."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CUDA_VISIBLE_DEVICES", "")
        yield


@pytest.fixture
def src_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """This checkout's ``src`` on ``PYTHONPATH``, for the processes a launcher starts."""
    monkeypatch.setenv("PYTHONPATH", env()["PYTHONPATH"])

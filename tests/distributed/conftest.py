"""Every test here runs its ranks as gloo processes on the CPU, on any host."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _cpu_ranks(cpu_ranks: None) -> None:
    """The torchrun ranks these tests start see no GPU (see ``cpu_ranks`` in tests/conftest.py)."""

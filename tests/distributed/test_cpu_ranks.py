"""The ranks these tests start are CPU processes on any host, those of module fixtures too."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="module")
def environ_of_a_module_fixture() -> str | None:
    """What a module-scoped fixture that starts torchrun (test_fsdp's) hands its ranks."""
    return os.environ.get("CUDA_VISIBLE_DEVICES")


def test_a_module_fixtures_ranks_see_no_gpu(environ_of_a_module_fixture: str | None) -> None:
    # On the first GPU run the ranks of such fixtures took cuda:1 on a one-GPU host.
    assert environ_of_a_module_fixture == ""
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == ""

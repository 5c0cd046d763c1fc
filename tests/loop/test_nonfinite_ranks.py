"""The non-finite guard's rank agreement, on one process with a stand-in for the collective
(the two-rank runs are tests/distributed/test_agreed.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from trainbus import NonFiniteLossError
from trainbus._loop.nonfinite import NonFiniteGuard


def guard(policy: str, agree: Any, device: str = "cpu") -> NonFiniteGuard:
    settings = SimpleNamespace(on_nonfinite=policy, device=torch.device(device))
    state = SimpleNamespace(step=4, epoch=0)
    return NonFiniteGuard(settings, state, stop=lambda r: None,  # type: ignore[arg-type]
                          agree=agree)  # fmt: skip


def test_skip_follows_the_other_ranks_verdict_on_a_finite_loss() -> None:
    asked: list[bool] = []

    def some_rank_nan(local_bad: bool) -> bool:
        asked.append(local_bad)
        return True  # another rank's loss was NaN

    g = guard("skip", some_rank_nan)
    assert g.per_step
    assert g.skip_update([torch.tensor(0.5)], 5)  # finite here, skipped with the others
    assert asked == [False] and g.skipped == 1


def test_skip_asks_even_when_every_loss_is_finite_and_steps_when_all_are() -> None:
    asked: list[bool] = []
    g = guard("skip", lambda bad: asked.append(bad) or bad)
    assert not g.skip_update([torch.tensor(0.5)], 5)
    assert not g.skip_update([torch.tensor(0.25)], 5)
    assert asked == [False, False]  # one agreement per step, on every rank


@pytest.mark.parametrize("policy", ["raise", "stop"])
def test_raise_and_stop_under_ranks_wait_for_the_window_even_on_the_cpu(policy: str) -> None:
    g = guard(policy, lambda bad: bad)
    assert not g.per_step  # decided at the window's close, agreed there


def test_one_process_keeps_the_cpu_per_step_check() -> None:
    g = guard("raise", None)
    assert g.per_step
    with pytest.raises(NonFiniteLossError, match="step 5"):
        g.skip_update([torch.tensor(float("nan"))], 5)

"""Small traps a researcher meets (issue 22 item 9): the batch at every hook point of its
step, ``FitResult.train_metrics`` for a run shorter than ``log_every``, Lightning's precision
spellings."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from trainbus import ConfigError, Trainer
from trainbus._hookpoints import HOOK_POINTS, StepContext
from trainbus.testing import tiny_loader, tiny_model

TRAIN_POINTS = [p for p in HOOK_POINTS if p != "eval_batch"]


def _trainer(**kwargs: Any) -> Trainer:
    model = tiny_model()
    kwargs.setdefault("max_steps", 4)
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_loader(8, 4),
                   loss_fn=F.cross_entropy, progress=False, **kwargs)  # fmt: skip


@pytest.mark.parametrize("accumulate", [1, 2])
def test_every_hook_point_of_a_step_sees_its_batch(accumulate: int) -> None:
    """A GAN's second optimizer, stepped in after_optimizer_step, unpacks ctx.batch there."""
    trainer = _trainer(accumulate=accumulate)
    seen: dict[str, list[tuple[int, torch.Tensor]]] = {p: [] for p in TRAIN_POINTS}

    def hook_at(point: str):  # type: ignore[no-untyped-def]
        def hook(ctx: StepContext) -> None:
            inputs, _targets = ctx.batch  # the user's unpacking: a TypeError on None
            seen[point].append((ctx.batch_index, inputs.clone()))

        return hook

    for point in TRAIN_POINTS:
        trainer.add_hook(point, hook_at(point))
    trainer.fit_sync()
    steps = 4
    assert len(seen["batch"]) == len(seen["after_backward"]) == steps * accumulate
    assert len(seen["before_optimizer_step"]) == len(seen["after_optimizer_step"]) == steps
    # after_backward: the micro-batch itself; the optimizer points: the step's last one.
    for (bi, x), (bj, y) in zip(seen["batch"], seen["after_backward"], strict=True):
        assert bi == bj and torch.equal(x, y)
    last_of_window = seen["batch"][accumulate - 1 :: accumulate]
    for point in ("before_optimizer_step", "after_optimizer_step"):
        for (bi, x), (bj, y) in zip(last_of_window, seen[point], strict=True):
            assert bi == bj and torch.equal(x, y)


@pytest.mark.parametrize(
    ("max_steps", "log_every", "on_nonfinite"),
    [
        (3, 50, "raise"),
        (7, 5, "raise"),
        (3, 50, "skip"),
        (1, 2, "raise"),
        (3, 50, "ignore"),
        (7, 5, "ignore"),
    ],
)
def test_train_metrics_hold_the_last_loss_for_any_run_length(
    max_steps: int, log_every: int, on_nonfinite: str
) -> None:
    trainer = _trainer(max_steps=max_steps, log_every=log_every, on_nonfinite=on_nonfinite)
    losses: list[float] = []
    trainer.add_hook("loss", lambda ctx: losses.append(float(ctx.loss.detach())))  # type: ignore[arg-type]
    result = trainer.fit_sync()
    assert result.steps == max_steps
    # The partial last window: the mean of the steps after the last log step.
    tail = losses[(max_steps // log_every) * log_every :]
    assert result.train_metrics["loss"] == pytest.approx(sum(tail) / len(tail), rel=1e-6)
    assert result.train_metrics["lr"] == pytest.approx(0.1)
    assert result.train_metrics["steps_per_s"] > 0


@pytest.mark.parametrize("on_nonfinite", ["raise", "ignore"])
def test_a_run_ending_on_a_log_step_keeps_that_windows_metrics(on_nonfinite: str) -> None:
    # The window's mean over its steps, also when no guard and no subscriber reads each step.
    trainer = _trainer(max_steps=4, log_every=2, on_nonfinite=on_nonfinite)
    losses: list[float] = []
    trainer.add_hook("loss", lambda ctx: losses.append(float(ctx.loss.detach())))  # type: ignore[arg-type]
    result = trainer.fit_sync()
    assert result.train_metrics["loss"] == pytest.approx(sum(losses[2:]) / 2, rel=1e-6)


@pytest.mark.parametrize(
    ("spelling", "meant"), [("32-true", "32"), ("bf16-mixed", "bf16"), ("32", "32")]
)
def test_lightning_precision_spellings_are_accepted(spelling: str, meant: str) -> None:
    trainer = _trainer(precision=spelling, max_steps=2)
    assert trainer.settings.precision == meant
    assert trainer.fit_sync().steps == 2


def test_16_mixed_means_fp16_which_needs_cuda() -> None:
    with pytest.raises(ConfigError, match=r"precision='fp16'.*needs CUDA"):
        _trainer(precision="16-mixed", device="cpu")


@pytest.mark.parametrize("spelling", ["16", "float16", "bf16-true", "16-true", "64-true", 32])
def test_an_unknown_precision_lists_the_accepted_spellings(spelling: object) -> None:
    with pytest.raises(ConfigError) as info:
        _trainer(precision=spelling)
    message = str(info.value)
    assert f"precision={spelling!r}" in message
    for accepted in ("'32'", "'bf16'", "'fp16'", "'32-true'", "'bf16-mixed'", "'16-mixed'"):
        assert accepted in message
    if isinstance(spelling, str) and spelling.endswith("-true"):
        dtype = {"16-true": "float16", "bf16-true": "bfloat16", "64-true": "float64"}[spelling]
        assert f"cast it yourself (model.to(torch.{dtype}))" in message
    if spelling == 32:
        assert "strings: precision='32'" in message

"""A two-view contrastive step (SimCLR-style) with gradient accumulation, resumed exactly.

The step is the user's (``train_step=``): two augmented views of each batch, two forwards, the
InfoNCE loss, ``ctx.backward``; ``ctx.optimizer_step()`` steps at the last of each step's
``accumulate=2`` micro-batches. The positive-pair similarity is logged with ``ctx.log`` and
lands in ``MetricsLogged`` and ``FitResult.train_metrics``. A run stopped at step 4 and
resumed with ``resume="latest"`` ends with the same weights as an uninterrupted one.

Run: ``python examples/contrastive.py``
"""

from __future__ import annotations

import tempfile

import torch
from torch import nn

from trainbus import TrainContext, Trainer

STEPS, STOP_AT, ACCUMULATE = 8, 4, 2


def make() -> tuple[nn.Module, torch.optim.Optimizer, list[torch.Tensor]]:
    """A tiny encoder, its optimizer and a list of batches."""
    torch.manual_seed(0)
    encoder = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16))
    opt = torch.optim.SGD(encoder.parameters(), lr=0.1, momentum=0.9)
    data = [torch.randn(16, 8) for _ in range(STEPS * ACCUMULATE)]
    return encoder, opt, data


def augment(x: torch.Tensor) -> torch.Tensor:
    """A random view: noise and a random feature mask (draws from torch's RNG)."""
    return (x + 0.1 * torch.randn_like(x)) * (torch.rand_like(x) > 0.1)


def contrastive_step(ctx: TrainContext) -> torch.Tensor:
    """InfoNCE over two views of the batch."""
    x = ctx.batch
    with ctx.autocast():
        z1 = nn.functional.normalize(ctx.model(augment(x)), dim=1)
        z2 = nn.functional.normalize(ctx.model(augment(x)), dim=1)
        logits = z1 @ z2.T / 0.2
        labels = torch.arange(len(x), device=ctx.device)  # made here: on the run's device
        loss = (nn.functional.cross_entropy(logits, labels)
                + nn.functional.cross_entropy(logits.T, labels)) / 2  # fmt: skip
    ctx.backward(loss)
    ctx.optimizer_step()  # steps at the step's last micro-batch
    ctx.log("pos_sim", (z1 * z2).sum(dim=1).mean().detach())
    return loss


def train(directory: str, *, steps: int = STEPS, resume: str | None = None) -> Trainer:
    encoder, opt, data = make()
    trainer = Trainer(encoder, opt, data, train_step=contrastive_step, accumulate=ACCUMULATE,
                      clip_grad_norm=5.0, max_steps=steps, log_every=2, seed=3,
                      checkpoint_dir=directory, progress=False)  # fmt: skip
    trainer.fit_sync(resume=resume)
    return trainer


def main() -> None:
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        whole = train(a)
        train(b, steps=STOP_AT)  # ends with a checkpoint at STOP_AT
        resumed = train(b, resume="latest")
        assert whole.result is not None
        same = all(
            torch.equal(x, y)
            for x, y in zip(
                whole.settings.model.state_dict().values(),
                resumed.settings.model.state_dict().values(),
                strict=True,
            )
        )
        m = whole.result.train_metrics
        print(
            f"contrastive: {whole.result.steps} steps of {ACCUMULATE} micro-batches, "
            f"pos_sim {m['pos_sim']:.3f}, grad_norm logged: {'grad_norm' in m}, "
            f"resumed at step {STOP_AT} bit-identical: {same}"
        )


if __name__ == "__main__":
    main()

"""A GAN with two optimizers and a custom step, stopped halfway and resumed bit-identically.

The step is the user's (``train_step=``): a discriminator update on real and generated data,
then a generator update, each with its own optimizer (``optimizer={"g": ..., "d": ...}``) and
scheduler. trainbus still publishes the step's events, runs the hooks, checks the losses,
logs ``d_loss`` next to the loss, and saves and restores both optimizers and schedulers: a
run stopped at step 6 (``max_steps=6``) and resumed with ``resume="latest"`` ends with the same
weights as an uninterrupted one.

Run: ``python examples/gan.py``
"""

from __future__ import annotations

import tempfile

import torch
from torch import nn

from trainbus import TrainContext, Trainer

STEPS, STOP_AT = 12, 6


def make() -> tuple[nn.ModuleDict, dict[str, torch.optim.Optimizer], dict[str, object], list]:
    """A tiny generator / discriminator pair, their optimizers, schedulers and data."""
    torch.manual_seed(0)
    model = nn.ModuleDict({
        "g": nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2)),
        "d": nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 1)),
    })  # fmt: skip
    opts = {
        "g": torch.optim.Adam(model["g"].parameters(), lr=2e-3, betas=(0.5, 0.9)),
        "d": torch.optim.Adam(model["d"].parameters(), lr=1e-3, betas=(0.5, 0.9)),
    }
    scheds = {name: torch.optim.lr_scheduler.StepLR(o, step_size=4, gamma=0.5)
              for name, o in opts.items()}  # fmt: skip
    real = [torch.randn(8, 2) * 0.5 + 2.0 for _ in range(STEPS)]
    return model, opts, scheds, real


def gan_step(ctx: TrainContext) -> dict[str, torch.Tensor]:
    """One GAN step: the discriminator, then the generator."""
    g, d = ctx.model["g"], ctx.model["d"]  # type: ignore[index]
    real = ctx.batch
    bce = nn.functional.binary_cross_entropy_with_logits
    # Tensors made inside the step go on the run's device (a GPU when there is one).
    noise = torch.randn(real.shape[0], 4, device=ctx.device)
    ones = torch.ones(len(real), 1, device=ctx.device)
    zeros = torch.zeros(len(real), 1, device=ctx.device)
    with ctx.autocast():
        fake = g(noise)
        d_loss = bce(d(real), ones) + bce(d(fake.detach()), zeros)
    ctx.backward(d_loss)
    ctx.optimizer_step("d")
    with ctx.autocast():
        g_loss = bce(d(fake), ones)
    ctx.backward(g_loss)
    ctx.optimizer_step("g")
    return {"loss": g_loss, "d_loss": d_loss}


def train(directory: str, *, steps: int = STEPS, resume: str | None = None) -> Trainer:
    model, opts, scheds, real = make()
    trainer = Trainer(model, opts, real, train_step=gan_step, scheduler=scheds,
                      max_steps=steps, log_every=3, seed=1, checkpoint_dir=directory,
                      progress=False)  # fmt: skip
    trainer.fit_sync(resume=resume)
    return trainer


def main() -> None:
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        whole = train(a)
        train(b, steps=STOP_AT)  # ends with a checkpoint at STOP_AT
        resumed = train(b, resume="latest")
        assert whole.result is not None and resumed.result is not None
        same = all(
            torch.equal(x, y)
            for x, y in zip(
                whole.settings.model.state_dict().values(),
                resumed.settings.model.state_dict().values(),
                strict=True,
            )
        )
        metrics = whole.result.train_metrics
        print(
            f"gan: {whole.result.steps} steps, d_loss {metrics['d_loss']:.3f}, "
            f"lr/g {metrics['lr/g']:g}, resumed at step {STOP_AT} bit-identical: {same}"
        )


if __name__ == "__main__":
    main()

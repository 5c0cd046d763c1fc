"""Gradient accumulation weighed by items (``accumulate_by``): with ``"items"`` the gradient of
one accumulated step of padded token batches equals the gradient of one batch of the same
samples; with the default ``"batches"`` it does not (each micro-batch weighs the same)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from trainbus import Accumulate, ConfigError, TrainContext, Trainer, TrainingError
from trainbus import events as ev
from trainbus.testing import EventRecorder

VOCAB = 11


class TokenModel(torch.nn.Module):
    """Embedding + linear; with ``labels`` (a mapping batch) returns the token-level loss."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(VOCAB, 8)
        self.out = torch.nn.Linear(8, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        logits = self.out(self.emb(input_ids))
        if labels is None:
            return logits
        return {"loss": token_loss(logits, labels), "logits": logits}


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the tokens whose label is not -100."""
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)


def padded(lengths: list[int], seed: int) -> dict[str, torch.Tensor]:
    """A batch of sequences of ``lengths`` padded to the longest (labels -100 on padding)."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    labels = torch.full((len(lengths), width), -100, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, :n] = torch.randint(1, VOCAB, (n,), generator=g)
        labels[row, :n] = torch.randint(0, VOCAB, (n,), generator=g)
    return {"input_ids": ids, "labels": labels}


# Two micro-batches of very different token counts (3 + 2 against 9 + 8).
MICRO = [padded([3, 2], seed=1), padded([9, 8], seed=2)]


def whole_batch_grads() -> list[torch.Tensor]:
    """The gradient of one batch holding both micro-batches' samples (padded to one width)."""
    model = TokenModel()
    width = max(b["input_ids"].shape[1] for b in MICRO)
    ids = torch.cat([F.pad(b["input_ids"], (0, width - b["input_ids"].shape[1])) for b in MICRO])
    labels = torch.cat([F.pad(b["labels"], (0, width - b["labels"].shape[1]), value=-100)
                        for b in MICRO])  # fmt: skip
    model(ids, labels)["loss"].backward()
    return [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]


def accumulated_grads(data: list[Any], **options: Any) -> tuple[list[torch.Tensor], Trainer]:
    """The gradient a Trainer holds before its first optimizer step (``accumulate=2``)."""
    model = TokenModel()
    grads: list[torch.Tensor] = []

    def keep(ctx: Any) -> None:
        grads.extend(p.grad.clone() for p in ctx.model.parameters())

    options.setdefault("accumulate", 2)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), data, max_steps=1,
                      progress=False, attach=False, device="cpu", **options)  # fmt: skip
    trainer.add_hook("before_optimizer_step", keep)
    trainer.fit_sync()
    return grads, trainer


def test_items_weighing_gives_the_whole_batch_gradient() -> None:
    want = whole_batch_grads()
    got, _ = accumulated_grads(MICRO, accumulate=Accumulate(2, by="items"))
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)


def test_batches_weighing_is_the_default_and_differs() -> None:
    want = whole_batch_grads()
    got, _ = accumulated_grads(MICRO)
    # Each micro-batch's mean loss divided by 2: the short one's tokens weigh more.
    assert not all(torch.allclose(g, w, rtol=1e-3, atol=1e-5)
                   for g, w in zip(got, want, strict=True))  # fmt: skip
    same, _ = accumulated_grads(MICRO, accumulate=Accumulate(2, by="batches"))
    for a, b in zip(got, same, strict=True):
        assert torch.equal(a, b)


def test_loss_fn_batches_and_a_counting_function() -> None:
    """``(inputs, targets)`` batches with ``loss_fn`` are counted on their targets; a user's
    ``fn(batch) -> int`` counts the same and gives the same gradient."""
    want = whole_batch_grads()
    pairs = [(b["input_ids"], b["labels"]) for b in MICRO]
    got, _ = accumulated_grads(pairs, accumulate=Accumulate(2, by="items"), loss_fn=token_loss)
    counted: list[int] = []

    def count(batch: Any) -> int:
        counted.append(int((batch[1] != -100).sum()))
        return counted[-1]

    mine, _ = accumulated_grads(pairs, accumulate=Accumulate(2, by=count), loss_fn=token_loss)
    assert counted == [5, 17]
    for g, m, w in zip(got, mine, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)
        assert torch.equal(g, m)


class CausalLM(TokenModel):
    """A Hugging Face style causal LM: ``labels`` are the inputs, shifted inside the loss."""

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        logits = self.out(self.emb(input_ids))
        assert labels is not None
        return {"loss": token_loss(logits[:, :-1], labels[:, 1:]), "logits": logits}


def causal(lengths: list[int], seed: int, width: int) -> dict[str, torch.Tensor]:
    """A padding collate's batch of a causal LM: labels = input_ids, -100 on padding."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (len(lengths), width), generator=g)
    labels = ids.clone()
    for row, n in enumerate(lengths):
        labels[row, n:] = -100
    return {"input_ids": ids, "labels": labels}


def next_tokens(batch: dict[str, torch.Tensor]) -> int:
    """The items a causal LM's loss averages over: the labels after the first position."""
    return int((batch["labels"][..., 1:] != -100).sum())


def test_a_causal_lm_counts_its_shifted_labels() -> None:
    """A loss that shifts its labels averages over one item fewer per sequence than
    ``"items"`` counts: the counting function docs/trainer.md gives for it is exact."""
    micro = [causal([3, 2], seed=1, width=9), causal([9, 8], seed=2, width=9)]

    def grads(data: list[Any], accumulate: int, by: Any) -> list[torch.Tensor]:
        model = CausalLM()
        kept: list[torch.Tensor] = []
        trainer = Trainer(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            data,
            max_steps=1,
            accumulate=Accumulate(accumulate, by=by),
            progress=False,
            attach=False,
            device="cpu",
        )
        trainer.add_hook(
            "before_optimizer_step",
            lambda ctx: kept.extend(p.grad.clone() for p in ctx.model.parameters()),
        )
        trainer.fit_sync()
        return kept

    whole = grads([{k: torch.cat([b[k] for b in micro]) for k in micro[0]}], 1, "batches")
    for g, w in zip(grads(micro, 2, next_tokens), whole, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)
    assert not all(torch.allclose(g, w, rtol=1e-3, atol=1e-5)
                   for g, w in zip(grads(micro, 2, "items"), whole, strict=True))  # fmt: skip


def test_step_loss_is_the_windows_token_mean() -> None:
    """``StepEnded.loss`` is the loss one batch of the step's tokens reports; each micro-batch's
    loss (what the ``loss`` hook sees) is its own mean."""
    model = TokenModel()
    width = max(b["input_ids"].shape[1] for b in MICRO)
    with torch.no_grad():
        whole = model(
            torch.cat([F.pad(b["input_ids"], (0, width - b["input_ids"].shape[1]))
                       for b in MICRO]),
            torch.cat([F.pad(b["labels"], (0, width - b["labels"].shape[1]), value=-100)
                       for b in MICRO]),
        )["loss"]  # fmt: skip
        micro = [model(**b)["loss"] for b in MICRO]
    model = TokenModel()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), MICRO, max_steps=1,
                      accumulate=Accumulate(2, by="items"), progress=False, attach=False,
                      device="cpu")  # fmt: skip
    rec = EventRecorder(trainer.bus)
    losses: list[torch.Tensor] = []
    trainer.add_hook("loss", lambda ctx: losses.append(ctx.loss.detach()))
    trainer.fit_sync()
    (ended,) = rec.of_type(ev.StepEnded)
    torch.testing.assert_close(torch.as_tensor(ended.loss), whole)
    torch.testing.assert_close(torch.stack(losses), torch.stack(micro))


def test_a_short_last_window_and_a_window_of_one() -> None:
    """Three batches with ``accumulate=2``: the epoch's last step holds one batch, weighed 1
    (its gradient is its own mean loss's)."""
    third = padded([4, 1], seed=3)
    got, _ = accumulated_grads([*MICRO, third], accumulate=Accumulate(2, by="items"), max_epochs=1)
    assert got  # the first step's gradient; the run trained two steps
    model = TokenModel()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    t = Trainer(
        model,
        sgd,
        [*MICRO, third],
        max_epochs=1,
        accumulate=Accumulate(2, by="items"),
        progress=False,
        attach=False,
        device="cpu",
    )
    grads: list[list[torch.Tensor]] = []
    t.add_hook(
        "before_optimizer_step",
        lambda ctx: grads.append([p.grad.clone() for p in ctx.model.parameters()]),
    )
    result = t.fit_sync()
    assert result.steps == 2
    # Replay: the weights after step 1, then the third batch alone.
    ref = TokenModel()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for p, g in zip(ref.parameters(), grads[0], strict=True):
        p.grad = g.clone()
    ref_opt.step()
    ref_opt.zero_grad()
    ref(**third)["loss"].backward()
    for g, p in zip(grads[1], ref.parameters(), strict=True):
        torch.testing.assert_close(g, p.grad)


def test_bad_values() -> None:
    for bad in ("tokens", 3, None, int):
        with pytest.raises(ConfigError, match=r"^Accumulate\.by=.*'batches', 'items'"):
            Accumulate(2, by=bad)


def test_items_of_a_batch_without_labels_is_a_clear_error() -> None:
    model = TokenModel()
    data = [{"input_ids": b["input_ids"]} for b in MICRO]

    class Lossy(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = model

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            return self.inner(input_ids).mean()

    lossy = Lossy()
    trainer = Trainer(lossy, torch.optim.SGD(lossy.parameters(), lr=0.1), data, max_steps=1,
                      accumulate=Accumulate(2, by="items"), progress=False, attach=False,
                      device="cpu")  # fmt: skip
    with pytest.raises(TrainingError, match=r"no labels tensor.*Accumulate\(n, by=fn\)"):
        trainer.fit_sync()

    trainer = Trainer(lossy, torch.optim.SGD(lossy.parameters(), lr=0.1), data, max_steps=1,
                      accumulate=Accumulate(2, by=lambda batch: -1), progress=False,
                      attach=False, device="cpu")  # fmt: skip
    with pytest.raises(TrainingError, match="returned -1 for a batch"):
        trainer.fit_sync()


def test_a_custom_steps_backward_is_weighed_too() -> None:
    def step(ctx: TrainContext) -> torch.Tensor:
        loss = ctx.model(**ctx.batch)["loss"]
        ctx.backward(loss)
        ctx.optimizer_step()
        return loss

    want = whole_batch_grads()
    got, _ = accumulated_grads(MICRO, accumulate=Accumulate(2, by="items"), train_step=step)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)


def test_a_scheduler_that_counted_batches_is_told_how_many_steps_an_epoch_has() -> None:
    """OneCycleLR's total_steps counted from batches // accumulate: the last short step of
    each epoch overruns it, and the error says how trainbus steps the scheduler."""
    import pytest
    import torch.nn.functional as F

    from trainbus import Trainer
    from trainbus.testing import tiny_loader, tiny_model

    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = tiny_loader(6)  # 6 batches, accumulate=4: 2 steps an epoch, the second short
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=(6 // 4) * 2)
    trainer = Trainer(model, opt, data, loss_fn=F.cross_entropy, scheduler=sched, accumulate=4,
                      max_epochs=2, progress=False)  # fmt: skip
    with pytest.raises(ValueError, match="Tried to step") as info:
        trainer.fit_sync()
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "steps once per optimizer step (here step 3, epoch 1): 2 per epoch" in notes

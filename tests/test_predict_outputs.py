"""Prediction on Hugging Face-style outputs (issue 22 item 6): a scalar loss, a
``ModelOutput`` or a mapping join per key and keep the type users index; batches may carry
labels; streamed ``PredictionBatchEnded.outputs`` keep the type too."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, NamedTuple

import pytest
import torch
import torch.nn.functional as F

from trainbus import Trainer
from trainbus import events as ev
from trainbus.loop.outputs import join_outputs
from trainbus.testing import tiny_loader, tiny_model


class Pair(NamedTuple):
    logits: torch.Tensor
    loss: torch.Tensor


class DictLossModel(torch.nn.Module):
    """Returns ``{"loss": scalar, "logits": ...}`` (an OrderedDict) from a labelled dict batch."""

    def __init__(self) -> None:
        super().__init__()
        self.net = tiny_model()

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> OrderedDict[str, torch.Tensor]:
        logits = self.net(x)
        return OrderedDict(loss=F.cross_entropy(logits, labels), logits=logits)


def _dict_batches(n: int) -> list[dict[str, torch.Tensor]]:
    return [{"x": x, "labels": y} for x, y in tiny_loader(n, 4)]


def test_outputs_with_a_scalar_loss_join_per_key_one_loss_per_batch() -> None:
    model = DictLossModel()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), _dict_batches(3),
                      max_steps=1, progress=False)  # fmt: skip
    streamed: list[Any] = []
    trainer.bus.subscribe(trainer.bus.stream(ev.PredictionBatchEnded),
                          lambda e: streamed.append(e.outputs), on_error="raise")  # fmt: skip
    out = trainer.predict_sync(_dict_batches(3), return_outputs=True)
    assert type(out) is OrderedDict and list(out) == ["loss", "logits"]
    assert out["logits"].shape == (12, 10) and out["loss"].shape == (3,)
    assert [type(o) for o in streamed] == [OrderedDict] * 3
    # predict returns its outputs on the host; the events carry them on the run's device.
    assert torch.equal(out["loss"], torch.stack([o["loss"] for o in streamed]).cpu())


def test_join_keeps_named_tuples_and_mapping_types() -> None:
    batches = [Pair(torch.ones(2, 3) * i, torch.tensor(float(i))) for i in range(3)]
    joined = join_outputs(batches)
    assert type(joined) is Pair
    assert joined.logits.shape == (6, 3) and joined.loss.tolist() == [0.0, 1.0, 2.0]
    mixed = join_outputs([{"a": torch.ones(2)}, {"b": torch.ones(2)}])
    assert isinstance(mixed, list) and len(mixed) == 2  # keys differ: the list per batch


def test_plain_tensor_outputs_still_concatenate() -> None:
    model = tiny_model()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_loader(2, 4),
                      loss_fn=F.cross_entropy, max_steps=1, progress=False)  # fmt: skip
    out = trainer.predict_sync(tiny_loader(3, 4), return_outputs=True)
    assert isinstance(out, torch.Tensor) and out.shape == (12, 10)


@pytest.mark.slow
@pytest.mark.timeout(600)  # importing transformers takes over a minute on a loaded machine
def test_a_transformers_model_output_keeps_its_type_and_logits() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=50, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=16, max_position_embeddings=16, num_labels=3,
    )  # fmt: skip
    model = transformers.BertForSequenceClassification(config)
    batches = [{"input_ids": torch.randint(0, 50, (4, 6)), "labels": torch.randint(0, 3, (4,))}
               for _ in range(3)]  # fmt: skip
    trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), batches,
                      max_steps=2, progress=False)  # fmt: skip
    trainer.fit_sync()  # trains on the labelled batches: the model returns the loss
    streamed: list[Any] = []

    def on_batch(event: ev.PredictionBatchEnded) -> None:
        streamed.append(event.outputs.logits.argmax(-1))  # what users write: .logits

    trainer.bus.subscribe(trainer.bus.stream(ev.PredictionBatchEnded), on_batch,
                          on_error="raise")  # fmt: skip
    out = trainer.predict_sync(batches, return_outputs=True)
    assert isinstance(out, transformers.modeling_outputs.SequenceClassifierOutput)
    assert out.logits.shape == (12, 3) and out.loss.shape == (3,)
    assert torch.equal(out.logits.argmax(-1), torch.cat(streamed).cpu())  # host vs device
    model.eval()
    device = next(model.parameters()).device  # the run's device
    with torch.no_grad():
        expected = torch.cat(
            [model(**{k: v.to(device) for k, v in b.items()}).logits.cpu() for b in batches]
        )
    torch.testing.assert_close(out.logits, expected)

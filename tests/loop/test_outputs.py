"""Prediction on Hugging Face-style outputs: a scalar loss, a
``ModelOutput`` or a mapping join per key and keep the type users index; batches may carry
labels; streamed ``PredictionBatchEnded.outputs`` keep the type too."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, NamedTuple

import pytest
import torch
import torch.nn.functional as F

from trainbus import ConfigError, Trainer, TrainingError
from trainbus import events as ev
from trainbus._loop.outputs import KeptOutputs, PadValues, join_outputs
from trainbus.testing import EventRecorder, tiny_loader, tiny_model


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


# ---------------------------------------------------------------- batches padded per batch
VOCAB = 7


class TokenModel(torch.nn.Module):
    """A token classifier over ``{"input_ids", "labels"}`` batches: ``{"loss", "logits"
    [B, T, V], "tokens" [B, T] (int64), "mask" [B, T] (uint8)}``. ``squeeze`` reproduces a
    common slip: ``logits.squeeze()`` drops T when a batch's sequences have length 1."""

    def __init__(self, squeeze: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(VOCAB, 4)
        self.head = torch.nn.Linear(4, VOCAB)
        self.squeeze = squeeze

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.head(self.emb(input_ids))
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        if self.squeeze:
            logits = logits.squeeze(1)
        return {"loss": loss, "logits": logits, "tokens": input_ids,
                "mask": (labels != -100).to(torch.uint8)}  # fmt: skip


class Sequences(torch.utils.data.Dataset[torch.Tensor]):
    """Token sequences of the given lengths (map-style)."""

    def __init__(self, lengths: list[int]) -> None:
        g = torch.Generator().manual_seed(1)
        self.items = [torch.randint(1, VOCAB, (n,), generator=g) for n in lengths]
        self.collated = 0

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.items[i]

    def collate(self, seqs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Pad to the batch's longest sequence (0 for ids, -100 for labels), as HF collates."""
        self.collated += 1
        ids = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=0)
        labels = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=-100)
        return {"input_ids": ids, "labels": labels}


def _loader(data: Sequences) -> torch.utils.data.DataLoader[Any]:
    return torch.utils.data.DataLoader(data, batch_size=2, collate_fn=data.collate)


def _token_trainer(model: TokenModel) -> Trainer:
    data = Sequences([3, 3])
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), _loader(data),
                   max_steps=1, progress=False, on_signal=None)  # fmt: skip


def test_outputs_of_batches_padded_per_batch_are_padded_to_the_longest() -> None:
    model = TokenModel()
    trainer = _token_trainer(model)
    data = Sequences([2, 3, 5, 5, 4, 1])  # batches of T = 3, 5, 4
    out = trainer.predict_sync(_loader(data), return_outputs=True)
    assert out["logits"].shape == (6, 5, VOCAB) and out["tokens"].shape == (6, 5)
    assert out["loss"].shape == (3,) and out["logits"].dtype == torch.float32
    model.eval()
    with torch.no_grad():
        for b, batch in enumerate(_loader(data)):
            rows, t = slice(2 * b, 2 * b + 2), batch["input_ids"].shape[1]
            expected = model(**batch)
            assert torch.equal(out["logits"][rows, :t], expected["logits"])
            assert torch.equal(out["tokens"][rows, :t], batch["input_ids"])
            # Past the batch's own length: Hugging Face's -100, for floats and ints alike;
            # 0 for the unsigned mask (-100 does not fit in uint8).
            assert bool((out["logits"][rows, t:] == -100).all())
            assert bool((out["tokens"][rows, t:] == -100).all())
            assert bool((out["mask"][rows, t:] == 0).all())
    # The mask covers each sequence's own tokens, the collate's padding and predict's alike.
    assert int(out["mask"].sum()) == 2 + 3 + 5 + 5 + 4 + 1


def test_pad_values_per_key_and_dtype() -> None:
    trainer = _token_trainer(TokenModel())
    out = trainer.predict_sync(
        _loader(Sequences([2, 2, 4, 3])), return_outputs=True,
        pad_value={"logits": float("nan"), torch.int64: 0, torch.uint8: 255},
    )  # fmt: skip
    assert bool(out["logits"][:2, 2:].isnan().all()) and not out["logits"][:, :2].isnan().any()
    assert out["tokens"][:2, 2:].eq(0).all() and out["mask"][:2, 2:].eq(255).all()
    one = trainer.predict_sync(_loader(Sequences([2, 2, 4, 3])), return_outputs=True,
                               pad_value=7)  # fmt: skip
    assert one["logits"][:2, 2:].eq(7).all() and one["tokens"][:2, 2:].eq(7).all()
    assert one["mask"][:2, 2:].eq(7).all()


def test_outputs_padding_cannot_join_fail_at_that_batch_naming_key_and_shapes() -> None:
    trainer = _token_trainer(TokenModel(squeeze=True))
    data = Sequences([2, 3, 4, 4, 1, 1, 5, 5, 5, 5])  # batch 2 has T = 1: squeeze drops it
    rec = EventRecorder(trainer.bus, trainer.bus.stream(ev.PredictionBatchEnded,
                                                         ev.PredictionEnded))  # fmt: skip
    with pytest.raises(TrainingError) as info:
        trainer.predict_sync(_loader(data), return_outputs=True)
    message = str(info.value)
    assert "outputs['logits']" in message and "batch 2" in message
    assert f"shape (2, {VOCAB}), torch.float32" in message  # the mismatching batch's
    assert f"shape (2, 3, {VOCAB}), torch.float32" in message  # the first batch's
    # Raised at batch 2, not after the pass: the loader was not read further.
    assert data.collated == 3
    assert [e.batch_index for e in rec.of_type(ev.PredictionBatchEnded)] == [0, 1]
    (ended,) = rec.of_type(ev.PredictionEnded)
    assert ended.error is info.value
    # Without return_outputs nothing is joined, so nothing is refused.
    assert trainer.predict_sync(_loader(data)) is None


@pytest.mark.parametrize(
    ("pad_value", "pattern"),
    [
        ({torch.uint8: -100}, r"^pad_value\[torch\.uint8\]=-100 is invalid: a value torch\.uint8"),
        ({torch.int64: 0.5}, r"^pad_value\[torch\.int64\]=0\.5 is invalid"),
        ({torch.bool: -100}, r"^pad_value\[torch\.bool\]=-100 is invalid"),
        ({torch.float16: 1e6}, r"^pad_value\[torch\.float16\]=1000000\.0 is invalid"),
        ("0", r"^pad_value='0' is invalid: a number or a bool"),
        ({3: 0}, r"^pad_value=3 is invalid: keys that are output keys"),
        (
            {"logit": 0.0},
            r"^pad_value\['logit'\]=0\.0 is invalid: keys of the outputs "
            r"\(logits, loss, mask, tokens\)",
        ),
        (
            -100,
            r"^pad_value=-100 is invalid: a value torch\.uint8 can hold \(output 'mask' "
            r"is torch\.uint8\)",
        ),
        (
            float("inf"),
            r"^pad_value=inf is invalid: a value torch\.int64 can hold \(output "
            r"'tokens'",
        ),
        ({"tokens": 2.5}, r"^pad_value\['tokens'\]=2\.5 is invalid: a value torch\.int64"),
    ],
)
def test_a_pad_value_the_dtype_cannot_hold_is_a_config_error(pad_value: Any, pattern: str
                                                             ) -> None:  # fmt: skip
    trainer = _token_trainer(TokenModel())
    rec = EventRecorder(trainer.bus, trainer.bus.stream(ev.PredictionBatchEnded))
    with pytest.raises(ConfigError, match=pattern):
        trainer.predict_sync(_loader(Sequences([2, 2, 4, 4, 3, 3])), return_outputs=True,
                             pad_value=pad_value)  # fmt: skip
    # Refused before the pass (a bad value or key), or at the first batch needing a pad.
    assert len(rec.of_type(ev.PredictionBatchEnded)) <= 1


def test_a_pad_no_output_needs_is_not_refused() -> None:
    # 1-D outputs never pad: -100 for a bool per-sample flag is never used, so never refused.
    flags = [torch.tensor([True, False]), torch.tensor([False])]
    joined = join_outputs(flags, PadValues.check(-100))
    assert joined.tolist() == [True, False, False]


@pytest.mark.timeout(600)  # importing transformers takes over a minute on a loaded machine
def test_a_causal_lms_cache_is_dropped_as_its_config_says() -> None:
    """A GPT-2 returns its key-value ``cache`` (an object per batch, on the device) beside its
    logits; predict drops it from what it keeps and publishes, as Hugging Face's own predict
    does (a config's ``keys_to_ignore_at_inference``, else ``["cache"]``); ``ignore_keys``
    says otherwise."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=40, n_positions=16, n_embd=8, n_layer=1,
                                     n_head=2)  # fmt: skip
    model = transformers.GPT2LMHeadModel(config)
    batches = [{"input_ids": torch.randint(0, 40, (2, n))} for n in (5, 7, 6)]
    trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), batches,
                      max_steps=1, progress=False, device="cpu")  # fmt: skip
    streamed: list[Any] = []
    trainer.bus.subscribe(trainer.bus.stream(ev.PredictionBatchEnded),
                          lambda e: streamed.append(set(e.outputs)),
                          on_error="raise")  # fmt: skip
    out = trainer.predict_sync(batches, return_outputs=True)
    assert set(out) == {"logits"} and out.logits.shape == (6, 7, 40)
    assert streamed == [{"logits"}] * 3
    kept = trainer.predict_sync(batches, return_outputs=True, ignore_keys=[])
    assert "cache" in kept  # one cache object per batch, as asked
    with pytest.raises(ConfigError, match="ignore_keys"):
        trainer.predict_sync(batches, ignore_keys="cache")


# predict(return_outputs=True) keeps outputs on the host as they come (KeptOutputs): pinned,
# non-blocking copies on CUDA, one wait at the end, concatenated on the host.
def host_trainer(device: str) -> Trainer:
    model = tiny_model()
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_loader(2),
                   loss_fn=F.cross_entropy, max_steps=1, device=device, progress=False,
                   on_signal=None)  # fmt: skip


def test_host_outputs_keep_cpu_tensors_and_structures_without_waiting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    waits: list[Any] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waits.append(device))
    kept = KeptOutputs(PadValues(), torch.device("cpu"))
    a, b = torch.ones(2, 3), torch.zeros(1)
    kept.add({"logits": a, "extra": (b, "name")}, 0)
    kept.add([a, 3], 1)
    out = kept.batches()
    assert out[0]["logits"] is a and out[0]["extra"][0] is b and out[0]["extra"][1] == "name"
    assert out[1][0] is a and out[1][1] == 3
    assert waits == []  # nothing was queued: no device wait


def test_predict_returns_host_outputs_joined_on_the_host() -> None:
    data = tiny_loader(3, batch_size=4)
    out = host_trainer("cpu").predict_sync(data, return_outputs=True)
    assert out.device.type == "cpu" and out.shape == (12, 10)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_predict_outputs_come_back_pinned_on_the_host() -> None:
    t = host_trainer("cuda")
    data = tiny_loader(3, batch_size=4)
    kept = KeptOutputs(PadValues(), torch.device("cuda", torch.cuda.current_device()))
    on_device = torch.randn(4, 10, device="cuda")
    kept.add(on_device, 0)
    (copy,) = kept.batches()
    assert copy.device.type == "cpu" and copy.is_pinned() and torch.equal(copy, on_device.cpu())
    out = t.predict_sync(data, return_outputs=True)
    assert out.device.type == "cpu" and out.shape == (12, 10)

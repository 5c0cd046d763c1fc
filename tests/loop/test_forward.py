"""What a ``metrics=`` function receives as targets: tuple batches, mapping batches, others."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from trainbus import Trainer, TrainingError
from trainbus._loop.forward import metric_targets
from trainbus.testing import tiny_model


def _batches(n: int = 2, *, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 32, generator=gen), torch.randint(0, 10, (8,), generator=gen))
            for _ in range(n)]  # fmt: skip


class HFStyle(torch.nn.Module):
    """``model(**batch)`` returning a mapping with ``loss`` and ``logits`` (Hugging Face)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = tiny_model()

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.net(inputs)
        return {"loss": F.cross_entropy(logits, labels), "logits": logits}


def test_metric_targets_by_batch_kind() -> None:
    x, y = torch.zeros(2, 3), torch.tensor([1, 2])
    assert metric_targets((x, y)) is y
    assert metric_targets([x, y]) is y
    assert metric_targets({"inputs": x, "labels": y}) is y
    assert metric_targets(x) is x
    with pytest.raises(TrainingError, match=r"labels.*\['inputs', 'mask'\]"):
        metric_targets({"inputs": x, "mask": y})


def _accuracy_seen(seen: list[Any]) -> Any:
    def acc(outputs: Any, targets: Any) -> torch.Tensor:
        seen.append(targets)
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs
        return (logits.argmax(-1) == targets).float().mean()

    return acc


def test_tuple_batches_give_the_targets() -> None:
    seen: list[Any] = []
    model = tiny_model()
    data = _batches()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
                      loss_fn=F.cross_entropy, eval_data=data, max_epochs=1, device="cpu",
                      metrics={"acc": _accuracy_seen(seen)}, on_signal=None,
                      progress=False)  # fmt: skip
    result = trainer.fit_sync()
    assert [t.tolist() for t in seen] == [y.tolist() for _, y in data]
    assert 0.0 <= result.eval_metrics["val_acc"] <= 1.0


def test_mapping_batches_give_the_labels() -> None:
    seen: list[Any] = []
    model = HFStyle()
    data = [{"inputs": x, "labels": y} for x, y in _batches()]
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), data, eval_data=data,
                      max_epochs=1, device="cpu", metrics={"acc": _accuracy_seen(seen)},
                      on_signal=None, progress=False)  # fmt: skip
    result = trainer.fit_sync()
    assert [t.tolist() for t in seen] == [b["labels"].tolist() for b in data]
    with torch.no_grad():
        expected = sum(
            float((model(**b)["logits"].argmax(-1) == b["labels"]).float().mean()) for b in data
        ) / len(data)
    assert result.eval_metrics["val_acc"] == pytest.approx(expected)


def test_mapping_batch_without_labels_fails_the_evaluation() -> None:
    class Keyed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = tiny_model()

        def forward(self, inputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(self.net(inputs), target)

    model = Keyed()
    data = [{"inputs": x, "target": y} for x, y in _batches(1)]
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), data, eval_data=data,
                      max_epochs=1, device="cpu", metrics={"acc": lambda o, t: 1.0},
                      on_signal=None, progress=False)  # fmt: skip
    with pytest.raises(TrainingError, match="labels"):
        trainer.fit_sync()


def test_a_logits_model_without_loss_fn_is_told_to_pass_one() -> None:
    """The model gets the whole (inputs, targets) batch without loss_fn: its TypeError says so."""
    model = tiny_model()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), _batches(),
                      max_steps=1, progress=False)  # fmt: skip
    with pytest.raises(TypeError) as info:
        trainer.fit_sync()
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "without loss_fn the model is called with the whole batch (a tuple of 2)" in notes
    assert "pass loss_fn=" in notes


class Unpacking(torch.nn.Module):
    """Takes the whole ``(inputs, targets)`` batch and returns logits, not a loss."""

    def __init__(self) -> None:
        super().__init__()
        self.net = tiny_model()

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.net(batch[0])


def test_a_model_returning_logits_without_loss_fn_is_told_to_pass_one() -> None:
    model = Unpacking()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), _batches(),
                      max_steps=1, progress=False)  # fmt: skip
    with pytest.raises(TrainingError, match=r"shape \(8, 10\).*Without loss_fn the model must "
                       r"return the loss: pass loss_fn="):  # fmt: skip
        trainer.fit_sync()

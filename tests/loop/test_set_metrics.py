"""Metrics of the whole evaluation set (``set_metrics=``): perplexity and token accuracy over a
real ``DataLoader`` of padded token batches join ``EvaluationEnded.metrics``, the loggers and
what ``EarlyStopping`` may monitor; a metric that raises is counted and reported, and the run
goes on."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from structlog.testing import capture_logs
from torch.utils.data import DataLoader

from trainbus import ConfigError, EvalSchedule, Perplexity, SetMetric, TokenAccuracy, Trainer
from trainbus import events as ev
from trainbus._distributed.sync import add_totals
from trainbus.callbacks import EarlyStopping, JsonlEventLog
from trainbus.testing import EventRecorder

VOCAB = 13


class TokenModel(torch.nn.Module):
    """Embedding + linear: ``(ids) -> logits (batch, length, vocab)``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(VOCAB, 8)
        self.out = torch.nn.Linear(8, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(ids))


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)


def samples(n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Sequences of lengths 1 to 9 (ids, labels)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(1, 10, (1,), generator=g))
        out.append((torch.randint(0, VOCAB, (length,), generator=g),
                    torch.randint(0, VOCAB, (length,), generator=g)))  # fmt: skip
    return out


def pad(batch: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The usual padding collate: to the batch's longest, labels -100 on the padding."""
    width = max(len(ids) for ids, _ in batch)
    ids = torch.stack([F.pad(i, (0, width - len(i))) for i, _ in batch])
    labels = torch.stack([F.pad(y, (0, width - len(y)), value=-100) for _, y in batch])
    return ids, labels


def loader(n: int, seed: int) -> DataLoader[Any]:
    return DataLoader(samples(n, seed), batch_size=3, collate_fn=pad)


def by_hand(model: torch.nn.Module, data: DataLoader[Any]) -> tuple[float, float]:
    """(perplexity, token accuracy) of ``data``: total loss over total tokens."""
    nll = correct = tokens = 0.0
    with torch.no_grad():
        for ids, labels in data:
            logits = model(ids).reshape(-1, VOCAB)
            flat, mask = labels.reshape(-1), labels.reshape(-1) != -100
            nll += float(F.cross_entropy(logits, flat, ignore_index=-100, reduction="sum"))
            correct += float(((logits.argmax(-1) == flat) & mask).sum())
            tokens += float(mask.sum())
    return math.exp(nll / tokens), correct / tokens


def trainer(**options: Any) -> Trainer:
    model = TokenModel()
    options.setdefault("eval_data", loader(10, seed=2))
    options.setdefault("max_steps", 4)
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.5), loader(12, seed=1),
                   loss_fn=token_loss, progress=False, attach=False, device="cpu",
                   **options)  # fmt: skip


def test_perplexity_and_token_accuracy_join_the_metrics_and_the_loggers(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    t = trainer(
        set_metrics={"ppl": Perplexity(), "tok_acc": TokenAccuracy()},
        eval_schedule=EvalSchedule(every_steps=2, epoch_end=False),
        callbacks=[JsonlEventLog(path, events=(ev.EvaluationEnded,))],
    )
    rec = EventRecorder(t.bus)
    result = t.fit_sync()
    ends = rec.of_type(ev.EvaluationEnded)
    assert [e.step for e in ends] == [2, 4]
    # The final weights: the last evaluation's values are the whole set's, not batch means.
    ppl, acc = by_hand(t.settings.model, loader(10, seed=2))
    last = ends[-1].metrics
    assert set(last) == {"val_loss", "val_ppl", "val_tok_acc"}
    assert last["val_ppl"] == pytest.approx(ppl, rel=1e-9)
    assert last["val_tok_acc"] == pytest.approx(acc, rel=1e-12)
    # val_loss is the sample mean of batch means: not the token mean the perplexity uses.
    assert math.exp(last["val_loss"]) != pytest.approx(ppl, rel=1e-6)
    assert result.eval_metrics["val_ppl"] == last["val_ppl"]
    assert result.metric_failures == {}
    logged = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["metrics"]["val_ppl"] for r in logged] == [e.metrics["val_ppl"] for e in ends]


def test_named_sets_get_their_own_keys() -> None:
    t = trainer(eval_data={"val": loader(6, seed=2), "test": loader(5, seed=3)},
                set_metrics={"ppl": Perplexity()}, max_steps=1)  # fmt: skip
    result = t.fit_sync()
    assert set(result.eval_metrics) == {"val/loss", "val/ppl", "test/loss", "test/ppl"}
    assert result.eval_metrics["test/ppl"] == pytest.approx(
        by_hand(t.settings.model, loader(5, seed=3))[0], rel=1e-9
    )


def test_early_stopping_monitors_a_set_metric() -> None:
    # Accepted up front (the name is declared), and it decides on it: an improvement smaller
    # than min_delta is none, so with patience 1 the second evaluation stops the run.
    stopper = EarlyStopping(monitor="val_ppl", patience=1, min_delta=1e6)
    t = trainer(
        set_metrics={"ppl": Perplexity()},
        eval_schedule=EvalSchedule(every_steps=1, epoch_end=False),
        max_steps=8,
        callbacks=[stopper],
    )
    result = t.fit_sync()
    assert result.reason == "stopped" and result.steps == 2
    assert "val_ppl" in (result.stop_reason or "")
    with pytest.raises(ConfigError, match="val_nope"):
        trainer(set_metrics={"ppl": Perplexity()}, callbacks=[EarlyStopping(monitor="val_nope")]
                ).fit_sync()  # fmt: skip


class Fails:
    """A set metric whose ``update`` or ``compute`` raises."""

    def __init__(self, where: str) -> None:
        self.where = where

    def update(self, outputs: Any, targets: Any) -> dict[str, float]:
        if self.where == "update":
            raise ValueError("update broke")
        return {"n": float(len(targets))}

    def compute(self, totals: Any) -> float:
        if self.where == "compute":
            raise ZeroDivisionError("compute broke")
        return float(totals["n"])


def test_a_raising_metric_is_counted_and_reported_and_the_run_goes_on() -> None:
    assert isinstance(Fails("update"), SetMetric)
    t = trainer(
        set_metrics={
            "bad_update": Fails("update"),
            "bad_compute": Fails("compute"),
            "n": Fails("never"),
            "ppl": Perplexity(),
        },
        eval_schedule=EvalSchedule(every_steps=1, epoch_end=False),
        max_steps=3,
    )
    rec = EventRecorder(t.bus)
    with capture_logs() as logs:
        result = t.fit_sync()
    assert result.reason == "completed" and result.steps == 3
    ends = rec.of_type(ev.EvaluationEnded)
    assert len(ends) == 3
    for e in ends:
        assert set(e.metrics) == {"val_loss", "val_n", "val_ppl"}
        assert e.metrics["val_n"] == 10.0  # the other metrics of the set are whole
    assert result.metric_failures == {"bad_update": 3, "bad_compute": 3}
    failed = [e for e in logs if e["event"] == "set_metric_failed"]
    # The first failure of each metric is logged with its traceback; repeats are counted only.
    assert len(failed) == 2
    assert {e["metric"] for e in failed} == {"bad_update", "bad_compute"}
    text = "\n".join(e["error"] for e in failed)
    assert "update broke" in text and "compute broke" in text
    assert all(e.get("exc_info") for e in failed)


def test_standalone_evaluate_has_the_set_metrics() -> None:
    t = trainer(set_metrics={"ppl": Perplexity()})
    metrics = t.evaluate_sync()
    assert metrics["val_ppl"] == pytest.approx(
        by_hand(t.settings.model, loader(10, seed=2))[0], rel=1e-9
    )


@pytest.mark.parametrize(
    ("value", "field"),
    [
        ({"ppl": lambda o, t: 0.0}, "set_metrics['ppl']"),
        ({"ppl": Perplexity}, "set_metrics['ppl']"),
        ({"not a name": Perplexity()}, "set_metrics['not a name']"),
        ([Perplexity()], "set_metrics"),
        ({"loss": Perplexity()}, "set_metrics['loss']"),
        ({"acc": Perplexity()}, "set_metrics['acc']"),
    ],
)
def test_bad_set_metrics_are_config_errors(value: Any, field: str) -> None:
    with pytest.raises(ConfigError, match="^" + re.escape(field)):
        trainer(set_metrics=value, metrics={"acc": lambda o, t: 0.0})


def test_the_ranks_totals_are_added_and_a_failure_anywhere_leaves_the_metric_out() -> None:
    rank0 = {"ppl": {"nll": 3.0, "tokens": 2.0}, "acc": {"correct": 1.0, "tokens": 2.0},
             "flaky": {"n": 1.0}, "odd": {"a": 1.0}}  # fmt: skip
    rank1 = {"ppl": {"nll": 5.0, "tokens": 6.0}, "acc": {"correct": 4.0, "tokens": 6.0},
             "flaky": None, "odd": {"b": 1.0}}  # fmt: skip
    out = add_totals([rank0, rank1], names=["ppl", "acc", "flaky", "odd"])
    assert out == {"ppl": {"nll": 8.0, "tokens": 8.0}, "acc": {"correct": 5.0, "tokens": 8.0},
                   "flaky": None, "odd": None}  # fmt: skip
    assert Perplexity().compute(out["ppl"] or {}) == pytest.approx(math.e)
    assert TokenAccuracy().compute(out["acc"] or {}) == 5 / 8


def test_shifted_labels_score_a_causal_lm() -> None:
    logits = torch.randn(2, 5, VOCAB)
    ids = torch.randint(0, VOCAB, (2, 5))
    ids[1, 3:] = -100
    sums = Perplexity(shift=True).update({"logits": logits}, ids)
    assert float(sums["tokens"]) == 4 + 2  # 4 predictions in row 0, 2 in row 1
    want = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1),
                           ignore_index=-100, reduction="sum")  # fmt: skip
    torch.testing.assert_close(sums["nll"], want)


def test_tensorboard_reads_the_set_metrics_back(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from trainbus.callbacks import TensorBoardLogger

    t = trainer(
        set_metrics={"ppl": Perplexity()},
        eval_schedule=EvalSchedule(every_steps=2, epoch_end=False),
        callbacks=[TensorBoardLogger(tmp_path / "tb", flush_s=0.05)],
    )
    rec = EventRecorder(t.bus)
    t.fit_sync()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    scalars = acc.Scalars("eval/val_ppl")
    assert [s.step for s in scalars] == [2, 4]
    want = [e.metrics["val_ppl"] for e in rec.of_type(ev.EvaluationEnded)]
    assert [s.value for s in scalars] == pytest.approx(want, rel=1e-6)  # stored as float32

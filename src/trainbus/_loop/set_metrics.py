"""Metrics of the whole evaluation set (``set_metrics=``): running sums on the device, read
once per set; a metric that raises is counted and left out (docs/trainer.md, "Metrics of the
whole set")."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from .._exceptions import TrainingError
from .._log import get_logger, worth_logging
from .forward import metric_targets

__all__ = ["MetricFailures", "Perplexity", "SetMetric", "SetTotals", "TokenAccuracy", "Totals"]

log = get_logger(__name__)

Totals = dict[str, dict[str, float] | None]  # per metric (None: it failed in this pass)


@runtime_checkable
class SetMetric(Protocol):
    """A metric of the whole evaluation set: the sums it needs per batch, and its value from
    the set's totals. It keeps no state, so one object serves every evaluation, set and rank."""

    def update(self, outputs: Any, targets: Any) -> Mapping[str, torch.Tensor | float]:
        """This batch's sums (scalars; tensors stay on the device), ``{name: sum}``: the same
        names for every batch.

        Args:
            outputs: What the model returned for the batch.
            targets: As for ``metrics=`` functions: the second element of an
                ``(inputs, targets)`` batch, a mapping batch's ``"labels"``, else the batch.
        """
        ...

    def compute(self, totals: Mapping[str, float]) -> float:
        """The metric from the set's totals (each name summed over the batches, and over the
        ranks under torchrun)."""
        ...


def _logits(outputs: Any) -> torch.Tensor:
    if isinstance(outputs, torch.Tensor):
        return outputs
    logits = (
        outputs.get("logits") if isinstance(outputs, Mapping) else getattr(outputs, "logits", None)
    )
    if not isinstance(logits, torch.Tensor):
        raise TrainingError(
            f"the model returned {type(outputs).__name__} without logits: a token metric "
            "needs the logits as the outputs, a mapping's 'logits' or an object's .logits"
        )
    return logits


def _aligned(
    outputs: Any, targets: Any, shift: bool, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logits (n, vocab), labels (n,), counted mask (n,))``."""
    logits = _logits(outputs)
    if not isinstance(targets, torch.Tensor):
        raise TrainingError(f"a token metric needs the labels as a tensor; got {type(targets)}")
    labels = targets
    if shift:  # a causal LM's labels are its inputs: token t predicts label t + 1
        logits, labels = logits[..., :-1, :], labels[..., 1:]
    logits = logits.reshape(-1, logits.shape[-1])
    labels = labels.reshape(-1)
    return logits, labels, labels != ignore_index


@dataclass(frozen=True, slots=True)
class Perplexity:
    """``exp(summed token cross-entropy / counted tokens)`` over the whole set.

    Args:
        ignore_index: The label of tokens not counted (padding).
        shift: The labels are the inputs (a Hugging Face causal LM, which shifts inside its
            loss): logits at ``t`` are scored against the label at ``t + 1``.
    """

    ignore_index: int = -100
    shift: bool = False

    def update(self, outputs: Any, targets: Any) -> dict[str, torch.Tensor]:
        """``{"nll": summed cross-entropy, "tokens": counted tokens}`` of the batch."""
        logits, labels, counted = _aligned(outputs, targets, self.shift, self.ignore_index)
        nll = F.cross_entropy(
            logits.float(), labels, ignore_index=self.ignore_index, reduction="sum"
        )
        return {"nll": nll, "tokens": counted.sum()}

    def compute(self, totals: Mapping[str, float]) -> float:
        """``exp(nll / tokens)`` (NaN for a set without a counted token)."""
        tokens = totals["tokens"]
        return math.exp(totals["nll"] / tokens) if tokens else math.nan


@dataclass(frozen=True, slots=True)
class TokenAccuracy:
    """Correctly predicted tokens over counted tokens, over the whole set. Arguments as
    :class:`Perplexity`'s."""

    ignore_index: int = -100
    shift: bool = False

    def update(self, outputs: Any, targets: Any) -> dict[str, torch.Tensor]:
        """``{"correct": ..., "tokens": ...}`` of the batch."""
        logits, labels, counted = _aligned(outputs, targets, self.shift, self.ignore_index)
        return {"correct": ((logits.argmax(-1) == labels) & counted).sum(), "tokens": counted.sum()}

    def compute(self, totals: Mapping[str, float]) -> float:
        """``correct / tokens`` (NaN for a set without a counted token)."""
        tokens = totals["tokens"]
        return totals["correct"] / tokens if tokens else math.nan


class MetricFailures:
    """Set metrics that raised, counted per name and logged as ``set_metric_failed``."""

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}

    @property
    def counts(self) -> dict[str, int]:
        """Failures per metric name (a copy)."""
        return dict(self._counts)

    def failed(
        self,
        name: str,
        exc: BaseException | None,
        *,
        dataset: str,
        step: int,
        stage: Literal["update", "compute", "another rank"],
    ) -> None:
        """Count and log one failure (``exc`` None: it failed on another rank)."""
        n = self._counts[name] = self._counts.get(name, 0) + 1
        if worth_logging(n):
            log.error(
                "set_metric_failed",
                metric=name,
                dataset=dataset,
                step=step,
                stage=stage,
                failures=n,
                exc_info=exc if n == 1 and exc is not None else None,
                error=None if exc is None else repr(exc),
            )


class SetTotals:
    """The running sums of each set metric over one pass of one set, kept on ``device``."""

    def __init__(self, metrics: Mapping[str, SetMetric], device: torch.device) -> None:
        self._metrics = dict(metrics)
        self._device = device
        self._sums: dict[str, dict[str, torch.Tensor]] = {name: {} for name in metrics}
        self.errors: dict[str, BaseException] = {}  # who raised in this pass (not updated again)

    def update(self, outputs: Any, batch: Any) -> None:
        """Add each metric's sums of one batch; one that raises is set aside in ``errors``."""
        try:
            targets = metric_targets(batch)
        except TrainingError as exc:
            for name in self._metrics:
                self.errors.setdefault(name, exc)
            return
        for name, metric in self._metrics.items():
            if name in self.errors:
                continue
            try:
                sums = self._sums[name]
                for key, value in metric.update(outputs, targets).items():
                    value = torch.as_tensor(value).detach()
                    if value.numel() != 1:
                        raise TrainingError(
                            f"set_metrics[{name!r}].update returned {key!r} of shape "
                            f"{tuple(value.shape)}: each sum must be a scalar"
                        )
                    value = value.to(self._device, torch.float64).reshape(())
                    sums[key] = value if key not in sums else sums[key] + value
            except Exception as exc:  # the metric's failure, not the run's
                self.errors[name] = exc

    def read(self) -> Totals:
        """Every metric's totals (one device read); None for a metric that raised."""
        live = [t for n, sums in self._sums.items() if n not in self.errors for t in sums.values()]
        values = iter(torch.stack(live).tolist() if live else [])
        return {
            name: None if name in self.errors else {key: next(values) for key in self._sums[name]}
            for name in self._metrics
        }

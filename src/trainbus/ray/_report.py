"""Reporting to Ray Train the way Ray expects: from every rank, at checkpoint points."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Mapping
from typing import Any

import anyio
import anyio.to_thread

from .. import events as ev
from .._log import get_logger
from ..callbacks._base import Callback

__all__ = ["ReportToRay"]

log = get_logger(__name__)


class ReportToRay(Callback):
    """Calls ``ray.train.report`` on every rank at each checkpoint the Trainer writes, so the
    Ray ``Result`` holds it; see docs/distributed.md ("Reporting to Ray").

    Args:
        evaluations: Also report after each evaluation (metrics, no checkpoint).

    Attributes:
        reports: Reports made so far on this rank.
    """

    ranks = "all"

    def __init__(self, *, evaluations: bool = False) -> None:
        self.evaluations = bool(evaluations)
        self.reports = 0

    async def on_checkpoint_saved(self, e: ev.CheckpointSaved) -> None:
        await anyio.to_thread.run_sync(self._report, _metrics(e.step, e.metrics), e.path)

    async def on_evaluation_ended(self, e: ev.EvaluationEnded) -> None:
        if self.evaluations:
            await anyio.to_thread.run_sync(self._report, _metrics(e.step, e.metrics), None)

    def _report(self, metrics: dict[str, Any], path: str | None) -> None:
        import ray.train

        rank = ray.train.get_context().get_world_rank()
        if path is None or rank != 0:
            ray.train.report(metrics)
        else:
            with tempfile.TemporaryDirectory(prefix="trainbus-report-") as folder:
                target = os.path.join(folder, os.path.basename(path))
                try:
                    os.link(path, target)
                except OSError:
                    shutil.copy2(path, target)
                ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(folder))
        self.reports += 1
        log.debug("ray_reported", step=metrics["step"], checkpoint=path, reports=self.reports)


def _metrics(step: int, metrics: Mapping[str, float]) -> dict[str, Any]:
    return {"step": step, **{k: float(v) for k, v in metrics.items()}}

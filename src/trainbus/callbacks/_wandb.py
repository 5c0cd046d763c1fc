"""Weights & Biases: config, metrics with steps, evaluation results, checkpoint artifacts."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import events as ev
from .._exceptions import ConfigError, MissingExtraError
from .._validate import check_folder, check_int, check_seconds
from ._base import Callback, PlainValue, RunPlan
from ._logging import write_in_batches

if TYPE_CHECKING:
    from .._bus import EventBus

__all__ = ["WandbLogger"]

# FitEnded.reason -> wandb's exit code (non-zero marks the run failed in the W&B UI).
_EXIT_CODE = {"completed": 0, "stopped": 0, "failed": 1, "cancelled": 1}


class WandbLogger(Callback):
    """Records a run in Weights & Biases: the configuration at the start, metrics with their
    steps, evaluation results, optionally checkpoints as artifacts, and the end.

    ===========================  ===============================================================
    event                        recorded
    ===========================  ===============================================================
    FitStarted                   ``wandb.init``; config: the Trainer's plain settings
                                 (``max_epochs``, ``accumulate``, ``precision``, ``log_every``,
                                 ...), ``steps_per_epoch``, ``world_size``, ``resumed_from``,
                                 then ``config=``
    MetricsLogged                ``loss``, ``lr``, ``steps_per_s``... at ``step``
    EvaluationEnded              ``val_loss``, ``val_<metric>`` (``<set>/...``) at ``step``;
                                 failed evaluations skipped
    CheckpointSaved              with ``log_checkpoints=True``: the file as a ``model``
                                 artifact ``checkpoints-<run id>``, aliases ``step-<step>`` and
                                 the checkpoint's tag
    FitEnded                     summary ``end_reason``; ``finish`` with exit code 0
                                 (completed, stopped) or 1 (failed, cancelled)
    ===========================  ===============================================================

    wandb calls block, so they run in batches of ``flush_s`` seconds in a worker thread (one
    ``log`` per step; see :func:`write_in_batches`). wandb's own environment variables apply
    as in ``wandb.init`` (``WANDB_MODE=offline``, ``WANDB_PROJECT``, ``WANDB_DIR``...); an
    argument given here wins. Console capture is off. :attr:`run_id` is the run of the
    last ``fit()``.

    Args:
        project: W&B project (default: ``WANDB_PROJECT``, else wandb's default).
        name: Run display name (default: wandb's generated one).
        dir: Folder for wandb's files (default: ``WANDB_DIR``, else the working directory).
        config: Extra configuration, recorded after (and over) the Trainer's settings.
        log_checkpoints: Upload each ``CheckpointSaved.path`` as an artifact.
        flush_s: Seconds of events per batch of wandb calls (> 0).
        buffer: Batches that may wait for the worker (>= 1); beyond that the bus waits.

    Raises:
        MissingExtraError: the ``wandb`` package is not installed.
        ConfigError: for an argument of the wrong type or out of range.
    """

    def __init__(
        self,
        project: str | None = None,
        *,
        name: str | None = None,
        dir: str | os.PathLike[str] | None = None,
        config: Mapping[str, Any] | None = None,
        log_checkpoints: bool = False,
        flush_s: float = 1.0,
        buffer: int = 64,
    ) -> None:
        try:  # imported here: trainbus never needs wandb unless this logger is used
            import wandb
        except ImportError as exc:
            raise MissingExtraError("WandbLogger", "wandb", "wandb") from exc
        self._wandb: Any = wandb
        for field, value in (("project", project), ("name", name)):
            if value is not None and (not isinstance(value, str) or not value):
                raise ConfigError.invalid(field, value, "a non-empty string or None")
        self.project = project
        self.name = name
        self.dir: Path | None = None if dir is None else check_folder("dir", dir)
        if config is not None and not isinstance(config, Mapping):
            raise ConfigError.invalid("config", config, "a mapping of names to values, or None")
        self.config = dict(config or {})
        if not isinstance(log_checkpoints, bool):
            raise ConfigError.invalid("log_checkpoints", log_checkpoints, "True or False")
        self.log_checkpoints = log_checkpoints
        self.flush_s = check_seconds("flush_s", flush_s)
        self.job_buffer = check_int("buffer", buffer, 1)
        self._settings: dict[str, PlainValue] = {}
        self._run: Any = None
        self.run_id: str | None = None
        """The W&B run id of the last ``fit()`` (None before the first)."""
        self.run_dir: Path | None = None
        """The last run's local folder (``<dir>/wandb/<offline->run-...``), None before."""

    def check(self, plan: RunPlan) -> None:
        """Keep the Trainer's plain settings for the run's config (nothing is refused)."""
        self._settings = dict(plan.config)

    def setup(self, bus: EventBus) -> None:
        """Subscribe the batching pipeline and its wandb worker."""
        types: list[type[ev.BaseEvent]] = [
            ev.FitStarted, ev.MetricsLogged, ev.EvaluationEnded, ev.FitEnded,
        ]  # fmt: skip
        if self.log_checkpoints:
            types.append(ev.CheckpointSaved)

        write_in_batches(bus, bus.stream(*types), self._record, flush_s=self.flush_s,
                         name="WandbLogger", buffer=self.job_buffer)  # fmt: skip

    def _start(self, started: ev.FitStarted) -> None:
        fit = {"max_steps": started.max_steps, "max_epochs": started.max_epochs,
               "device": started.device, "steps_per_epoch": started.steps_per_epoch,
               "world_size": started.world_size, "resumed_from": started.resumed_from}  # fmt: skip
        config = {**self._settings, **fit, **self.config}
        wandb = self._wandb
        run = self._run = wandb.init(
            project=self.project, name=self.name,
            dir=None if self.dir is None else os.fspath(self.dir), config=config,
            reinit="create_new", settings=wandb.Settings(console="off", silent=True),
        )  # fmt: skip
        self.run_id = run.id
        self.run_dir = Path(run.dir).parent

    def _record(self, batch: list[ev.BaseEvent]) -> None:
        # Worker thread only; one batch at a time (concurrency 1). wandb drops a row logged at
        # a step below its last one, and metrics of one step go into one row: gather per step.
        rows: dict[int, dict[str, float]] = {}
        for event in batch:
            if isinstance(event, ev.FitStarted):
                self._start(event)
                continue
            run = self._run
            if run is None:
                continue  # added mid-run: no W&B run to write into
            match event:
                case ev.MetricsLogged(metrics=m) | ev.EvaluationEnded(metrics=m, error=None):
                    rows.setdefault(event.step, {}).update({k: float(v) for k, v in m.items()})
                case ev.CheckpointSaved(path=path, tag=tag) if Path(path).is_file():
                    self._flush(rows)
                    artifact = self._wandb.Artifact(f"checkpoints-{run.id}", type="model")
                    artifact.add_file(path)
                    aliases = [f"step-{event.step}"] + ([tag] if tag else [])
                    run.log_artifact(artifact, aliases=aliases)
                case ev.FitEnded(reason=reason):
                    self._flush(rows)
                    run.summary["end_reason"] = reason
                    run.finish(exit_code=_EXIT_CODE[reason])
                    self._run = None
        self._flush(rows)

    def _flush(self, rows: dict[int, dict[str, float]]) -> None:
        if self._run is not None:
            for step in sorted(rows):
                self._run.log(rows[step], step=step)
        rows.clear()

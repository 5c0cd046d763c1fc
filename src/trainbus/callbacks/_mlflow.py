"""MLflow: params, metrics with steps, checkpoint artifacts, run status."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import events as ev
from .._exceptions import ConfigError, MissingExtraError
from .._validate import check_folder, check_int, check_seconds
from ._base import Callback
from ._logging import write_in_batches

if TYPE_CHECKING:
    from .._bus import EventBus

__all__ = ["MLflowLogger"]

_STATUS = {"completed": "FINISHED", "stopped": "FINISHED", "failed": "FAILED",
           "cancelled": "KILLED"}  # fmt: skip


class MLflowLogger(Callback):
    """Records a run in MLflow: params at the start, metrics with their steps, checkpoints as
    artifacts, and the end status.

    ===========================  ===============================================================
    event                        recorded
    ===========================  ===============================================================
    FitStarted                   a new MLflow run; params: ``params=`` and max_steps,
                                 max_epochs, device
    MetricsLogged                metrics ``loss``, ``lr``, ``steps_per_s``... at ``step``
    EvaluationEnded              metrics ``val_loss``, ``val_<metric>`` at ``step`` (not failed)
    ExternalEvaluationEnded      metrics ``external/<key>`` at the checkpoint's ``step``
    CheckpointSaved              the file as an artifact under ``checkpoints/``
    FitEnded                     run status FINISHED (completed, stopped), FAILED, KILLED
    ===========================  ===============================================================

    MLflow calls block, so they run in batches of ``flush_s`` seconds in a worker thread
    (one ``log_batch`` per batch; see :func:`write_in_batches`). :attr:`run_id` is the MLflow
    run of the last ``fit()``.

    Where the run goes, first match wins (MLflow's own environment variables, as its fluent
    client and the Hugging Face and Lightning integrations read them):

    - tracking store: ``tracking_uri=`` > ``MLFLOW_TRACKING_URI`` > a local SQLite file,
      ``<run_dir>/mlflow.db`` (artifacts in ``<run_dir>/mlartifacts``; no server needed);
    - experiment: ``experiment=`` > ``MLFLOW_EXPERIMENT_NAME`` (created when missing; if
      ``MLFLOW_EXPERIMENT_ID`` is also set it must be that experiment's id, as in MLflow) >
      ``MLFLOW_EXPERIMENT_ID`` (an existing experiment) > ``"trainbus"``.

    The environment is read when the logger is built (see :attr:`tracking_uri`,
    :attr:`experiment`, :attr:`experiment_id`).

    Args:
        run_dir: Folder for the default local store (``<run_dir>/mlflow.db``).
        tracking_uri: MLflow tracking URI (default: ``MLFLOW_TRACKING_URI``, else the local
            SQLite file).
        experiment: Experiment name, created when missing (default: ``MLFLOW_EXPERIMENT_NAME``,
            else the experiment ``MLFLOW_EXPERIMENT_ID`` names, else ``"trainbus"``).
        run_name: MLflow run name (default: MLflow's).
        params: Parameters to record at the start (values are stringified by MLflow).
        log_checkpoints: Upload each ``CheckpointSaved.path`` as an artifact.
        flush_s: Seconds of events per batch of MLflow calls (> 0).
        buffer: Batches that may wait for the worker (>= 1); beyond that the bus waits.

    Raises:
        MissingExtraError: the ``mlflow`` (or ``mlflow-skinny``) package is not installed.
        ConfigError: for an argument out of range, or an empty ``tracking_uri``/``experiment``.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str] = "runs",
        *,
        tracking_uri: str | None = None,
        experiment: str | None = None,
        run_name: str | None = None,
        params: Mapping[str, Any] | None = None,
        log_checkpoints: bool = True,
        flush_s: float = 1.0,
        buffer: int = 64,
    ) -> None:
        try:  # imported here: trainbus never needs mlflow unless this logger is used
            from mlflow.entities import Metric
            from mlflow.tracking import MlflowClient
        except ImportError as exc:
            raise MissingExtraError("MLflowLogger", "mlflow", "mlflow") from exc
        self._client_type, self._metric_type = MlflowClient, Metric
        self.run_dir = check_folder("run_dir", run_dir)
        if tracking_uri is not None and (not isinstance(tracking_uri, str) or not tracking_uri):
            raise ConfigError.invalid("tracking_uri", tracking_uri, "a non-empty URI or None")
        # MLflow 3 refuses its file: store (maintenance mode); a SQLite file is as local and
        # offline. Artifacts go next to it (the default root would be relative to the cwd).
        self.tracking_uri: str = (
            tracking_uri
            or _env("MLFLOW_TRACKING_URI")
            or f"sqlite:///{(self.run_dir / 'mlflow.db').resolve()}"
        )
        """The tracking URI the runs go to (argument, environment, or the local default)."""
        self.artifact_location = (self.run_dir / "mlartifacts").resolve().as_uri()
        if experiment is not None and (not isinstance(experiment, str) or not experiment):
            raise ConfigError.invalid("experiment", experiment, "a non-empty name or None")
        env_id = _env("MLFLOW_EXPERIMENT_ID")
        self.experiment: str | None = experiment or _env("MLFLOW_EXPERIMENT_NAME")
        """The experiment name (None when only ``MLFLOW_EXPERIMENT_ID`` chose it)."""
        self.experiment_id: str | None = env_id if experiment is None else None
        """``MLFLOW_EXPERIMENT_ID`` when no ``experiment=`` was given (checked at the start)."""
        if self.experiment is None and self.experiment_id is None:
            self.experiment = "trainbus"
        self.run_name = run_name
        self.params = dict(params or {})
        if not isinstance(log_checkpoints, bool):
            raise ConfigError.invalid("log_checkpoints", log_checkpoints, "True or False")
        self.log_checkpoints = log_checkpoints
        self.flush_s = check_seconds("flush_s", flush_s)
        self.job_buffer = check_int("buffer", buffer, 1)
        self._client: Any = None
        self.run_id: str | None = None
        """The MLflow run id of the last ``fit()`` (None before the first)."""

    def setup(self, bus: EventBus) -> None:
        """Subscribe the batching pipeline and its MLflow worker."""
        types: list[type[ev.BaseEvent]] = [
            ev.FitStarted, ev.MetricsLogged, ev.EvaluationEnded, ev.ExternalEvaluationEnded,
            ev.FitEnded,
        ]  # fmt: skip
        if self.log_checkpoints:
            types.append(ev.CheckpointSaved)

        write_in_batches(bus, bus.stream(*types), self._record, flush_s=self.flush_s,
                         name="MLflowLogger", buffer=self.job_buffer)  # fmt: skip

    def _experiment_id(self, client: Any) -> str:
        # MLflow's order (mlflow.tracking.fluent): a name wins, and an id set beside it must
        # be that experiment's; an id alone must exist (get_experiment raises otherwise).
        if self.experiment is None:
            assert self.experiment_id is not None
            return str(client.get_experiment(self.experiment_id).experiment_id)
        found = client.get_experiment_by_name(self.experiment)
        if found is None:
            return str(client.create_experiment(
                self.experiment, artifact_location=self.artifact_location
            ))  # fmt: skip
        if self.experiment_id is not None and self.experiment_id != found.experiment_id:
            raise ConfigError.invalid(
                "MLFLOW_EXPERIMENT_ID", self.experiment_id,
                f"the id of experiment {self.experiment!r} ({found.experiment_id}), or unset",
            )  # fmt: skip
        return str(found.experiment_id)

    def _start(self, started: ev.FitStarted) -> None:
        client = self._client = self._client_type(tracking_uri=self.tracking_uri)
        run = client.create_run(self._experiment_id(client), run_name=self.run_name)
        self.run_id = run.info.run_id
        run_params = {"max_steps": started.max_steps, "max_epochs": started.max_epochs,
                      "device": started.device}  # fmt: skip
        params = {**{k: v for k, v in run_params.items() if v is not None}, **self.params}
        for k, v in params.items():
            client.log_param(self.run_id, k, v)

    def _record(self, batch: list[ev.BaseEvent]) -> None:
        # Worker thread only; one batch at a time (concurrency 1).
        metrics: list[Any] = []
        now_ms = int(time.time() * 1000)

        def add(prefix: str, values: Mapping[str, float], step: int) -> None:
            metrics.extend(self._metric_type(prefix + k, float(v), now_ms, step)
                           for k, v in values.items())  # fmt: skip

        for event in batch:
            if isinstance(event, ev.FitStarted):
                self._start(event)
                continue
            if self._client is None or self.run_id is None:
                continue  # added mid-run: no MLflow run to write into
            match event:
                case ev.MetricsLogged(metrics=m):
                    add("", m, event.step)
                case ev.EvaluationEnded(metrics=m, error=None):
                    add("", m, event.step)
                case ev.ExternalEvaluationEnded(metrics=m, error=None):
                    add("external/", m, event.step)
                case ev.CheckpointSaved(path=path) if Path(path).is_file():
                    self._client.log_artifact(self.run_id, path, artifact_path="checkpoints")
                case ev.FitEnded(reason=reason):
                    self._flush(metrics)
                    self._client.set_terminated(self.run_id, status=_STATUS[reason])
                    self._client = None
        self._flush(metrics)

    def _flush(self, metrics: list[Any]) -> None:
        if metrics and self._client is not None and self.run_id is not None:
            self._client.log_batch(self.run_id, metrics=list(metrics))
        metrics.clear()


def _env(name: str) -> str | None:
    """An MLflow environment variable, None when unset or empty (as MLflow treats it)."""
    return os.environ.get(name) or None

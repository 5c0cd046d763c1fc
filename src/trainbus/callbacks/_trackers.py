"""Tracking services: TensorBoard, MLflow and Weights & Biases, each recording a run from a
worker thread (:func:`write_in_batches`); their packages are imported only when used."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import events as ev
from .._exceptions import ConfigError, MissingExtraError
from .._validate import check_bool, check_folder, check_int, check_seconds
from ._base import Callback, PlainValue, RunPlan
from ._logging import write_in_batches

if TYPE_CHECKING:
    from .._bus import EventBus

__all__ = ["MLflowLogger", "TensorBoardLogger", "WandbLogger"]


def _metrics(event: ev.BaseEvent) -> tuple[str, Mapping[str, float]] | None:
    """``("train" | "eval" | "external", metrics)``; None for failed evaluations."""
    match event:
        case ev.MetricsLogged(metrics=m):
            return "train", m
        case ev.EvaluationEnded(metrics=m, error=None):
            return "eval", m
        case ev.ExternalEvaluationEnded(metrics=m, error=None):
            return "external", m
    return None


def _run_params(started: ev.FitStarted) -> dict[str, Any]:
    """The run's limits and device, those set."""
    run = {
        "max_steps": started.max_steps,
        "max_epochs": started.max_epochs,
        "device": started.device,
    }
    return {k: v for k, v in run.items() if v is not None}


class _Tracker(Callback):
    """A tracking service's logger: its runs are written in a worker thread one batch at a time;
    events of a run whose ``FitStarted`` it did not see are skipped."""

    _recording = False

    def _open(self, started: ev.FitStarted) -> None: ...
    def _record(self, event: ev.BaseEvent) -> None: ...
    def _flush(self) -> None: ...
    def _close(self, ended: ev.FitEnded) -> None: ...

    def _subscribe(
        self, bus: EventBus, types: list[type[ev.BaseEvent]], *, flush_s: float, buffer: int | None
    ) -> None:
        self._recording = False
        source = bus.stream(ev.FitStarted, ev.FitEnded, *types)
        name = type(self).__name__
        write_in_batches(bus, source, self._write, flush_s=flush_s, name=name, buffer=buffer)

    def _write(self, batch: list[ev.BaseEvent]) -> None:
        for event in batch:
            if isinstance(event, ev.FitStarted):
                self._open(event)
                self._recording = True
            elif self._recording and isinstance(event, ev.FitEnded):
                self._flush()
                self._close(event)
                self._recording = False
            elif self._recording:
                self._record(event)
        if self._recording:
            self._flush()


def _check_options(log_checkpoints: bool, buffer: int) -> int:
    check_bool("log_checkpoints", log_checkpoints)
    return check_int("buffer", buffer, 1)


class TensorBoardLogger(_Tracker):
    """Writes a run to TensorBoard event files in ``log_dir``, from a worker thread. See
    docs/callbacks/tensorboard.md.

    Args:
        log_dir: Folder for the event files (``SummaryWriter(log_dir)``).
        hparams: Hyper-parameters to record at the start (str, bool, int or float values).
        flush_s: Seconds of events per written batch (> 0).

    Raises:
        MissingExtraError: the ``tensorboard`` package is not installed.
        ConfigError: a bad ``log_dir``, ``hparams`` or ``flush_s``.
    """

    def __init__(
        self,
        log_dir: str | os.PathLike[str],
        *,
        hparams: Mapping[str, Any] | None = None,
        flush_s: float = 1.0,
    ) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise MissingExtraError("TensorBoardLogger", "tensorboard", "tensorboard") from exc
        self._writer_type = SummaryWriter
        self.log_dir = check_folder("log_dir", log_dir)
        hparams = dict(hparams or {})
        for k, v in hparams.items():
            if not isinstance(k, str) or not isinstance(v, str | bool | int | float):
                raise ConfigError.invalid(f"hparams[{k!r}]", v, "a str, bool, int or float")
        self.hparams = hparams
        self.flush_s = check_seconds("flush_s", flush_s)
        self._writer: Any = None

    def setup(self, bus: EventBus) -> None:
        """Subscribe the batching pipeline and its writer."""
        types = [ev.MetricsLogged, ev.EvaluationEnded, ev.ExternalEvaluationEnded]
        self._subscribe(bus, [*types, ev.SchedulerStepped], flush_s=self.flush_s, buffer=None)

    def _open(self, started: ev.FitStarted) -> None:
        self._writer = self._writer_type(log_dir=os.fspath(self.log_dir))
        # run_name=".": in this run's folder, not a new sub-folder TensorBoard shows as a run.
        self._writer.add_hparams(
            {**_run_params(started), **self.hparams}, {}, run_name=".", global_step=started.step
        )

    def _record(self, event: ev.BaseEvent) -> None:
        if isinstance(event, ev.SchedulerStepped):
            self._writer.add_scalar("lr", float(event.lr), global_step=event.step)
        elif (found := _metrics(event)) is not None:
            kind, metrics = found
            for k, v in metrics.items():
                self._writer.add_scalar(f"{kind}/{k}", float(v), global_step=event.step)

    def _flush(self) -> None:
        self._writer.flush()

    def _close(self, ended: ev.FitEnded) -> None:
        self._writer.close()
        self._writer = None


_STATUS = {
    "completed": "FINISHED",
    "stopped": "FINISHED",
    "failed": "FAILED",
    "cancelled": "KILLED",
}


def _env(name: str) -> str | None:
    """An MLflow environment variable, None when unset or empty (as MLflow treats it)."""
    return os.environ.get(name) or None


class MLflowLogger(_Tracker):
    """Records a run in MLflow (params, metrics, checkpoints as artifacts, the end status),
    from a worker thread. See docs/callbacks/mlflow.md.

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
        try:
            from mlflow.entities import Metric
            from mlflow.tracking import MlflowClient
        except ImportError as exc:
            raise MissingExtraError("MLflowLogger", "mlflow", "mlflow") from exc
        self._client_type, self._metric_type = MlflowClient, Metric
        self.run_dir = check_folder("run_dir", run_dir)
        if tracking_uri is not None and (not isinstance(tracking_uri, str) or not tracking_uri):
            raise ConfigError.invalid("tracking_uri", tracking_uri, "a non-empty URI or None")
        # A SQLite file (MLflow 3 refuses its file: store), artifacts beside it (not the cwd).
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
        self.job_buffer = _check_options(log_checkpoints, buffer)
        self.log_checkpoints = log_checkpoints
        self.flush_s = check_seconds("flush_s", flush_s)
        self._client: Any = None
        self._metrics: list[Any] = []
        self.run_id: str | None = None
        """The MLflow run id of the last ``fit()`` (None before the first)."""

    def setup(self, bus: EventBus) -> None:
        """Subscribe the batching pipeline and its MLflow worker."""
        types = [ev.MetricsLogged, ev.EvaluationEnded, ev.ExternalEvaluationEnded]
        types += [ev.CheckpointSaved] if self.log_checkpoints else []
        self._subscribe(bus, types, flush_s=self.flush_s, buffer=self.job_buffer)

    def _experiment_id(self, client: Any) -> str:
        # MLflow's order: a name wins (an id beside it must be its); an id alone must exist.
        if self.experiment is None:
            assert self.experiment_id is not None
            return str(client.get_experiment(self.experiment_id).experiment_id)
        found = client.get_experiment_by_name(self.experiment)
        if found is None:
            return str(
                client.create_experiment(self.experiment, artifact_location=self.artifact_location)
            )
        if self.experiment_id is not None and self.experiment_id != found.experiment_id:
            raise ConfigError.invalid(
                "MLFLOW_EXPERIMENT_ID",
                self.experiment_id,
                f"the id of experiment {self.experiment!r} ({found.experiment_id}), or unset",
            )
        return str(found.experiment_id)

    def _open(self, started: ev.FitStarted) -> None:
        client = self._client_type(tracking_uri=self.tracking_uri)
        run = client.create_run(self._experiment_id(client), run_name=self.run_name)
        self._client, self.run_id = client, run.info.run_id
        for k, v in {**_run_params(started), **self.params}.items():
            client.log_param(self.run_id, k, v)

    def _record(self, event: ev.BaseEvent) -> None:
        if isinstance(event, ev.CheckpointSaved):
            if Path(event.path).is_file():
                self._client.log_artifact(self.run_id, event.path, artifact_path="checkpoints")
        elif (found := _metrics(event)) is not None:
            kind, metrics = found
            prefix, now_ms = "external/" if kind == "external" else "", int(time.time() * 1000)
            self._metrics.extend(
                self._metric_type(prefix + k, float(v), now_ms, event.step)
                for k, v in metrics.items()
            )

    def _flush(self) -> None:
        if self._metrics:
            self._client.log_batch(self.run_id, metrics=self._metrics)
            self._metrics = []

    def _close(self, ended: ev.FitEnded) -> None:
        self._client.set_terminated(self.run_id, status=_STATUS[ended.reason])
        self._client = None


# FitEnded.reason -> wandb's exit code (non-zero marks the run failed in the W&B UI).
_EXIT_CODE = {"completed": 0, "stopped": 0, "failed": 1, "cancelled": 1}


class WandbLogger(_Tracker):
    """Records a run in Weights & Biases (its configuration, metrics, optionally checkpoints
    as artifacts, the end), from a worker thread. See docs/callbacks/wandb.md.

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
        try:
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
        self.job_buffer = _check_options(log_checkpoints, buffer)
        self.log_checkpoints = log_checkpoints
        self.flush_s = check_seconds("flush_s", flush_s)
        self._settings: dict[str, PlainValue] = {}
        self._run: Any = None
        # One row per step, gathered until the batch ends (wandb drops a row of an older step).
        self._rows: dict[int, dict[str, float]] = {}
        self.run_id: str | None = None
        """The W&B run id of the last ``fit()`` (None before the first)."""
        self.run_dir: Path | None = None
        """The last run's local folder (``<dir>/wandb/<offline->run-...``), None before."""

    def check(self, plan: RunPlan) -> None:
        """Keep the Trainer's plain settings for the run's config (nothing is refused)."""
        self._settings = dict(plan.config)

    def setup(self, bus: EventBus) -> None:
        """Subscribe the batching pipeline and its wandb worker."""
        types: list[type[ev.BaseEvent]] = [ev.MetricsLogged, ev.EvaluationEnded]
        types += [ev.CheckpointSaved] if self.log_checkpoints else []
        self._subscribe(bus, types, flush_s=self.flush_s, buffer=self.job_buffer)

    def _open(self, started: ev.FitStarted) -> None:
        fit = {
            "max_steps": started.max_steps,
            "max_epochs": started.max_epochs,
            "device": started.device,
            "steps_per_epoch": started.steps_per_epoch,
            "world_size": started.world_size,
            "resumed_from": started.resumed_from,
        }
        wandb = self._wandb
        run = self._run = wandb.init(
            project=self.project,
            name=self.name,
            dir=None if self.dir is None else os.fspath(self.dir),
            config={**self._settings, **fit, **self.config},
            reinit="create_new",
            settings=wandb.Settings(console="off", silent=True),
        )
        self.run_id = run.id
        self.run_dir = Path(run.dir).parent

    def _record(self, event: ev.BaseEvent) -> None:
        if isinstance(event, ev.CheckpointSaved):
            if Path(event.path).is_file():
                self._flush()
                artifact = self._wandb.Artifact(f"checkpoints-{self._run.id}", type="model")
                artifact.add_file(event.path)
                aliases = [f"step-{event.step}"] + ([event.tag] if event.tag else [])
                self._run.log_artifact(artifact, aliases=aliases)
        elif (found := _metrics(event)) is not None:
            self._rows.setdefault(event.step, {}).update({k: float(v) for k, v in found[1].items()})

    def _flush(self) -> None:
        for step in sorted(self._rows):
            self._run.log(self._rows[step], step=step)
        self._rows.clear()

    def _close(self, ended: ev.FitEnded) -> None:
        self._run.summary["end_reason"] = ended.reason
        self._run.finish(exit_code=_EXIT_CODE[ended.reason])
        self._run = None

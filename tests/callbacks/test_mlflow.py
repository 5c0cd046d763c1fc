"""MLflowLogger: a real run into a local file store, read back with MlflowClient."""

from __future__ import annotations

import builtins
from pathlib import Path
from typing import Any

import pytest

from trainbus import ConfigError, MissingExtraError
from trainbus.callbacks import Checkpointing, MLflowLogger

pytest.importorskip("mlflow")


def test_params_metrics_and_checkpoints_read_back(trainer_factory: Any, tmp_path: Path) -> None:
    from mlflow import MlflowClient

    logger = MLflowLogger(tmp_path, params={"lr": 0.1, "model": "mlp"}, flush_s=0.05)
    trainer = trainer_factory(
        [Checkpointing(every_epochs=1), logger], epochs=2, batches=4, log_every=2,
        checkpoint_dir=tmp_path / "ckpt",
    )  # fmt: skip
    result = trainer.fit_sync()
    assert result.reason == "completed"
    assert logger.tracking_uri.startswith("sqlite:") and (tmp_path / "mlflow.db").is_file()

    client = MlflowClient(tracking_uri=logger.tracking_uri)
    assert logger.run_id is not None
    run = client.get_run(logger.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["lr"] == "0.1" and run.data.params["model"] == "mlp"
    assert run.data.params["max_epochs"] == "2"
    losses = client.get_metric_history(logger.run_id, "loss")
    assert sorted(m.step for m in losses) == [2, 4, 6, 8]
    val = client.get_metric_history(logger.run_id, "val_loss")
    assert sorted(m.step for m in val) == [4, 8]
    assert max(val, key=lambda m: m.step).value == pytest.approx(result.eval_metrics["val_loss"])
    artifacts = {Path(a.path).name for a in client.list_artifacts(logger.run_id, "checkpoints")}
    saved = {p.name for p in (tmp_path / "ckpt").glob("*.pt")}
    assert saved and saved <= artifacts


_MLFLOW_ENV = ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID")


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No MLflow variable from the machine running the tests leaks in."""
    for name in _MLFLOW_ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_environment_chooses_store_and_experiment(
    trainer_factory: Any, tmp_path: Path, clean_env: pytest.MonkeyPatch
) -> None:
    from mlflow import MlflowClient

    # A user who points MLflow at a file store (as MLflow's docs show) finds the run there.
    store = (tmp_path / "mlruns").as_uri()
    clean_env.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    clean_env.setenv("MLFLOW_TRACKING_URI", store)
    clean_env.setenv("MLFLOW_EXPERIMENT_NAME", "from-env")
    logger = MLflowLogger(tmp_path / "run", flush_s=0.05)
    assert (logger.tracking_uri, logger.experiment) == (store, "from-env")
    result = trainer_factory([logger], epochs=1, batches=4, log_every=2).fit_sync()
    assert result.reason == "completed"

    assert not (tmp_path / "run" / "mlflow.db").exists()
    client = MlflowClient(tracking_uri=store)
    exp = client.get_experiment_by_name("from-env")
    assert exp is not None and logger.run_id is not None
    run = client.get_run(logger.run_id)
    assert run.info.experiment_id == exp.experiment_id and run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(logger.run_id, "loss")] == [2, 4]


def test_arguments_beat_the_environment(tmp_path: Path, clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("MLFLOW_TRACKING_URI", "sqlite:///elsewhere.db")
    clean_env.setenv("MLFLOW_EXPERIMENT_NAME", "env-name")
    clean_env.setenv("MLFLOW_EXPERIMENT_ID", "7")
    uri = f"sqlite:///{tmp_path / 'mine.db'}"
    logger = MLflowLogger(tmp_path, tracking_uri=uri, experiment="mine")
    assert (logger.tracking_uri, logger.experiment, logger.experiment_id) == (uri, "mine", None)


def test_defaults_without_environment(tmp_path: Path, clean_env: pytest.MonkeyPatch) -> None:
    logger = MLflowLogger(tmp_path)
    assert logger.tracking_uri == f"sqlite:///{(tmp_path / 'mlflow.db').resolve()}"
    assert (logger.experiment, logger.experiment_id) == ("trainbus", None)
    clean_env.setenv("MLFLOW_TRACKING_URI", "")  # empty counts as unset, as in MLflow
    assert MLflowLogger(tmp_path).tracking_uri.startswith("sqlite:")


def test_experiment_id_from_the_environment(
    trainer_factory: Any, tmp_path: Path, clean_env: pytest.MonkeyPatch
) -> None:
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    exp_id = MlflowClient(tracking_uri=uri).create_experiment("made-by-hand")
    clean_env.setenv("MLFLOW_TRACKING_URI", uri)
    clean_env.setenv("MLFLOW_EXPERIMENT_ID", exp_id)
    logger = MLflowLogger(tmp_path / "run", flush_s=0.05)
    assert (logger.experiment, logger.experiment_id) == (None, exp_id)
    trainer_factory([logger], epochs=1, batches=2).fit_sync()
    assert logger.run_id is not None
    assert MlflowClient(tracking_uri=uri).get_run(logger.run_id).info.experiment_id == exp_id


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^experiment="):
        MLflowLogger(tmp_path, experiment="")
    with pytest.raises(ConfigError, match=r"^tracking_uri="):
        MLflowLogger(tmp_path, tracking_uri="")
    with pytest.raises(ConfigError, match=r"^buffer="):
        MLflowLogger(tmp_path, buffer=0)


def test_missing_extra_names_the_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = builtins.__import__

    def no_mlflow(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.startswith("mlflow"):
            raise ModuleNotFoundError("No module named 'mlflow'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_mlflow)
    with pytest.raises(MissingExtraError, match=r"pip install 'trainbus\[mlflow\]'"):
        MLflowLogger("runs")


def test_experiment_id_that_is_not_the_named_experiments_is_refused(
    trainer_factory: Any, tmp_path: Path, clean_env: pytest.MonkeyPatch
) -> None:
    from mlflow import MlflowClient
    from structlog.testing import capture_logs

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    client.create_experiment("named")
    other = client.create_experiment("other")
    clean_env.setenv("MLFLOW_TRACKING_URI", uri)
    clean_env.setenv("MLFLOW_EXPERIMENT_NAME", "named")
    clean_env.setenv("MLFLOW_EXPERIMENT_ID", other)
    logger = MLflowLogger(tmp_path / "run", flush_s=0.05)
    with capture_logs() as logs:
        trainer_factory([logger], epochs=1, batches=2).fit_sync()
    assert logger.run_id is None  # no run written into the wrong experiment
    assert "MLFLOW_EXPERIMENT_ID" in repr(logs), logs
    assert client.search_runs([other]) == []

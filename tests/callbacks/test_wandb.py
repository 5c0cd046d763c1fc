"""WandbLogger: a real offline wandb run, read back from the run's ``.wandb`` transaction log.

wandb 0.31 ships no Python reader for the offline log (``wandb.sdk.internal.datastore`` is
gone) and writes no ``wandb-summary.json`` offline, so :func:`read_records` reads the file
format (wandb's variant of the LevelDB log: a 7-byte ``:W&B`` header, then 32 KiB blocks of
records with a 7-byte header: CRC, length, kind) and parses each record with wandb's own
protobuf ``Record``.
"""

from __future__ import annotations

import builtins
import json
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from trainbus import ConfigError, MissingExtraError
from trainbus.callbacks import Checkpointing, WandbLogger

pytest.importorskip("wandb")

_BLOCK = 32 * 1024
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def read_records(path: Path) -> Iterator[Any]:
    """Every ``wandb_internal_pb2.Record`` of an offline run's ``.wandb`` file, in order."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        if _BLOCK - pos % _BLOCK < 7:  # a block's tail too short for a header is padding
            pos += _BLOCK - pos % _BLOCK
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:  # zero padding up to the block end
            pos += -pos % _BLOCK
            continue
        if kind in (_FULL, _LAST):
            record = pb.Record()
            record.ParseFromString(pending + chunk if kind == _LAST else chunk)
            pending = b""
            yield record
        elif kind in (_FIRST, _MIDDLE):
            pending = (pending if kind == _MIDDLE else b"") + chunk
        else:
            raise AssertionError(f"unknown record kind {kind} at {pos}")


def _items(items: Any) -> dict[str, Any]:
    """``{key: value}`` of protobuf items; a key is ``key`` or its ``nested_key`` parts."""
    out = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items}
    out.pop("", None)
    return out


class OfflineRun:
    """What one offline run recorded: config, history rows by step, artifacts, exit code.

    ``run.finish()`` returns once wandb's service has the exit; its writer may append the
    last records a moment later, so reading waits (up to ``wait_s``) for the exit record.
    """

    def __init__(self, run_dir: Path, wait_s: float = 30.0) -> None:
        (log,) = run_dir.glob("run-*.wandb")
        deadline = time.monotonic() + wait_s
        while not any(r.WhichOneof("record_type") == "exit" for r in read_records(log)):
            assert time.monotonic() < deadline, f"no exit record in {log} after {wait_s} s"
            time.sleep(0.05)
        self.config: dict[str, Any] = {}
        self.history: dict[int, dict[str, Any]] = {}
        self.artifacts: list[tuple[str, str, list[str], list[str]]] = []
        self.summary: dict[str, Any] = {}
        self.exit_code: int | None = None
        for r in read_records(log):
            kind = r.WhichOneof("record_type")
            if kind == "run":
                self._config(r.run.config.update)
            elif kind == "config":
                self._config(r.config.update)
            elif kind == "history":
                row = _items(r.history.item)
                assert row.pop("_step") == r.history.step.num
                self.history[r.history.step.num] = row
            elif kind == "summary":
                self.summary.update(_items(r.summary.update))
            elif kind == "artifact":
                a = r.artifact
                files = [m.path for m in a.manifest.contents]
                self.artifacts.append((a.name, a.type, list(a.aliases), files))
            elif kind == "exit":
                self.exit_code = r.exit.exit_code

    def _config(self, items: Any) -> None:
        self.config.update({k: v for k, v in _items(items).items() if k != "_wandb"})

    def series(self, key: str) -> dict[int, float]:
        return {step: row[key] for step, row in self.history.items() if key in row}


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """wandb offline, its files under tmp_path, no network, no user settings."""
    for name in ("WANDB_PROJECT", "WANDB_ENTITY", "WANDB_API_KEY", "WANDB_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    yield tmp_path
    # wandb reads its environment once per process (wandb.setup()): forget it, so the next
    # test's WANDB_DIR applies.
    import wandb

    wandb.teardown()


def test_config_metrics_evaluations_and_checkpoints_read_back(
    trainer_factory: Any, offline: Path
) -> None:
    logger = WandbLogger(
        "trainbus-test", name="tiny", config={"model": "mlp"}, log_checkpoints=True,
        flush_s=0.05,
    )  # fmt: skip
    trainer = trainer_factory(
        [Checkpointing(every_epochs=1), logger], epochs=2, batches=4, log_every=2,
        accumulate=1, checkpoint_dir=offline / "ckpt",
    )  # fmt: skip
    result = trainer.fit_sync()
    assert result.reason == "completed"
    assert logger.run_dir is not None and logger.run_dir.parent == offline / "wandb"
    assert logger.run_dir.name.startswith("offline-run-") and logger.run_id is not None

    run = OfflineRun(logger.run_dir)
    assert run.exit_code == 0
    assert run.summary["end_reason"] == "completed"
    # The Trainer's plain settings, what FitStarted adds, then config=; no objects.
    assert run.config["max_epochs"] == 2 and run.config["log_every"] == 2
    assert run.config["precision"] == "32" and run.config["device"] == "cpu"
    assert run.config["steps_per_epoch"] == 4 and run.config["model"] == "mlp"
    assert run.config["max_steps"] is None
    assert "eval_data" not in run.config and "scheduler" not in run.config
    # Training metrics at their steps; evaluation results joined into their step's row.
    assert sorted(run.series("loss")) == [2, 4, 6, 8]
    val = run.series("val_loss")
    assert sorted(val) == [4, 8] and val[8] == pytest.approx(result.eval_metrics["val_loss"])
    saved = sorted(p.name for p in (offline / "ckpt").glob("*.pt"))
    assert saved and len(run.artifacts) == len(saved)
    name, kind, _aliases, _files = run.artifacts[0]
    assert (name, kind) == (f"checkpoints-{logger.run_id}", "model")
    assert {f for *_, files in run.artifacts for f in files} == set(saved)
    assert {f"step-{s}" for s in (4, 8)} <= {a for _, _, aliases, _ in run.artifacts
                                              for a in aliases}  # fmt: skip


def test_checkpoints_not_uploaded_by_default(trainer_factory: Any, offline: Path) -> None:
    logger = WandbLogger(flush_s=0.05)
    trainer_factory(
        [Checkpointing(every_epochs=1), logger], epochs=1, batches=2,
        checkpoint_dir=offline / "ckpt",
    ).fit_sync()  # fmt: skip
    assert logger.run_dir is not None
    run = OfflineRun(logger.run_dir)
    assert list((offline / "ckpt").glob("*.pt")) and run.artifacts == []
    assert run.exit_code == 0


def test_each_fit_is_its_own_run(trainer_factory: Any, offline: Path) -> None:
    logger = WandbLogger(flush_s=0.05)
    trainer_factory([logger], epochs=1, batches=2, log_every=1).fit_sync()
    first = logger.run_id
    trainer_factory([logger], epochs=1, batches=2, log_every=1).fit_sync()
    assert first is not None and logger.run_id is not None and logger.run_id != first
    assert len(list((offline / "wandb").glob("offline-run-*"))) == 2


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^project=''"):
        WandbLogger("")
    with pytest.raises(ConfigError, match=r"^config="):
        WandbLogger(config=[("lr", 1)])  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^log_checkpoints="):
        WandbLogger(log_checkpoints="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^flush_s="):
        WandbLogger(flush_s=0)
    with pytest.raises(ConfigError, match=r"^buffer="):
        WandbLogger(buffer=0)


def test_missing_extra_names_the_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = builtins.__import__

    def no_wandb(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "wandb" or name.startswith("wandb."):
            raise ModuleNotFoundError("No module named 'wandb'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    with pytest.raises(MissingExtraError, match=r"pip install 'trainbus\[wandb\]'"):
        WandbLogger()

"""TensorBoardLogger: a real run, read back with TensorBoard's own EventAccumulator."""

from __future__ import annotations

import builtins
from pathlib import Path
from typing import Any

import pytest

from trainbus import ConfigError, MissingExtraError
from trainbus.callbacks import TensorBoardLogger

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import (
    EventAccumulator,
)


def test_scalars_and_hparams_read_back(trainer_factory: Any, tmp_path: Path) -> None:
    log_dir = tmp_path / "tb"
    tb = TensorBoardLogger(log_dir, hparams={"lr": 0.1, "model": "mlp"}, flush_s=0.05)
    trainer = trainer_factory([tb], epochs=2, batches=4, log_every=2)
    result = trainer.fit_sync()
    assert result.reason == "completed"

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in ("train/loss", "train/lr", "train/steps_per_s", "train/samples_per_s",
                "eval/val_loss"):  # fmt: skip
        assert tag in tags, (tag, tags)
    assert [s.step for s in acc.Scalars("train/loss")] == [2, 4, 6, 8]
    assert [s.value for s in acc.Scalars("train/lr")] == pytest.approx([0.1] * 4)
    assert [s.step for s in acc.Scalars("eval/val_loss")] == [4, 8]
    assert acc.Scalars("eval/val_loss")[-1].value == pytest.approx(result.eval_metrics["val_loss"])

    plugin = acc.PluginTagToContent("hparams")
    assert plugin, "no hparams record"
    from tensorboard.plugins.hparams import plugin_data_pb2

    data = plugin_data_pb2.HParamsPluginData.FromString(plugin["_hparams_/session_start_info"])
    hp = data.session_start_info.hparams
    assert hp["lr"].number_value == pytest.approx(0.1)
    assert hp["model"].string_value == "mlp"
    assert hp["max_epochs"].number_value == 2


def test_bad_arguments() -> None:
    with pytest.raises(ConfigError, match="hparams"):
        TensorBoardLogger("runs/x", hparams={"layers": [1, 2]})
    with pytest.raises(ConfigError, match=r"^flush_s="):
        TensorBoardLogger("runs/x", flush_s=0)


def test_missing_extra_names_the_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = builtins.__import__

    def no_tensorboard(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.startswith("torch.utils.tensorboard"):
            raise ModuleNotFoundError("No module named 'tensorboard'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    with pytest.raises(MissingExtraError, match=r"pip install 'trainbus\[tensorboard\]'") as info:
        TensorBoardLogger("runs/x")
    assert isinstance(info.value, ImportError)

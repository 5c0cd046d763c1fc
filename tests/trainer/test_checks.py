"""Every Trainer argument is validated up front: a ConfigError (a ValueError) naming the field,
raised by the constructor, before anything runs or touches the disk."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from trainbus import Callback, ConfigError, Trainer
from trainbus.testing import tiny_loader, tiny_model


class _Noop(Callback):
    pass


def _touch(path: Path) -> Path:
    path.write_text("not a folder")
    return path


# (id, overrides(tmp_path) -> kwargs for Trainer, the field the message must name)
# Positional arguments are passed as "model" / "optimizer" / "train_data" overrides.
Case = tuple[Callable[[Path], dict[str, Any]], str]

CASES = [
    pytest.param(lambda p: {"model": "not a module"}, "model", id="model-not-module"),
    pytest.param(lambda p: {"model": torch.nn.ReLU()}, "optimizer", id="model-without-params"),
    pytest.param(lambda p: {"optimizer": "sgd"}, "optimizer", id="optimizer-not-optimizer"),
    pytest.param(
        lambda p: {"optimizer": torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)},
        "optimizer",
        id="optimizer-over-other-params",
    ),
    pytest.param(lambda p: {"train_data": []}, "train_data", id="empty-loader"),
    pytest.param(lambda p: {"train_data": 5}, "train_data", id="train-data-not-iterable"),
    pytest.param(lambda p: {"train_data": torch.zeros(3)}, "train_data", id="train-data-tensor"),
    pytest.param(lambda p: {"eval_data": []}, "eval_data", id="empty-eval-loader"),
    pytest.param(lambda p: {"loss_fn": 5}, "loss_fn", id="loss-fn-not-callable"),
    pytest.param(lambda p: {"max_steps": 0}, "max_steps", id="max-steps-zero"),
    pytest.param(lambda p: {"max_steps": -3}, "max_steps", id="max-steps-negative"),
    pytest.param(lambda p: {"max_steps": 2.5}, "max_steps", id="max-steps-float"),
    pytest.param(lambda p: {"max_steps": True}, "max_steps", id="max-steps-bool"),
    pytest.param(lambda p: {"max_epochs": 0}, "max_epochs", id="max-epochs-zero"),
    pytest.param(lambda p: {"max_steps": None, "max_epochs": None}, "max_steps", id="no-limit"),
    pytest.param(lambda p: {"eval_every": 2}, "eval_every", id="eval-every-without-eval-data"),
    pytest.param(
        lambda p: {"eval_every": 0, "eval_data": tiny_loader(1)}, "eval_every", id="eval-every-0"
    ),
    pytest.param(lambda p: {"precision": "16"}, "precision", id="bad-precision"),
    pytest.param(lambda p: {"precision": 32}, "precision", id="precision-int"),
    pytest.param(lambda p: {"precision": "fp16", "device": "cpu"}, "precision", id="fp16-cpu"),
    pytest.param(lambda p: {"device": "gpu0"}, "device", id="bad-device-string"),
    pytest.param(lambda p: {"device": None}, "device", id="device-none"),
    pytest.param(
        lambda p: {"device": "cuda"},
        "device",
        id="cuda-without-cuda",
        marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available"),
    ),
    pytest.param(lambda p: {"log_every": 0}, "log_every", id="log-every-0"),
    pytest.param(lambda p: {"log_every": "10"}, "log_every", id="log-every-str"),
    pytest.param(lambda p: {"accumulate": 0}, "accumulate", id="accumulate-0"),
    pytest.param(lambda p: {"accumulate": None}, "accumulate", id="accumulate-none"),
    pytest.param(lambda p: {"clip_grad_norm": 0}, "clip_grad_norm", id="clip-0"),
    pytest.param(lambda p: {"clip_grad_norm": -1.0}, "clip_grad_norm", id="clip-negative"),
    pytest.param(lambda p: {"clip_grad_norm": float("inf")}, "clip_grad_norm", id="clip-inf"),
    pytest.param(lambda p: {"clip_grad_norm": "1.0"}, "clip_grad_norm", id="clip-str"),
    pytest.param(lambda p: {"barrier_timeout": 0}, "barrier_timeout", id="barrier-timeout-0"),
    pytest.param(
        lambda p: {"barrier_timeout": float("nan")}, "barrier_timeout", id="barrier-timeout-nan"
    ),
    pytest.param(lambda p: {"barriers": [int]}, "barriers", id="barriers-not-events"),
    pytest.param(lambda p: {"barriers": 5}, "barriers", id="barriers-not-iterable"),
    pytest.param(lambda p: {"on_nonfinite": "warn"}, "on_nonfinite", id="bad-on-nonfinite"),
    pytest.param(lambda p: {"metrics": {"acc": 3}}, "metrics", id="metric-not-callable"),
    pytest.param(
        lambda p: {"metrics": {"not an id": lambda o, t: 0.0}}, "metrics", id="metric-bad-name"
    ),
    pytest.param(lambda p: {"metrics": 5}, "metrics", id="metrics-int"),
    pytest.param(lambda p: {"metrics": "acc"}, "metrics", id="metrics-str"),
    pytest.param(lambda p: {"seed": -1}, "seed", id="seed-negative"),
    pytest.param(lambda p: {"scheduler": object()}, "scheduler", id="scheduler-without-step"),
    pytest.param(
        lambda p: {
            "scheduler": torch.optim.lr_scheduler.StepLR(
                torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1), 1
            )
        },
        "scheduler",
        id="scheduler-of-another-optimizer",
    ),
    pytest.param(
        lambda p: {"eval_data": iter(tiny_loader(1))}, "eval_data", id="eval-data-one-shot"
    ),
    pytest.param(
        lambda p: {"train_data": iter(tiny_loader(2)), "max_epochs": 2},
        "train_data",
        id="train-data-one-shot-for-two-epochs",
    ),
    pytest.param(
        lambda p: {"scheduler_interval": "batch"}, "scheduler_interval", id="bad-interval"
    ),
    pytest.param(lambda p: {"eval_at_epoch_end": 1}, "eval_at_epoch_end", id="eval-at-end-int"),
    pytest.param(
        lambda p: {"checkpoint_dir": _touch(p / "afile")}, "checkpoint_dir", id="ckpt-dir-is-file"
    ),
    pytest.param(lambda p: {"checkpoint_dir": 5}, "checkpoint_dir", id="ckpt-dir-int"),
    pytest.param(lambda p: {"checkpoint_dir": ""}, "checkpoint_dir", id="ckpt-dir-empty"),
    pytest.param(lambda p: {"callbacks": [object()]}, "callbacks", id="callback-not-callback"),
    pytest.param(lambda p: {"callbacks": [int]}, "callbacks", id="callback-class-not-callback"),
    pytest.param(lambda p: {"callbacks": 5}, "callbacks", id="callbacks-not-iterable"),
    pytest.param(lambda p: {"handle_signals": "yes"}, "handle_signals", id="handle-signals-str"),
    pytest.param(lambda p: {"bus": object()}, "bus", id="bus-not-eventbus"),
]


@pytest.mark.parametrize(("overrides", "field"), CASES)
def test_bad_argument_is_a_config_error_naming_the_field(
    tmp_path: Path, overrides: Callable[[Path], dict[str, Any]], field: str
) -> None:
    model = tiny_model()
    kwargs: dict[str, Any] = {
        "model": model,
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
        "train_data": tiny_loader(2, 4),
        "loss_fn": F.cross_entropy,
        "max_steps": 2,
        "checkpoint_dir": tmp_path / "run",
        "handle_signals": False,
    }
    kwargs.update(overrides(tmp_path))
    before = sorted(tmp_path.rglob("*"))
    positional = (kwargs.pop("model"), kwargs.pop("optimizer"), kwargs.pop("train_data"))
    with pytest.raises(ConfigError) as info:
        Trainer(*positional, **kwargs)
    assert isinstance(info.value, ValueError)
    assert field in str(info.value), str(info.value)
    # Nothing touched the disk: no run folder, no new file.
    assert not (tmp_path / "run").exists()
    assert sorted(tmp_path.rglob("*")) == before


def test_valid_arguments_construct(tmp_path: Path) -> None:
    """Control: the base arguments of the cases above are valid (so each case fails alone)."""
    model = tiny_model()
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        tiny_loader(2, 4),
        loss_fn=F.cross_entropy,
        max_steps=2,
        checkpoint_dir=tmp_path / "run",
        handle_signals=False,
        callbacks=[_Noop],
    )
    assert trainer.settings.max_steps == 2
    assert not (tmp_path / "run").exists()  # created at the first save, never before


def test_misspelt_callback_method_is_a_config_error() -> None:
    class Typo(Callback):
        def on_step_end(self, event: Any) -> None:  # should be on_step_ended
            pass

    model = tiny_model()
    with pytest.raises(ConfigError, match="on_step_ended"):
        Trainer(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            tiny_loader(2, 4),
            loss_fn=F.cross_entropy,
            max_steps=2,
            callbacks=[Typo()],
        )

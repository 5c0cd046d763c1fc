"""What a checkpoint holds: every piece round-trips through a weights_only load, and a resume
into a different model, optimizer or world size is refused naming the difference."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from trainbus import CheckpointError, ConfigError
from trainbus.checkpoint import (
    FORMAT_VERSION,
    TrainState,
    capture_rng,
    load_checkpoint,
    read_checkpoint,
    restore_rng,
    save_checkpoint,
)
from trainbus.testing import tiny_model

from .conftest import trained


def _save(directory: Path, **extra: Any) -> Path:
    model, opt, sched = trained()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    return save_checkpoint(directory, tag="t", state=TrainState(step=3, epoch=1,
                           batch_in_epoch=2, samples_seen=96), model=model, optimizer=opt,
                           scheduler=sched, scaler=scaler, metrics={"val_loss": 0.25},
                           **extra)  # fmt: skip


def _draws() -> tuple[float, torch.Tensor, float]:
    return random.random(), torch.rand(4), float(np.random.rand())


def test_every_piece_round_trips(tmp_path: Path) -> None:
    model, opt, sched = trained()
    callbacks = {
        "EarlyStopping": {"best": 0.5, "wait": 2, "history": [1.0, 0.5], "mode": "min",
                          "stopped": False, "extra": None, "t": torch.arange(3)},
    }  # fmt: skip
    order = {"kind": "sequence", "epoch": 1, "exact": True, "state": None}
    random.seed(1)
    torch.manual_seed(1)
    np.random.seed(1)
    np.random.randn()  # a cached Gaussian is part of NumPy's state
    path = _save(tmp_path, data_order=order, callback_states=callbacks)
    expected = _draws()

    ck = read_checkpoint(path)  # weights_only=True inside
    assert ck.state == TrainState(step=3, epoch=1, batch_in_epoch=2, samples_seen=96)
    assert ck.metrics == {"val_loss": 0.25}
    assert ck.data_order == order
    assert ck.callbacks["EarlyStopping"]["history"] == [1.0, 0.5]
    assert torch.equal(ck.callbacks["EarlyStopping"]["t"], torch.arange(3))
    assert ck.meta["world_size"] == 1 and ck.meta["optimizer"] == "SGD"
    assert ck.meta["param_shapes"] == {n: list(p.shape) for n, p in model.named_parameters()}
    assert ck.meta["torch_version"] == torch.__version__
    assert ck.scaler is not None and ck.scaler["scale"] == 1024.0

    other = tiny_model(seed=5)
    other_opt = torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9)
    other_sched = torch.optim.lr_scheduler.StepLR(other_opt, step_size=1, gamma=0.7)
    other_scaler = torch.amp.GradScaler("cpu")
    random.seed(9)
    torch.manual_seed(9)
    np.random.seed(9)
    state, metrics = load_checkpoint(path, model=other, optimizer=other_opt,
                                     scheduler=other_sched, scaler=other_scaler)  # fmt: skip
    assert state == ck.state and metrics == {"val_loss": 0.25}
    got = _draws()
    assert got[0] == expected[0] and torch.equal(got[1], expected[1]) and got[2] == expected[2]
    for a, b in zip(other.state_dict().values(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    for p, q in zip(model.parameters(), other.parameters(), strict=True):
        assert torch.equal(opt.state[p]["momentum_buffer"], other_opt.state[q]["momentum_buffer"])
    assert other_sched.state_dict() == sched.state_dict()
    assert other_scaler.get_scale() == 1024.0


def test_rng_states_round_trip_exactly(tmp_path: Path) -> None:
    random.seed(3)
    torch.manual_seed(3)
    np.random.seed(3)
    random.gauss(0, 1)  # Python's cached Gaussian is part of its state
    path = _save(tmp_path)
    expected = [_draws() for _ in range(3)]
    for _ in range(5):
        _draws()
    load_checkpoint(path, model=trained()[0], optimizer=trained()[1], scheduler=None,
                    scaler=None)  # fmt: skip
    got = [_draws() for _ in range(3)]
    for (a, b, c), (x, y, z) in zip(expected, got, strict=True):
        assert a == x and torch.equal(b, y) and c == z


def test_restore_rng_false_leaves_the_generators_alone(tmp_path: Path) -> None:
    path = _save(tmp_path)
    torch.manual_seed(42)
    expected = torch.rand(3)
    torch.manual_seed(42)
    model, opt, _ = trained()
    torch.manual_seed(42)
    load_checkpoint(path, model=model, optimizer=opt, scheduler=None, scaler=None,
                    restore_rng=False)  # fmt: skip
    assert torch.equal(torch.rand(3), expected)


def test_capture_rng_is_plain_containers_and_tensors() -> None:
    state = capture_rng()
    assert set(state) >= {"python", "torch", "numpy"}
    assert state["python"]["internal"].dtype == torch.int64
    restore_rng(state)
    a = random.random()
    restore_rng(state)
    assert random.random() == a


def test_format_version_is_written(tmp_path: Path) -> None:
    payload = torch.load(_save(tmp_path), weights_only=True)
    assert payload["format"] == FORMAT_VERSION and payload["magic"] == "trainbus-checkpoint"


@pytest.mark.parametrize(
    ("state", "where"),
    [
        pytest.param({"ES": {"fn": print}}, "callback_states['ES']['fn']", id="function"),
        pytest.param({"ES": {"a": np.zeros(2)}}, "callback_states['ES']['a']", id="ndarray"),
        pytest.param({"ES": {"s": {1, 2}}}, "callback_states['ES']['s']", id="set"),
        pytest.param({"ES": {(1, 2): 3}}, "callback_states['ES']", id="tuple-key"),
    ],
)
def test_a_callback_state_that_weights_only_cannot_load_is_refused(
    tmp_path: Path, state: dict[str, Any], where: str
) -> None:
    with pytest.raises(ConfigError, match=r"callback_states\['ES'\]") as info:
        _save(tmp_path, callback_states=state)
    assert where in str(info.value)
    assert not tmp_path.exists() or not list(tmp_path.iterdir())  # nothing written


# ---------------------------------------------------------------------------- compatibility


def _load_into(path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer,
               world_size: int = 1) -> None:  # fmt: skip
    load_checkpoint(path, model=model, optimizer=opt, scheduler=None, scaler=None,
                    world_size=world_size)  # fmt: skip


def test_resume_into_another_model_shape_is_refused(tmp_path: Path) -> None:
    path = _save(tmp_path)
    wider = tiny_model(hidden=128)
    before = [p.detach().clone() for p in wider.parameters()]
    with pytest.raises(CheckpointError, match="does not fit this run") as info:
        _load_into(path, wider, torch.optim.SGD(wider.parameters(), lr=0.1))
    assert "parameter '0.weight' has shape [64, 32] in the checkpoint but [128, 32]" in str(
        info.value
    )
    assert all(torch.equal(a, b) for a, b in zip(before, wider.parameters(), strict=True))


def test_resume_into_another_model_structure_is_refused(tmp_path: Path) -> None:
    path = _save(tmp_path)
    other = torch.nn.Sequential(torch.nn.Linear(32, 10))
    with pytest.raises(CheckpointError, match=r"parameters \['2.bias', '2.weight'\] are in the "
                       "checkpoint but not in the model"):  # fmt: skip
        _load_into(path, other, torch.optim.SGD(other.parameters(), lr=0.1))


def test_resume_with_another_optimizer_type_is_refused(tmp_path: Path) -> None:
    path = _save(tmp_path)
    model = tiny_model()
    with pytest.raises(CheckpointError, match="the optimizer is SGD in the checkpoint but Adam"):
        _load_into(path, model, torch.optim.Adam(model.parameters()))


def test_resume_with_another_world_size_is_refused(tmp_path: Path) -> None:
    path = _save(tmp_path)
    model = tiny_model()
    with pytest.raises(CheckpointError, match="world size is 1 in the checkpoint but 2 now"):
        _load_into(path, model, torch.optim.SGD(model.parameters(), lr=0.1), world_size=2)


@pytest.mark.cuda
def test_cuda_rng_round_trips(tmp_path: Path) -> None:
    torch.cuda.manual_seed_all(4)
    path = _save(tmp_path)
    expected = torch.rand(4, device="cuda")
    torch.cuda.manual_seed_all(5)
    model, opt, _ = trained()
    load_checkpoint(path, model=model, optimizer=opt, scheduler=None, scaler=None)
    assert torch.equal(torch.rand(4, device="cuda"), expected)


def test_the_train_state_advances_only_through_its_methods() -> None:
    """The run's position has one owner: its fields are read-only; the loop's four moves are
    its methods, and a checkpoint writes and reads it through ``as_dict`` / ``from_dict``
    (a file of an earlier version, without ``evaluated_step``, reads as never evaluated)."""
    st = TrainState(step=4, epoch=1, batch_in_epoch=2, samples_seen=40)
    for name in TrainState.FIELDS:
        with pytest.raises(AttributeError):
            setattr(st, name, 0)
    assert st.batch_taken() == 2 and st.batch_in_epoch == 3
    st.samples_done(8)
    st.step_done()
    assert (st.step, st.epoch, st.batch_in_epoch, st.samples_seen) == (5, 1, 3, 48)
    st.epoch_done()
    assert (st.step, st.epoch, st.batch_in_epoch, st.samples_seen) == (5, 2, 0, 48)
    saved = st.as_dict()
    assert saved == {"step": 5, "epoch": 2, "batch_in_epoch": 0, "samples_seen": 48,
                     "evaluated_step": -1, "closed_epoch": -1}  # fmt: skip
    earlier = {k: v for k, v in saved.items() if k not in ("evaluated_step", "closed_epoch")}
    assert TrainState.from_dict(earlier) == st
    st.evaluated()
    st.epoch_closed()
    assert (st.evaluated_step, st.closed_epoch) == (5, 2)
    saved = st.as_dict()
    assert TrainState.from_dict(saved) == st and TrainState.from_dict(saved) is not st
    assert repr(st) == (
        "TrainState(step=5, epoch=2, batch_in_epoch=0, samples_seen=48, evaluated_step=5, "
        "closed_epoch=2)"
    )
    assert st != TrainState(step=5)

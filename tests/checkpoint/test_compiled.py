"""Checkpoints of a ``torch.compile``d model: written under the original
module's keys, loadable into the plain model and back, old ``_orig_mod.`` checkpoints too.

The compiled runs use ``backend="eager"``: the keys come from ``torch.compile``'s wrapper
(``OptimizedModule``) whatever the backend, and inductor's C++ build of even this tiny MLP
takes over a minute on the shared 2-core CI machines (about 85 s measured for one forward).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from trainbus import Trainer
from trainbus.checkpoint import load_checkpoint
from trainbus.testing import tiny_loader, tiny_model

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")


def _fit(model: torch.nn.Module, ckpt: Path, steps: int, resume: Path | None = None) -> Path:
    torch.manual_seed(1)
    trainer = Trainer(model, torch.optim.Adam(model.parameters(), lr=0.01), tiny_loader(8, 4),
                      loss_fn=F.cross_entropy, max_steps=steps, checkpoint_dir=ckpt,
                      progress=False)  # fmt: skip
    result = trainer.fit_sync(resume=resume)
    assert result.last_checkpoint is not None
    return Path(result.last_checkpoint)


def _keys(path: Path) -> list[str]:
    payload = torch.load(path, weights_only=True)
    return list(payload["model"]) + list(payload["meta"]["param_shapes"])


def test_a_compiled_runs_checkpoint_loads_into_the_plain_model(tmp_path: Path) -> None:
    torch.manual_seed(0)
    plain = tiny_model()
    compiled = torch.compile(plain, backend="eager")
    path = _fit(compiled, tmp_path / "c", steps=3)
    assert not any("_orig_mod" in k for k in _keys(path))
    fresh = tiny_model()
    load_checkpoint(
        path,
        model=fresh,
        optimizer=torch.optim.Adam(fresh.parameters()),
        scheduler=None,
        scaler=None,
    )
    for (name, a), (_, b) in zip(plain.state_dict().items(), fresh.state_dict().items(),
                                 strict=True):  # fmt: skip
        assert torch.equal(a.cpu(), b.cpu()), name  # trained on the run's device


def test_resume_crosses_compiled_and_plain_both_ways_and_stays_exact(tmp_path: Path) -> None:
    """6 plain steps == 2 plain + 2 compiled + 2 plain, resumed from each other's files."""
    torch.manual_seed(0)
    reference = tiny_model()
    start = {k: v.clone() for k, v in reference.state_dict().items()}
    _fit(reference, tmp_path / "ref", steps=6)

    model = tiny_model()
    model.load_state_dict(start)
    first = _fit(model, tmp_path / "run", steps=2)
    again = tiny_model()
    second = _fit(torch.compile(again, backend="eager"), tmp_path / "run", steps=4, resume=first)
    last = tiny_model()
    _fit(last, tmp_path / "run", steps=6, resume=second)
    for name, value in reference.state_dict().items():
        assert torch.equal(value, last.state_dict()[name]), name


def test_a_checkpoint_with_orig_mod_keys_loads_into_plain_and_compiled(tmp_path: Path) -> None:
    """Written by an earlier trainbus from a compiled model: keys ``_orig_mod.*``."""
    torch.manual_seed(0)
    source = tiny_model()
    path = _fit(source, tmp_path / "c", steps=2)
    payload = torch.load(path, weights_only=True)
    payload["model"] = {f"_orig_mod.{k}": v for k, v in payload["model"].items()}
    shapes = payload["meta"]["param_shapes"]
    payload["meta"]["param_shapes"] = {f"_orig_mod.{k}": v for k, v in shapes.items()}
    old = tmp_path / "old.pt"
    torch.save(payload, old)
    for target in (tiny_model(), torch.compile(tiny_model(), backend="eager")):
        load_checkpoint(
            old,
            model=target,
            optimizer=torch.optim.Adam(target.parameters()),
            scheduler=None,
            scaler=None,
        )
        assert torch.equal(next(iter(target.state_dict().values())).cpu(),
                           next(iter(source.state_dict().values())).cpu())  # fmt: skip


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.BatchNorm1d(16))
        self.head = torch.nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


def test_a_compiled_submodule_and_in_place_compile_keep_the_plain_keys(tmp_path: Path) -> None:
    torch.manual_seed(0)
    parts = Net()
    parts.encoder = torch.compile(parts.encoder, backend="eager")  # type: ignore[assignment]
    assert any("_orig_mod" in k for k in parts.state_dict())
    path = _fit(parts, tmp_path / "parts", steps=2)
    assert not any("_orig_mod" in k for k in _keys(path))
    in_place = Net()
    in_place.compile(backend="eager")  # compiles forward in place: the keys never change
    load_checkpoint(
        path,
        model=in_place,
        optimizer=torch.optim.Adam(in_place.parameters()),
        scheduler=None,
        scaler=None,
    )
    for name, value in in_place.state_dict().items():
        expected = parts.state_dict()[name.replace("encoder.", "encoder._orig_mod.", 1)]
        assert torch.equal(value.cpu(), expected.cpu()), name
    _fit(in_place, tmp_path / "parts", steps=3, resume=path)  # trains on from it

"""One device per run, on every thread: resolving ``"auto"``/``"cuda"`` to an index,
making it current on the loop's and evaluate/predict's worker threads, moving every batch the
model sees (dataclasses, objects with ``.to()``, a batch a hook replaced), and the bad input
refused up front. CPU-checkable through ``tests/_fake_cuda.py``; the ``cuda`` tests need a GPU.
"""

from __future__ import annotations

import threading
from collections import namedtuple
from dataclasses import dataclass, field
from typing import Any

import anyio
import pytest
import torch
import torch.nn.functional as F
from tests._fake_cuda import FakeCuda, HostModel, Placed, placed_batches

from trainbus import ConfigError, Trainer
from trainbus._tensors import move_to_device, resolve_device

META = torch.device("meta")  # a second device every CPU host has: shows a move really happened


def host_trainer(model: HostModel, **kwargs: Any) -> Trainer:
    kwargs.setdefault("max_steps", 4)
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), placed_batches(4),
                   progress=False, handle_signals=False, **kwargs)  # fmt: skip


# ------------------------------------------------------------------ resolving the device
@pytest.mark.parametrize("asked", ["auto", "cuda", torch.device("cuda")])
def test_auto_and_cuda_resolve_to_the_current_index(fake_cuda: FakeCuda, asked: Any) -> None:
    fake_cuda.set_device(1)  # the main thread's current device, as a user may set it
    trainer = host_trainer(HostModel(), device=asked)
    assert trainer.settings.device == torch.device("cuda", 1)


def test_cuda_resolves_to_0_without_starting_cuda(
    fake_cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    def current_device() -> int:
        raise AssertionError("current_device() starts CUDA")

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", current_device)
    assert resolve_device("cuda") == resolve_device("auto") == torch.device("cuda", 0)


def test_an_index_is_kept(fake_cuda: FakeCuda) -> None:
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert resolve_device("cpu") == torch.device("cpu")


def test_an_index_the_host_lacks_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeCuda(monkeypatch, count=1)
    with pytest.raises(ConfigError, match=r"device='cuda:3'.*cuda:0 \(1 CUDA device\)"):
        host_trainer(HostModel(), device="cuda:3")


def test_a_torch_device_beyond_the_gpus_names_them_all(fake_cuda: FakeCuda) -> None:
    with pytest.raises(ConfigError, match=r"device='cuda:5'.*cuda:0, cuda:1 \(2 CUDA devices\)"):
        host_trainer(HostModel(), device=torch.device("cuda", 5))


def test_cuda_without_cuda_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"device='cuda'.*CUDA is not available"):
        host_trainer(HostModel(), device="cuda")
    assert host_trainer(HostModel(), device="auto").settings.device.type in ("cpu", "mps")


def test_an_unknown_device_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"device='gpu0'.*'cuda:N'"):
        host_trainer(HostModel(), device="gpu0")


def test_bf16_on_a_gpu_without_bf16_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeCuda(monkeypatch, count=1, major=7)
    with pytest.raises(ConfigError, match=r"precision='bf16'.*cuda:0 \(Fake GPU, compute "
                       r"capability 7\.0\)"):  # fmt: skip
        host_trainer(HostModel(), device="cuda", precision="bf16")
    assert host_trainer(HostModel(), device="cuda").settings.precision == "32"


def test_bf16_on_a_gpu_with_bf16_is_accepted(fake_cuda: FakeCuda) -> None:
    trainer = host_trainer(HostModel(), device="cuda:1", precision="bf16")
    assert trainer.settings.device == torch.device("cuda", 1)


# ------------------------------------------------------------------ the device on every thread
def test_the_loop_thread_makes_the_run_device_current(fake_cuda: FakeCuda) -> None:
    model = HostModel()
    result = host_trainer(model, device="cuda:1").fit_sync()
    assert result.reason == "completed" and result.steps == 4
    main = threading.current_thread().name
    assert {(device, current) for device, current, _ in model.seen} == {
        (torch.device("cuda", 1), 1)
    }
    threads = {thread for _, _, thread in model.seen}
    assert main not in threads  # the loop ran on a worker thread, which made cuda:1 current
    assert [(t, i) for t, i in fake_cuda.set_calls if t in threads] == [(threads.pop(), 1)]


def test_predict_thread_makes_the_run_device_current(fake_cuda: FakeCuda) -> None:
    model = HostModel()
    trainer = host_trainer(model, device="cuda:1")
    trainer.predict_sync(placed_batches(3, seed=1))
    assert [(d, c) for d, c, _ in model.seen] == [(torch.device("cuda", 1), 1)] * 3
    assert threading.current_thread().name not in {t for _, _, t in model.seen}


class _Current(Exception):
    """Raised by the patched ``set_device`` to end the evaluation where it made the device
    current (a pretend GPU cannot hold the evaluator's sums)."""


def test_evaluate_thread_makes_the_run_device_current(
    fake_cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    trainer = host_trainer(HostModel(), device="cuda:1", eval_data=placed_batches(2))
    calls: list[tuple[str, Any]] = []

    def set_device(device: Any) -> None:
        calls.append((threading.current_thread().name, device))
        raise _Current

    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    with pytest.raises(_Current):
        trainer.evaluate_sync()
    assert calls == [(calls[0][0], torch.device("cuda", 1))]
    assert calls[0][0] != threading.current_thread().name


# ------------------------------------------------------------------ every batch on the device
def test_a_batch_a_hook_replaced_is_moved(fake_cuda: FakeCuda) -> None:
    model = HostModel()
    trainer = host_trainer(model, device="cuda:1")
    fresh = placed_batches(1, seed=2)[0]

    def replace(ctx: Any) -> None:
        ctx.batch = Placed(fresh.x, fresh.y)  # built on the host, as a hook would

    trainer.add_hook("batch", replace)
    trainer.fit_sync()
    assert [d for d, _, _ in model.seen] == [torch.device("cuda", 1)] * 4


def test_an_eval_and_predict_batch_a_hook_replaced_is_moved(fake_cuda: FakeCuda) -> None:
    model = HostModel()
    trainer = host_trainer(model, device="cuda:1")
    trainer.add_hook(
        "eval_batch", lambda ctx: setattr(ctx, "batch", Placed(ctx.batch.x, ctx.batch.y))
    )
    trainer.predict_sync(placed_batches(2))
    assert [d for d, _, _ in model.seen] == [torch.device("cuda", 1)] * 2


@dataclass(frozen=True, slots=True)
class Pair:
    inputs: torch.Tensor
    targets: torch.Tensor
    name: str = "pair"
    extra: list[torch.Tensor] = field(default_factory=list)


@dataclass
class Only:
    t: torch.Tensor


class WithTo:
    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def to(self, device: torch.device) -> WithTo:
        return WithTo(self.t.to(device))


def test_move_to_device_walks_dataclasses_and_objects_with_to() -> None:
    x, y = torch.ones(2, 3), torch.zeros(2)
    moved = move_to_device(Pair(x, y, extra=[x]), META)
    assert isinstance(moved, Pair) and moved.name == "pair"
    assert moved.inputs.device == META and moved.targets.device == META
    assert moved.extra[0].device == META
    assert move_to_device(WithTo(x), META).t.device == META
    nested = move_to_device({"a": [WithTo(x)], "b": (Pair(x, y),)}, META)
    assert nested["a"][0].t.device == META and nested["b"][0].inputs.device == META
    Point = namedtuple("Point", "a b")
    point = move_to_device(Point(x, "label"), META)
    assert isinstance(point, Point) and point.a.device == META and point.b == "label"


def test_move_to_device_leaves_what_it_cannot_move() -> None:
    x = torch.ones(2)
    only = Only(x)
    assert move_to_device(only, torch.device("cpu")) is only  # nothing to move: no copy
    assert move_to_device("text", META) == "text"
    assert move_to_device(Pair, META) is Pair  # a class has .to only as an unbound function
    assert move_to_device(3, META) == 3


# ------------------------------------------------------------------ on a real GPU
@pytest.mark.cuda
def test_cuda_run_keeps_its_device_on_every_thread() -> None:
    index = torch.cuda.device_count() - 1  # the last GPU: not the default current device
    seen: list[tuple[int, torch.device]] = []

    class Probe(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append((torch.cuda.current_device(), x.device))
            return self.lin(x)

    @dataclass
    class Batch:
        x: torch.Tensor
        y: torch.Tensor

    model = Probe()
    data = [Batch(torch.randn(8, 4), torch.randint(0, 2, (8,))) for _ in range(4)]
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
                      loss_fn=lambda out, y: F.cross_entropy(out, y), max_steps=4,
                      device=f"cuda:{index}", progress=False, handle_signals=False)  # fmt: skip
    # A dataclass batch is not (inputs, targets): unpack it in a hook, after the move.
    trainer.add_hook("batch", lambda ctx: setattr(ctx, "batch", (ctx.batch.x, ctx.batch.y)))
    # An evaluation or prediction batch replaced by host copies: moved back before the model.
    host = torch.device("cpu")
    trainer.add_hook(
        "eval_batch", lambda ctx: setattr(ctx, "batch", move_to_device(ctx.batch, host))
    )

    async def session() -> None:  # fit, predict and evaluate: three worker threads, one bus
        async with trainer.bus:
            assert (await trainer.fit()).reason == "completed"
            await trainer.predict([torch.randn(8, 4) for _ in range(2)])
            await trainer.evaluate([(torch.randn(8, 4), torch.randint(0, 2, (8,)))])

    anyio.run(session)
    device = torch.device("cuda", index)
    assert len(seen) == 4 + 2 + 1 and set(seen) == {(index, device)}

"""ProcessGroup: the single-process fallback, torchrun's variables validated, and a clear error
when the master cannot be reached."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from trainbus import ConfigError, Trainer
from trainbus._distributed import data as data_module
from trainbus._distributed.group import ProcessGroup, choose_backend
from trainbus.testing import tiny_loader, tiny_model

from ._torchrun import env, free_port


@pytest.mark.parametrize("environ", [{}, {"WORLD_SIZE": "1", "RANK": "0"}])
def test_without_torchrun_the_group_is_one_process(environ: dict[str, str]) -> None:
    group = ProcessGroup.from_env(environ)
    assert (group.rank, group.world_size, group.distributed, group.is_main) == (0, 1, False, True)
    assert not group.owns_group and not dist.is_initialized()
    group.barrier()  # nothing to wait for
    group.close()
    group.close()  # idempotent


@pytest.mark.parametrize(
    ("environ", "field"),
    [
        ({"WORLD_SIZE": "two"}, "WORLD_SIZE"),
        ({"WORLD_SIZE": "2"}, "RANK"),
        ({"WORLD_SIZE": "2", "RANK": "2", "LOCAL_RANK": "0"}, "RANK"),
        ({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}, "MASTER_ADDR"),
        (
            {
                "WORLD_SIZE": "2",
                "RANK": "1",
                "LOCAL_RANK": "1",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": "x",
            },
            "MASTER_PORT",
        ),
    ],
)
def test_bad_torchrun_variables_name_the_variable(environ: dict[str, str], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        ProcessGroup.from_env(environ)


def test_bad_backend_and_timeout() -> None:
    with pytest.raises(ConfigError, match="backend"):
        ProcessGroup.from_env({}, backend="mpi")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="timeout"):
        ProcessGroup.from_env({}, timeout=0)


UNREACHABLE = """
import sys
from trainbus import DistributedError
from trainbus._distributed.group import ProcessGroup
try:
    ProcessGroup.from_env(timeout=1)
except DistributedError as exc:
    print(exc)
    sys.exit(3)
"""


@pytest.mark.slow
def test_an_unreachable_master_is_a_clear_timeout() -> None:
    port = free_port()  # nobody listens there
    child = env() | {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
                     "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}  # fmt: skip
    done = subprocess.run([sys.executable, "-c", UNREACHABLE], env=child, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert done.returncode == 3, done.stderr[-2000:]
    assert f"MASTER_ADDR:MASTER_PORT=127.0.0.1:{port}" in done.stdout
    assert "rank 1 of 2" in done.stdout and "within 1 s" in done.stdout


# ---------------------------------------------------------------- the backend follows the run
TORCHRUN_ENV = {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": "29500"}  # fmt: skip


def tiny() -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    model = tiny_model()
    return model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_loader(2)


class _Joined(Exception):
    """Raised by the patched init_process_group: the group would have been started here."""


@pytest.fixture
def gpu_host(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any]]:
    """A pretend host with ONE GPU; records init_process_group / set_device calls instead of
    running them (no collective can happen in this process)."""
    calls: list[tuple[str, Any]] = []

    def init(backend: str, **kw: Any) -> None:
        calls.append(("init", backend))
        raise _Joined(backend)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(dist, "init_process_group", init)
    return calls


def test_a_cpu_run_on_a_gpu_host_joins_with_gloo(gpu_host: list[tuple[str, Any]]) -> None:
    with pytest.raises(_Joined):
        ProcessGroup.from_env(TORCHRUN_ENV, device=torch.device("cpu"))
    assert gpu_host == [("init", "gloo")]  # no NCCL, no set_device for a CPU run


def test_a_cuda_run_joins_with_nccl_on_its_local_gpu(gpu_host: list[tuple[str, Any]]) -> None:
    with pytest.raises(_Joined):
        ProcessGroup.from_env(TORCHRUN_ENV | {"LOCAL_RANK": "0"}, device=torch.device("cuda", 0))
    assert gpu_host == [("set_device", torch.device("cuda", 0)), ("init", "nccl")]


def test_more_local_ranks_than_gpus_fails_before_any_collective(
    gpu_host: list[tuple[str, Any]],
) -> None:
    with pytest.raises(ConfigError) as info:
        ProcessGroup.from_env(TORCHRUN_ENV, device=torch.device("cuda", 0))
    message = str(info.value)
    assert "LOCAL_RANK=1" in message and "1 visible CUDA device" in message
    assert "device='cpu'" in message  # says what to do
    assert gpu_host == []  # neither set_device nor init_process_group ran


def test_the_local_rank_check_applies_to_a_forced_nccl_backend_too(
    gpu_host: list[tuple[str, Any]],
) -> None:
    with pytest.raises(ConfigError, match="LOCAL_RANK=1"):
        ProcessGroup.from_env(TORCHRUN_ENV, backend="nccl")
    assert gpu_host == []


def test_choose_backend() -> None:
    assert choose_backend(torch.device("cpu")) == "gloo"
    assert choose_backend(torch.device("cuda", 1)) == "nccl"
    assert choose_backend(torch.device("cuda", 1), "gloo") == "gloo"


def test_a_single_process_group_takes_the_runs_device(gpu_host: list[tuple[str, Any]]) -> None:
    assert ProcessGroup.from_env({}, device=torch.device("cpu")).device == torch.device("cpu")
    assert gpu_host == []


def test_the_trainer_device_cpu_under_torchrun_on_a_gpu_host_gets_gloo_and_a_cpu_ddp(
    gpu_host: list[tuple[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Trainer(device="cpu") under torchrun on a GPU host: the trainer hands its device to the
    group (gloo, not NCCL), and a gloo group's DDP gets no CUDA device_ids."""
    for name, value in TORCHRUN_ENV.items():
        monkeypatch.setenv(name, value)
    trainer = Trainer(*tiny(), loss_fn=F.cross_entropy, max_steps=1, device="cpu",
                      progress=False, handle_signals=False)  # fmt: skip
    with pytest.raises(_Joined):
        trainer.fit_sync()
    assert gpu_host == [("init", "gloo")]
    group = ProcessGroup(rank=1, world_size=2, local_rank=1, backend="gloo",
                         device=torch.device("cpu"), created=False)  # fmt: skip
    seen: dict[str, Any] = {}

    class DDP:  # records what DistributedDataParallel would have been given
        def __init__(self, model: torch.nn.Module, device_ids: Any = None) -> None:
            seen["device_ids"] = device_ids

    monkeypatch.setattr(data_module, "DistributedDataParallel", DDP)
    data_module.wrap_model(torch.nn.Linear(2, 2), group)
    assert seen == {"device_ids": None}

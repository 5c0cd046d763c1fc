"""The process group: who this process is among the ranks, and the one place that starts and
ends ``torch.distributed``."""

from __future__ import annotations

import atexit
import datetime
import gc
import importlib
import os
import sys
import weakref
from collections.abc import Mapping
from typing import Literal

import torch
import torch.distributed as dist

from .._exceptions import ConfigError, DistributedError
from .._log import get_logger
from .._validate import check_seconds

__all__ = [
    "ENV_VARS",
    "ProcessGroup",
    "check_local_rank",
    "choose_backend",
    "release_sharding_caches",
]

log = get_logger(__name__)

ENV_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")  # torchrun's

Backend = Literal["gloo", "nccl"]


# Nothing may hold the default group past close() (gloo's threads can abort the finished
# process); torch.distributed.nn.functional binds it as a default argument when first
# imported, so it is imported here while no group exists.
if dist.is_available() and not dist.is_initialized():
    importlib.import_module("torch.distributed.nn.functional")


def release_sharding_caches() -> None:
    """Empty torch's DTensor caches, which keep device meshes (and so their process groups)
    alive past ``destroy_process_group()``; they refill on the next use. The native sharding
    cache is per thread: only the calling thread's is emptied."""
    if "torch.distributed.tensor._api" not in sys.modules:
        return  # no DTensor ever ran: nothing cached
    dtensor = sys.modules["torch.distributed.tensor._api"].DTensor
    propagator = getattr(getattr(dtensor, "_op_dispatcher", None), "sharding_propagator", None)
    redistribute = sys.modules.get("torch.distributed.tensor._redistribute")
    collectives = sys.modules.get("torch.distributed.tensor._collective_utils")
    transforms = getattr(redistribute, "_gen_transform_infos", None)  # DTensorSpecs
    topology = getattr(getattr(collectives, "MeshTopoInfo", None), "build_from_mesh", None)
    for clear in (
        getattr(getattr(propagator, "propagate_op_sharding", None), "cache_clear", None),
        getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None),  # this thread's
        getattr(transforms, "cache_clear", None),
        getattr(topology, "cache_clear", None),  # meshes
        getattr(redistribute, "clear_redistribute_planner_cache", None),  # planners: meshes
    ):
        if clear is not None:
            clear()


@atexit.register
def _release_at_exit() -> None:
    """DTensor work after the last fit: the caches let go while Python is whole, rather than
    leaving gloo's threads to interpreter teardown."""
    release_sharding_caches()
    gc.collect()  # a redistribute planner holds its mesh in a reference cycle


def _env_int(env: Mapping[str, str], name: str, minimum: int) -> int:
    text = env.get(name)
    try:
        value = int(text)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ConfigError.invalid(
            name,
            text,
            f"an integer >= {minimum} (set by torchrun; is every variable of "
            f"{', '.join(ENV_VARS)} set?)",
        ) from None
    if value < minimum:
        raise ConfigError.invalid(name, value, f"an integer >= {minimum}")
    return value


def choose_backend(device: torch.device | None, backend: Backend | None = None) -> Backend:
    """``backend`` when given, else NCCL for a CUDA ``device`` (no device: CUDA available),
    gloo otherwise."""
    if backend is not None:
        return backend
    if device is None:
        return "nccl" if torch.cuda.is_available() else "gloo"
    return "nccl" if device.type == "cuda" else "gloo"


def check_local_rank(local_rank: int, backend: str) -> None:
    """``ConfigError`` when an NCCL rank has no GPU of its own (no CUDA context made)."""
    if backend != "nccl":
        return
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise ConfigError(
            f"LOCAL_RANK={local_rank} needs cuda:{local_rank}, but this host has "
            f"{count} visible CUDA device(s) (torch.cuda.device_count()={count}); start at "
            f"most {count} rank(s) per node (torchrun --nproc_per_node={max(count, 1)}), "
            "or train on the CPU with Trainer(device='cpu') (gloo)"
        )


class ProcessGroup:
    """This process' place among the ranks, built with :meth:`from_env` or :meth:`single`;
    :meth:`close` tears down exactly what it started. ``backend`` is None for a single process;
    ``device`` is ``cuda:<local_rank>`` under NCCL, else the CPU."""

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        local_rank: int,
        backend: str | None,
        device: torch.device,
        created: bool,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.local_rank = local_rank
        self.backend = backend
        self.device = device
        self._created = created
        self._closed = False

    @classmethod
    def single(cls, device: torch.device | None = None) -> ProcessGroup:
        """Rank 0 of 1, no collectives, on ``device`` (default: CUDA when available)."""
        if device is None:
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return cls(rank=0, world_size=1, local_rank=0, backend=None, device=device, created=False)

    @classmethod
    def from_env(
        cls,
        env: Mapping[str, str] | None = None,
        *,
        backend: Backend | None = None,
        timeout: float = 300.0,
        device: torch.device | None = None,
    ) -> ProcessGroup:
        """An initialised ``torch.distributed`` adopted (never destroyed), :meth:`single`
        without ``WORLD_SIZE`` > 1, else ``init_process_group("env://")`` with torchrun's
        variables (``env`` is read for validation; default ``os.environ``) and a ``timeout``
        (seconds) for joining and for collectives.

        Raises:
            ConfigError: a torchrun variable is missing or not an integer, a bad ``backend``
                or ``timeout``, more local ranks than GPUs for a CUDA run.
            DistributedError: the group did not form within ``timeout``.
        """
        env = os.environ if env is None else env
        if backend not in (None, "gloo", "nccl"):
            raise ConfigError.invalid("backend", backend, "None (auto), 'gloo' or 'nccl'")
        seconds = check_seconds("timeout", timeout)
        if dist.is_available() and dist.is_initialized():
            chosen = str(dist.get_backend())
            local = _env_int(env, "LOCAL_RANK", 0) if "LOCAL_RANK" in env else 0
            check_local_rank(local, chosen)
            device = cls._device(chosen, local)
            return cls(
                rank=dist.get_rank(),
                world_size=dist.get_world_size(),
                local_rank=local,
                backend=chosen,
                device=device,
                created=False,
            )
        if "WORLD_SIZE" not in env or _env_int(env, "WORLD_SIZE", 1) == 1:
            return cls.single(device)
        world_size = _env_int(env, "WORLD_SIZE", 1)
        rank = _env_int(env, "RANK", 0)
        if rank >= world_size:
            raise ConfigError.invalid("RANK", rank, f"an integer below WORLD_SIZE={world_size}")
        local_rank = _env_int(env, "LOCAL_RANK", 0)
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            if not env.get(name):
                raise ConfigError.invalid(name, env.get(name), "set (by torchrun)")
        port = _env_int(env, "MASTER_PORT", 1)
        chosen = choose_backend(device, backend)
        if not dist.is_available():
            raise DistributedError("torch.distributed is not available in this torch build")
        check_local_rank(local_rank, chosen)  # before set_device and any collective
        device = cls._device(chosen, local_rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        where = f"{env['MASTER_ADDR']}:{port}"
        try:
            dist.init_process_group(
                chosen,
                init_method="env://",
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=seconds),
            )
        except (RuntimeError, ValueError) as exc:  # DistNetworkError, DistStoreError, ...
            raise DistributedError(
                f"rank {rank} of {world_size} could not join the process group at "
                f"MASTER_ADDR:MASTER_PORT={where} within {seconds:g} s ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''}); is the master reachable and "
                "every rank started (torchrun --nproc_per_node=N)?"
            ) from exc
        log.debug("process_group_started", rank=rank, world_size=world_size, backend=chosen)
        return cls(
            rank=rank,
            world_size=world_size,
            local_rank=local_rank,
            backend=chosen,
            device=device,
            created=True,
        )

    @staticmethod
    def _device(backend: str, local_rank: int) -> torch.device:
        return torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")

    @property
    def distributed(self) -> bool:
        """True when there is more than one rank (collectives run)."""
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """True on rank 0 (the rank that saves checkpoints and talks to the launcher)."""
        return self.rank == 0

    @property
    def owns_group(self) -> bool:
        """This object initialised ``torch.distributed`` (and :meth:`close` ends it)."""
        return self._created

    def barrier(self) -> None:
        """Wait until every rank reaches this call; ``DistributedError`` once closed."""
        if self._closed:
            raise DistributedError("barrier() on a closed ProcessGroup")
        if self.distributed:
            dist.barrier()

    def close(self) -> None:
        """Destroy the default group if this object created it, and warn when something still
        holds it; idempotent."""
        if self._closed:
            return
        self._closed = True
        release_sharding_caches()  # a sharded model's last collective has run
        if self._created and dist.is_initialized():
            world = dist.group.WORLD
            held = None if world is None else weakref.ref(world)
            del world
            dist.destroy_process_group()
            log.debug("process_group_destroyed", rank=self.rank, world_size=self.world_size)
            if held is not None and held() is not None:
                gc.collect()  # only where something held it: a reference cycle may be all it is
                if held() is not None:
                    log.warning(
                        "process_group_outlives_destroy",
                        rank=self.rank,
                        reason="something still holds the destroyed default process group (a "
                        "DistributedDataParallel model of your own, a model sharded with "
                        "fully_shard still referenced, or torch.distributed.nn.functional "
                        "first imported after init_process_group); its gloo threads "
                        "run on into interpreter exit, where they can abort the process "
                        "(SIGABRT): drop the holder, or import trainbus before "
                        "init_process_group",
                    )

    def __repr__(self) -> str:
        return (
            f"<ProcessGroup rank={self.rank} world_size={self.world_size} "
            f"backend={self.backend} device={self.device}>"
        )

"""One rank's part of a ``fit()``: process group, device, DDP model, sharded data, the link
to a ``trainbus launch`` driver and the attach listener."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from .._bus import EventBus
from .._distributed.attach_server import AttachServer
from .._distributed.data import check_mesh, release_model, shard_loader, wrap_model
from .._distributed.group import ProcessGroup
from .._distributed.link import WorkerLink
from .._loop import FitResult, Settings

__all__ = ["RankSetup"]


class RankSetup:
    """Joins the process group (a group of one outside torchrun) and tears it down after;
    ``ddp``: wrap the model in ``DistributedDataParallel`` with several ranks; ``attach``: the
    folder the main rank listens in for ``trainbus attach``, or None."""

    def __init__(self, bus: EventBus, *, ddp: bool, attach: Path | None = None) -> None:
        self._bus = bus
        self._ddp = ddp
        self._attach = attach
        self._server: AttachServer | None = None
        self._group: ProcessGroup | None = None
        self._link: WorkerLink | None = None
        self._wrapped: torch.nn.Module | None = None

    def join(self, s: Settings) -> tuple[ProcessGroup, Settings]:
        """Join the process group the environment describes (kept for :meth:`close`); the
        settings with this rank's own GPU as device (unchanged on one process)."""
        group = self._group = ProcessGroup.from_env(device=s.device)
        if group.distributed and group.device.type == "cuda" and s.device.type == "cuda":
            s = dataclasses.replace(s, device=group.device)
        return group, s

    def distribute(self, s: Settings) -> Settings:
        """The settings one rank trains with: DDP model, sharded data (same on one process)."""
        group = self._group
        assert group is not None, "join() first"
        check_mesh(s.model, group.world_size)
        if not group.distributed:
            return s
        model = wrap_model(s.model, group) if self._ddp else s.model
        if model is not s.model:
            self._wrapped = model  # ours: close() releases what it holds of the group
        seed = s.seed if s.seed is not None else 0
        train = shard_loader(s.train_data, group, seed=seed, train=True)
        # Each evaluation set is sharded: the ranks' sums and sample-weighted means are agreed.
        sets = tuple(
            (name, shard_loader(data, group, seed=seed, train=False)) for name, data in s.eval_sets
        )
        train_len = len(train) if train is not s.train_data else s.train_len
        return dataclasses.replace(
            s, model=model, train_data=train, eval_sets=sets, train_len=train_len
        )

    def connect(self) -> None:
        """On the main rank (event-loop thread): link to the driver, listen for attachments."""
        assert self._group is not None, "join() first"
        if self._group.is_main:
            self._link = WorkerLink.from_env()
            if self._link is not None:
                self._link.start(self._bus)
            if self._attach is not None:
                self._server = AttachServer.start(self._bus, self._attach)

    def close(self, result: FitResult | None) -> None:
        """Close the listener and the link, and leave the group (``result``: None if no run)."""
        if self._server is not None:
            self._server.close()
        if self._link is not None:
            self._link.close()
        group = self._group
        if group is None:
            return
        if group.owns_group and result is not None and result.reason in ("completed", "stopped"):
            # No rank tears the group down while a peer still reads its last collective.
            group.barrier()
        if self._wrapped is not None:
            # The wrapper must not keep the group (and gloo's threads) alive until exit.
            release_model(self._wrapped)
            self._wrapped = None
        group.close()  # destroys the process group only if from_env() created it

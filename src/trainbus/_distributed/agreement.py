"""Rank-agreed commands: every rank applies the same commands at the same step.

A command acting on one rank alone hangs the run (that rank stops while the others wait in the
next all-reduce). So under ``torchrun`` the loop hands its bus' commands to
:meth:`CommandAgreement.exchange` at a sync point and applies what comes back, the same list on
every rank (docs/distributed.md draws the protocol).

- Merge order: by rank, then in send order. A command several ranks sent in one exchange (a
  ``ranks="all"`` subscriber) is applied as often as the rank that sent it most often sent it;
  only the first ``StopTraining`` is kept.
- No extra collective when nothing is pending: :meth:`CommandAgreement.reduce_metrics_flags`
  adds a "some rank has commands" flag to the ``log_every`` window's all-reduce.
- Commands cross ranks as :mod:`~trainbus._wire` records (JSON, never pickles). The local
  rank's own commands come back as the objects it sent (``bus.request(c)`` resolves by
  identity); other ranks' as equal, rebuilt objects.
"""

from __future__ import annotations

import json
import zlib
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .. import _wire as wire
from .. import commands as cmd
from .._exceptions import ConfigError, DistributedError
from .._validate import check_int
from .group import ProcessGroup

__all__ = ["CommandAgreement", "byte_tensor", "merge"]

_HEADER = 4  # bytes of the big-endian payload length at the front of each rank's buffer


def merge(per_rank: Sequence[Sequence[cmd.Command]]) -> list[cmd.Command]:
    """The commands every rank applies, from each rank's contribution (``per_rank[r]`` in send
    order), by the rules of the module docstring.
    """
    merged: list[cmd.Command] = []
    counts: Counter[cmd.Command] = Counter()
    stopped = False
    for commands in per_rank:
        seen: Counter[cmd.Command] = Counter()
        for c in commands:
            if isinstance(c, cmd.StopTraining):
                if not stopped:
                    stopped = True
                    merged.append(c)
                continue
            seen[c] += 1
            if seen[c] > counts[c]:
                counts[c] += 1
                merged.append(c)
    return merged


def _encode(commands: Sequence[cmd.Command]) -> bytes:
    if not commands:
        return b""
    return json.dumps([wire.encode(c) for c in commands], separators=(",", ":")).encode()


def _decode(payload: bytes, rank: int) -> list[cmd.Command]:
    out: list[cmd.Command] = []
    for rec in json.loads(payload):
        message = wire.decode(rec)
        if not isinstance(message, cmd.COMMAND_TYPES):
            raise DistributedError(f"rank {rank} sent {rec.get('type')!r}, not a command")
        out.append(message)  # type: ignore[arg-type]
    return out


def byte_tensor(data: bytes, size: int) -> torch.Tensor:
    """A uint8 tensor of ``size`` bytes starting with ``data`` (zeros after)."""
    buf = torch.zeros(size, dtype=torch.uint8)
    if data:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return buf


class CommandAgreement:
    """The command exchange and metric reduction of one process group; on a single process
    nothing is communicated.

    Args:
        group: The :class:`ProcessGroup`.
        capacity: Bytes per rank in the first all-gather (header included): more commands cost a
            second all-gather of the needed size.

    Raises:
        ConfigError: ``capacity`` is not an integer >= 64.
    """

    def __init__(self, group: ProcessGroup, *, capacity: int = 512) -> None:
        self.group = group
        self.capacity = check_int("capacity", capacity, 64)
        self._collectives = 0

    @property
    def collectives(self) -> int:
        """Collectives this object has run (for tests and benchmarks)."""
        return self._collectives

    # ------------------------------------------------------------------ commands
    def exchange(self, local: Sequence[cmd.Command]) -> list[cmd.Command]:
        """Contribute ``local`` (this rank's pending commands, in send order) and return the
        merged commands every rank applies: a collective, called by every rank at the same sync
        point.

        Raises:
            DistributedError: a rank sent something that is not a command record.
            ConfigError: a rank sent a command its class refuses.
        """
        mine = list(local)
        if not self.group.distributed:
            return merge([mine])
        blobs = self._gather_payloads(_encode(mine))
        per_rank = [
            mine if r == self.group.rank else (_decode(blob, r) if blob else [])
            for r, blob in enumerate(blobs)
        ]
        return merge(per_rank)

    def gather_json(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (plain JSON data), in rank order: a collective, like
        :meth:`exchange` (what the step clock's schedules are agreed with at the run's start).

        Raises:
            DistributedError: a rank sent something that is not JSON.
        """
        payload = json.dumps(value, separators=(",", ":")).encode()
        if not self.group.distributed:
            return [value]
        out: list[Any] = []
        for rank, blob in enumerate(self._gather_payloads(payload)):
            try:
                out.append(json.loads(blob))
            except ValueError as exc:
                raise DistributedError(f"rank {rank} sent no JSON: {exc}") from None
        return out

    def _gather_payloads(self, payload: bytes) -> list[bytes]:
        """Every rank's ``payload`` bytes: one all-gather of ``capacity`` bytes, and a second of
        the needed size only when some rank's payload did not fit."""
        room = self.capacity - _HEADER
        header = len(payload).to_bytes(_HEADER, "big")
        rows = self._all_gather(byte_tensor(header + payload[:room], self.capacity))
        lengths = [int.from_bytes(r[:_HEADER], "big") for r in rows]
        if max(lengths) <= room:
            return [r[_HEADER : _HEADER + n] for r, n in zip(rows, lengths, strict=True)]
        rows = self._all_gather(byte_tensor(payload, max(lengths)))
        return [r[:n] for r, n in zip(rows, lengths, strict=True)]

    def _all_gather(self, tensor: torch.Tensor) -> list[bytes]:
        t = tensor.to(self.group.device)
        rows = [torch.empty_like(t) for _ in range(self.group.world_size)]
        dist.all_gather(rows, t)
        self._collectives += 1
        return [r.cpu().numpy().tobytes() for r in rows]

    # ------------------------------------------------------------------ metrics
    def reduce_metrics(self, metrics: Mapping[str, float]) -> dict[str, float]:
        """The mean of each metric across ranks (every rank passes the same names), in one
        all-reduce; ``DistributedError`` when the names differ.
        """
        return self.reduce_metrics_flags(metrics, ())[0]

    def reduce_metrics_flags(
        self, metrics: Mapping[str, float], flags: Sequence[bool]
    ) -> tuple[dict[str, float], list[bool]]:
        """:meth:`reduce_metrics` with ``flags`` (the same number on every rank) in the same
        all-reduce: flag ``i`` comes back True on every rank when some rank's flag ``i`` was True.

        Raises:
            DistributedError: the ranks passed different metric names.
            ConfigError: a metric value is not a number.
        """
        names = sorted(metrics)
        try:
            values = [float(metrics[k]) for k in names]
        except (TypeError, ValueError):
            raise ConfigError.invalid("metrics", dict(metrics), "a mapping of numbers") from None
        if not self.group.distributed:
            return dict(zip(names, values, strict=True)), [bool(f) for f in flags]
        # A checksum of the names, and its square: the sums equal world*c and world*c^2 only
        # when every rank has the same c (equality case of Cauchy-Schwarz). 20 bits keep c^2
        # exact in float64.
        c = float(zlib.crc32("\x00".join(names).encode()) & 0xFFFFF)
        n = len(flags)
        t = torch.tensor([*values, c, c * c, *(1.0 if f else 0.0 for f in flags)],
                         dtype=torch.float64)  # fmt: skip
        t = t.to(self.group.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        self._collectives += 1
        out: list[Any] = t.cpu().tolist()
        world = self.group.world_size
        if out[-2 - n] != world * c or out[-1 - n] != world * c * c:
            raise DistributedError(
                f"rank {self.group.rank} reduced metrics {names}, and another rank other names: "
                "every rank must log the same metrics"
            )
        summed = dict(zip(names, out[: len(names)], strict=True))
        return {k: v / world for k, v in summed.items()}, [v > 0 for v in out[len(out) - n :]]

    # ------------------------------------------------------------------ decisions
    def any_rank(self, flag: bool) -> bool:
        """Whether some rank's ``flag`` is True, the same answer on every rank: one all-reduce
        (MAX) of one number; the flag itself on a single process."""
        if not self.group.distributed:
            return flag
        return bool(self._reduce_int(int(flag), dist.ReduceOp.MAX))

    def min_step(self, step: int | None) -> int | None:
        """The smallest ``step`` any rank passed (None: this rank has none), the same on every
        rank: one all-reduce (MIN) of one number; None when no rank had one."""
        if not self.group.distributed:
            return step
        none = torch.iinfo(torch.int64).max
        got = self._reduce_int(none if step is None else step, dist.ReduceOp.MIN)
        return None if got == none else got

    def _reduce_int(self, value: int, op: Any) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=self.group.device)
        dist.all_reduce(t, op=op)
        self._collectives += 1
        return int(t.item())

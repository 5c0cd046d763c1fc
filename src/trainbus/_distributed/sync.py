"""The ranks' collectives: agreed commands (docs/distributed.md, "Rank-agreed commands") as
JSON wire records, reduced metrics, a checkpoint written on rank 0 only."""

from __future__ import annotations

import json
import zlib
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .. import _wire as wire
from .. import commands as cmd
from .._exceptions import CheckpointError, ConfigError, DistributedError
from .._validate import check_int
from .data import unwrap_model
from .group import ProcessGroup

__all__ = ["RankSync", "add_totals", "byte_tensor", "merge"]

_HEADER = 4  # bytes of the big-endian payload length at the front of each rank's buffer
_SUMMED = frozenset({"samples_per_s"})  # window metrics summed across ranks, not averaged


def merge(per_rank: Sequence[Sequence[cmd.Command]]) -> list[cmd.Command]:
    """The commands every rank applies, from each rank's (``per_rank[r]`` in send order)."""
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


def add_totals(
    per_rank: Sequence[Mapping[str, Mapping[str, float] | None]], names: Sequence[str]
) -> dict[str, dict[str, float] | None]:
    """Each metric's sums added over ``per_rank`` (in rank order); None for a metric that is
    None on some rank or whose sums are named differently on two."""
    out: dict[str, dict[str, float] | None] = {}
    for name in names:
        parts = [rank.get(name) for rank in per_rank]
        first = parts[0]
        if first is None or any(p is None or p.keys() != first.keys() for p in parts):
            out[name] = None
            continue
        out[name] = {key: sum(float(p[key]) for p in parts if p is not None) for key in first}
    return out


class RankSync:
    """The collectives of one process group (each called by every rank at the same point;
    nothing communicated on a single process). ``capacity``: bytes per rank in the first
    all-gather of a command exchange (``ConfigError`` below 64)."""

    def __init__(self, group: ProcessGroup, *, capacity: int = 512) -> None:
        self.group = group
        self.capacity = check_int("capacity", capacity, 64)
        self._collectives = 0

    @property
    def rank(self) -> int:
        """This process' rank."""
        return self.group.rank

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        return self.group.world_size

    @property
    def collectives(self) -> int:
        """Collectives run so far (for tests and benchmarks)."""
        return self._collectives

    @staticmethod
    def unwrap(model: torch.nn.Module) -> torch.nn.Module:
        """The module checkpoints save: ``DistributedDataParallel``'s ``.module``."""
        return unwrap_model(model)

    # ------------------------------------------------------------------ commands
    def agree(self, local: Sequence[cmd.Command]) -> list[cmd.Command]:
        """The merged commands every rank applies, given this rank's pending ones
        (``DistributedError``: a rank sent no command record)."""
        mine = list(local)
        if not self.group.distributed:
            return merge([mine])
        payload = json.dumps([wire.encode(c) for c in mine], separators=(",", ":")).encode()
        blobs = self._gather_payloads(payload if mine else b"")
        per_rank = [
            mine if r == self.group.rank else (_decode(blob, r) if blob else [])
            for r, blob in enumerate(blobs)
        ]
        return merge(per_rank)

    def gather_json(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (plain JSON data), in rank order."""
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

    def agree_schedules(
        self, every: Sequence[int], at: Sequence[int]
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The union of every rank's declared decision steps (``Every(n)`` periods and
        ``At(k)`` steps)."""
        every_all: set[int] = set()
        at_all: set[int] = set()
        for rank_every, rank_at in self.gather_json([list(every), list(at)]):
            every_all.update(int(n) for n in rank_every)
            at_all.update(int(k) for k in rank_at)
        return tuple(sorted(every_all)), tuple(sorted(at_all))

    def _gather_payloads(self, payload: bytes) -> list[bytes]:
        """Every rank's bytes: one all-gather of ``capacity`` bytes, a second of the needed
        size only when some rank's did not fit."""
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
        """The mean of each metric across ranks, in one all-reduce (see
        :meth:`reduce_metrics_flags`)."""
        return self.reduce_metrics_flags(metrics, ())[0]

    def reduce_metrics_flags(
        self, metrics: Mapping[str, float], flags: Sequence[bool]
    ) -> tuple[dict[str, float], list[bool]]:
        """:meth:`reduce_metrics` with ``flags`` in the same all-reduce: flag ``i`` comes back
        True when some rank's was (``DistributedError``: the ranks' metric names differ)."""
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
        t = torch.tensor(
            [*values, c, c * c, *(1.0 if f else 0.0 for f in flags)], dtype=torch.float64
        )
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

    def reduce_window(
        self, metrics: Mapping[str, float], *, pending: bool, nonfinite: int | None = None
    ) -> tuple[dict[str, float], bool, int | None]:
        """A log window's metrics across ranks (``samples_per_s`` summed), whether some rank has
        pending commands, and the first non-finite loss' step on any rank (None: none)."""
        out, (flag, bad) = self.reduce_metrics_flags(metrics, (pending, nonfinite is not None))
        for name in _SUMMED & out.keys():
            out[name] *= self.world_size
        return out, flag, (self.first_nonfinite(nonfinite) if bad else None)

    def reduce_eval(self, metrics: Mapping[str, float], samples: int) -> dict[str, float]:
        """Sample-weighted means of per-rank evaluation means, in one all-reduce."""
        weighted = {k: v * samples for k, v in metrics.items()}
        weighted["\x00samples"] = float(samples)
        out = self.reduce_metrics(weighted)
        total = out.pop("\x00samples")
        return {k: v / total for k, v in out.items()}

    def sum_eval(
        self, totals: Mapping[str, Mapping[str, float] | None]
    ) -> dict[str, dict[str, float] | None]:
        """Every rank's sums of the evaluation set's metrics added (:func:`add_totals`), in one
        all-gather; ``totals``: per metric, this rank's sums (None where it raised)."""
        per_rank = self.gather_json({k: None if v is None else dict(v) for k, v in totals.items()})
        return add_totals(per_rank, names=list(totals))

    # ------------------------------------------------------------------ decisions
    def any_nonfinite(self, local: bool) -> bool:
        """Whether some rank's ``local`` is True: one all-reduce (MAX) of one number."""
        if not self.group.distributed:
            return local
        return bool(self._reduce_int(int(local), dist.ReduceOp.MAX))

    def first_nonfinite(self, step: int | None) -> int | None:
        """The smallest ``step`` any rank passed (None: this rank has none; None back when no
        rank had one): one all-reduce (MIN) of one number."""
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

    def on_main(self, write: Callable[[], str]) -> str:
        """Run ``write`` on rank 0 and hand its result (a path) to every rank; when it failed,
        rank 0 raises its error and the others a ``CheckpointError``."""
        error: BaseException | None = None
        text = ""
        if self.group.is_main:
            try:
                text = write()
            except BaseException as exc:  # re-raised below, after the others heard of it
                error = exc
                text = f"\x00{type(exc).__name__}: {exc}"
        data = text.encode()
        size = torch.tensor([len(data)], dtype=torch.int64, device=self.group.device)
        dist.broadcast(size, src=0)
        buf = byte_tensor(data if self.group.is_main else b"", int(size.item()))
        buf = buf.to(self.group.device)
        dist.broadcast(buf, src=0)
        if error is not None:
            raise error
        got = bytes(buf.cpu().numpy().tobytes()).decode()
        if got.startswith("\x00"):
            raise CheckpointError(f"rank 0 could not write the checkpoint ({got[1:]})")
        return got

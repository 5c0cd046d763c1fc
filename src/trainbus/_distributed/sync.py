"""The loop's side of the ranks under torchrun: :class:`RankSync` bundles the process group and
its command agreement behind the few collectives the loop makes (agree on commands, reduce
the log window's and an evaluation's metrics, write a checkpoint on rank 0 only). Only a
multi-rank run holds one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from .. import commands as cmd
from .._exceptions import CheckpointError
from .agreement import CommandAgreement, byte_tensor
from .data import unwrap_model
from .group import ProcessGroup

__all__ = ["RankSync", "add_totals"]

_SUMMED = frozenset({"samples_per_s"})
"""Window metrics summed across ranks (throughput of the whole run), not averaged."""


def add_totals(
    per_rank: Sequence[Mapping[str, Mapping[str, float] | None]], names: Sequence[str]
) -> dict[str, dict[str, float] | None]:
    """Each metric's sums added over ``per_rank`` (every rank's totals, in rank order); None
    for a metric that is None on some rank or whose sums are named differently on two."""
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
    """The collectives of one multi-rank run (see the module docstring).

    Args:
        group: The process group (``world_size > 1``).
        agreement: Its command agreement (default: a new one).
    """

    def __init__(self, group: ProcessGroup, agreement: CommandAgreement | None = None) -> None:
        self.group = group
        self.agreement = agreement if agreement is not None else CommandAgreement(group)

    @property
    def rank(self) -> int:
        """This process' rank."""
        return self.group.rank

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        return self.group.world_size

    @staticmethod
    def unwrap(model: torch.nn.Module) -> torch.nn.Module:
        """The module checkpoints save: ``DistributedDataParallel``'s ``.module``."""
        return unwrap_model(model)

    def agree(self, local: Sequence[cmd.Command]) -> list[cmd.Command]:
        """The commands every rank applies now (a collective: call it at a sync point)."""
        return self.agreement.exchange(local)

    def agree_schedules(
        self, every: Sequence[int], at: Sequence[int]
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The union of every rank's declared decision steps (``Every(n)`` periods and
        ``At(k)`` steps), the same on every rank: a collective at the run's start."""
        every_all: set[int] = set()
        at_all: set[int] = set()
        for rank_every, rank_at in self.agreement.gather_json([list(every), list(at)]):
            every_all.update(int(n) for n in rank_every)
            at_all.update(int(k) for k in rank_at)
        return tuple(sorted(every_all)), tuple(sorted(at_all))

    def reduce_window(
        self, metrics: Mapping[str, float], *, pending: bool, nonfinite: int | None = None
    ) -> tuple[dict[str, float], bool, int | None]:
        """A log window's metrics across ranks (means; ``samples_per_s`` summed), whether some
        rank has pending commands, and the first step with a non-finite loss on any rank (None:
        none), the same on every rank: one all-reduce, a second only when some rank saw one.

        Args:
            metrics: The window's metrics (the same names on every rank).
            pending: This rank has commands waiting.
            nonfinite: This rank's first step with a non-finite loss in the window, or None.
        """
        out, (flag, bad) = self.agreement.reduce_metrics_flags(
            metrics, (pending, nonfinite is not None)
        )
        for name in _SUMMED & out.keys():
            out[name] *= self.world_size
        return out, flag, (self.agreement.min_step(nonfinite) if bad else None)

    def first_nonfinite(self, step: int | None) -> int | None:
        """The first step with a non-finite loss on any rank, given this rank's (None: none):
        one all-reduce, the same answer on every rank."""
        return self.agreement.min_step(step)

    def any_nonfinite(self, local: bool) -> bool:
        """Whether some rank's step had a non-finite loss (``on_nonfinite="skip"``, every
        step): one all-reduce, the same answer on every rank."""
        return self.agreement.any_rank(local)

    def reduce_eval(self, metrics: Mapping[str, float], samples: int) -> dict[str, float]:
        """Sample-weighted means of per-rank evaluation means, in one all-reduce."""
        weighted = {k: v * samples for k, v in metrics.items()}
        weighted["\x00samples"] = float(samples)
        out = self.agreement.reduce_metrics(weighted)
        total = out.pop("\x00samples")
        return {k: v / total for k, v in out.items()}

    def sum_eval(
        self, totals: Mapping[str, Mapping[str, float] | None]
    ) -> dict[str, dict[str, float] | None]:
        """Every rank's totals of the evaluation set's metrics (``set_metrics=``) added in rank
        order, in one all-gather. ``totals``: per metric, this rank's sums by name (None where it
        raised); the result has None where a metric raised on some rank or the ranks' sums have
        different names.
        """
        per_rank = self.agreement.gather_json({k: None if v is None else dict(v)
                                               for k, v in totals.items()})  # fmt: skip
        return add_totals(per_rank, names=list(totals))

    def on_main(self, write: Callable[[], str]) -> str:
        """Run ``write`` on rank 0 and hand its result (a path) to every rank: a collective, so
        no rank goes on before rank 0's checkpoint is complete. Raises ``CheckpointError`` on the
        other ranks when rank 0's write failed; on rank 0, whatever ``write`` raised.
        """
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

"""The non-finite guard (docs/trainer.md, "Non-finite losses"; ranks: docs/distributed.md)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from .._exceptions import CheckpointError, NonFiniteLossError
from .._log import get_logger
from .._tensors import local_part

if TYPE_CHECKING:
    from ..checkpoint import TrainState
    from .settings import Settings

__all__ = ["MAX_CONSECUTIVE_SKIPS", "NonFiniteGuard", "mean"]

log = get_logger(__name__)

MAX_CONSECUTIVE_SKIPS = 100  # with on_nonfinite="skip", this many in a row fail the run


def mean(values: list[float]) -> float:
    """The mean of ``values`` (not empty), each divided before the sum, so that it is
    non-finite only when a value is (two losses of 1e308 sum to inf)."""
    n = len(values)
    return sum(v / n for v in values)


class NonFiniteGuard:
    """Applies ``on_nonfinite`` and refuses checkpoints of a bad state. ``per_step``: losses
    are read before each update (the CPU, or ``"skip"``), else by the log window at its syncs.
    ``agree(bad here) -> bad on any rank``: a collective (None: one process)."""

    def __init__(
        self,
        settings: Settings,
        state: TrainState,
        *,
        stop: Callable[[str], None],
        agree: Callable[[bool], bool] | None = None,
    ) -> None:
        self.policy = settings.on_nonfinite
        self._state = state
        self._stop = stop
        self._agree = agree
        cpu = settings.device.type == "cpu"
        self.active = self.policy != "ignore"
        # Several ranks: "raise"/"stop" are agreed at the window's close, even on the CPU.
        self.per_step = self.active and (self.policy == "skip" or (cpu and agree is None))
        self.tripped = False  # found under "stop": no checkpoint is written from now on
        self.skipped = 0
        self._consecutive = 0

    def skip_update(self, losses: list[torch.Tensor], step: int) -> bool:
        """Check ``step``'s losses (each of one element) before its update: True when it must
        not be applied; ``NonFiniteLossError`` under ``"raise"`` or after too many skips."""
        if len(losses) == 1:
            finite = math.isfinite(losses[0].item())
        else:
            finite = all(map(math.isfinite, torch.stack(losses).flatten().tolist()))
        if self._agree is not None:
            finite = not self._agree(not finite)
        if finite:
            self._consecutive = 0
            return False
        if self.policy == "skip":
            self.skipped += 1
            self._consecutive += 1
            log.warning(
                "nonfinite_skipped", step=step, epoch=self._state.epoch, skipped=self.skipped
            )
            if self._consecutive >= MAX_CONSECUTIVE_SKIPS:  # read at call time: patchable
                raise NonFiniteLossError(
                    f"{self._consecutive} non-finite losses in a row up to step {step} "
                    f"(epoch {self._state.epoch}) with on_nonfinite='skip': the model or the "
                    "data is broken"
                )
            return True
        self.found(step)
        return True

    def found(self, step: int) -> None:
        """A non-finite loss was seen at ``step``: apply the policy (``"raise"`` / ``"stop"``)."""
        if not self.active or self.tripped:
            return
        if self.policy == "skip":
            # Only a custom step's returned loss gets here: its update was taken on the
            # finite losses given to ctx.backward, so nothing is left to skip.
            log.warning("nonfinite_returned_loss", step=step, epoch=self._state.epoch)
            return
        message = f"non-finite loss at step {step} (epoch {self._state.epoch})"
        if self.policy == "raise":
            raise NonFiniteLossError(message)
        self.tripped = True
        log.warning("nonfinite_stop", step=step, epoch=self._state.epoch)
        self._stop(message)

    def check_parameters(self, model: torch.nn.Module) -> None:
        """``CheckpointError`` after a ``"stop"`` or for a non-finite parameter."""
        st = self._state
        if self.tripped:
            raise CheckpointError(
                f"not writing a checkpoint at step {st.step}: a non-finite loss stopped the run "
                "(on_nonfinite='stop'); the last checkpoint written is the last good one"
            )
        # A sharded (FSDP2) parameter is checked on this rank's shard; the answer is agreed.
        params = [local_part(p.detach()) for p in model.parameters()]
        finite = True
        if params:
            flags = torch.stack([torch.isfinite(p).all().to(params[0].device) for p in params])
            finite = bool(flags.all().item())
        if self._agree is not None:
            finite = not self._agree(not finite)
        if finite:
            return
        names = [
            n
            for n, p in model.named_parameters()
            if not bool(torch.isfinite(local_part(p.detach())).all())
        ]
        where = (
            f"parameter(s) {', '.join(names[:5])}{' ...' if len(names) > 5 else ''}"
            if names
            else "another rank's shard of the parameters"
        )
        raise CheckpointError(
            f"not writing a checkpoint at step {st.step}: non-finite values in {where}; a "
            "checkpoint never holds NaN/inf weights"
        )

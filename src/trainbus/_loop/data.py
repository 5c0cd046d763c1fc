"""Each epoch's batch iterator, its data order kept for checkpoints or replayed on resume."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader

from .._exceptions import TrainingError
from .._log import get_logger
from ..checkpoint import Checkpoint, TrainState, capture_data_order, replay_epoch, set_sampler_epoch

if TYPE_CHECKING:
    from .saving import CheckpointWriter
    from .settings import Settings

__all__ = ["EpochData", "hint_pin_memory"]

log = get_logger(__name__)

_hinted = False  # the pin-memory hint was logged in this process


def hint_pin_memory(data: Any, device: torch.device) -> bool:
    """Log ``pin_memory_hint`` once per process for a CUDA run without pinned memory."""
    global _hinted
    if _hinted or device.type != "cuda" or not isinstance(data, DataLoader) or data.pin_memory:
        return False
    _hinted = True
    log.warning(
        "pin_memory_hint",
        device=str(device),
        reason="DataLoader(pin_memory=False) on a CUDA run: each batch's copy to the GPU "
        "blocks the training thread; DataLoader(..., pin_memory=True) lets it overlap the step",
    )
    return True


class EpochData:
    """Opens each epoch's batch iterator (with ``resume``, the first replays its data order)."""

    def __init__(
        self,
        settings: Settings,
        state: TrainState,
        checkpoints: CheckpointWriter,
        resume: Checkpoint | None,
    ) -> None:
        self._s = settings
        self._state = state
        self._checkpoints = checkpoints
        self._resume = resume

    def start(self) -> int | None:
        """Before the first epoch (a resume past an epoch's end moves on); returns the steps per
        epoch (None: data of no length)."""
        s, st = self._s, self._state
        hint_pin_memory(s.train_data, s.device)
        if st.closed_epoch == st.epoch or (
            s.train_len is not None and st.batch_in_epoch >= s.train_len
        ):
            st.epoch_done()
        return None if s.train_len is None else math.ceil(s.train_len / s.accumulate)

    def empty_error(self) -> TrainingError:
        """The error for an epoch whose iterator yielded no batch at all."""
        st, data = self._state, self._s.train_data
        if isinstance(data, Iterator) and st.epoch > 0:
            # A generator with max_steps alone (max_epochs > 1 is refused up front): spent
            # before max_steps, and a new pass over it yields nothing.
            return TrainingError(
                f"train_data, a one-shot {type(data).__name__}, was spent after epoch "
                f"{st.epoch - 1} at step {st.step}, before max_steps={self._s.max_steps}: pass "
                "data that can be iterated again (a list of batches, a DataLoader), or a "
                "max_steps within its one pass"
            )
        return TrainingError(
            f"train_data yielded no batch in epoch {st.epoch}: an empty loader cannot "
            "train; check its length, sampler and drop_last"
        )

    def open(self) -> Iterator[Any]:
        """The epoch's iterator over its remaining batches, its data order captured or replayed."""
        s, st, resume = self._s, self._state, self._resume
        set_sampler_epoch(s.train_data, st.epoch)  # a DistributedSampler's shuffle per epoch
        if resume is not None:
            self._resume = None
            it, order = replay_epoch(
                s.train_data,
                resume.data_order,
                epoch=st.epoch,
                skip=st.batch_in_epoch,
                rng=resume.rng,
            )
        else:
            order = capture_data_order(s.train_data, epoch=st.epoch)
            it = iter(s.train_data)
        self._checkpoints.begin_epoch(order)
        return it

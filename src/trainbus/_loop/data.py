"""The training data's side of the run: each epoch's batch iterator.

:class:`EpochData` builds the epoch's iterator (the sampler's epoch, the data order captured for
the epoch's checkpoints, or the saved one replayed with the consumed batches skipped on resume),
starts the run past an epoch a checkpoint saved completed, and names an empty loader. The
step fetches with ``next(it, END)``.
"""

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

__all__ = ["END", "EpochData", "hint_pin_memory"]

log = get_logger(__name__)

END = object()
"""What a fetch returns when the epoch's iterator is exhausted (``next(it, END)``)."""

_hinted = False
"""The pin-memory hint was logged in this process (it is not repeated for every run)."""


def hint_pin_memory(data: Any, device: torch.device) -> bool:
    """Log ``pin_memory_hint`` once per process when ``device`` is CUDA and ``data`` is a
    ``DataLoader`` with ``pin_memory=False`` (its copies to the GPU then block the training
    thread instead of overlapping the step). Reads no device state.

    Returns:
        True when the hint was logged by this call.
    """
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
    """Opens each epoch's batch iterator.

    Args:
        settings: The validated settings (``train_data`` is read).
        state: The run's train state (epoch, batch in epoch, step); read, and moved past a
            completed epoch by :meth:`start`.
        checkpoints: Told each epoch's data order, saved with the epoch's checkpoints.
        resume: The checkpoint the run resumes from: the first epoch opened replays its data
            order and RNG states; None for a fresh run.
    """

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
        """Before the first epoch: logs the pin-memory hint (:func:`hint_pin_memory`); a run
        resumed from a checkpoint saved after an epoch's end work (its batches all consumed, or
        its end work recorded in the state: data without a length) moves the state on to the
        next epoch's first batch.

        Returns:
            The optimizer steps per epoch (``FitStarted.steps_per_epoch``); None when the
            training data has no length.
        """
        s, st = self._s, self._state
        hint_pin_memory(s.train_data, s.device)
        if st.closed_epoch == st.epoch or (
            s.train_len is not None and st.batch_in_epoch >= s.train_len
        ):
            st.epoch_done()
        return None if s.train_len is None else math.ceil(s.train_len / s.accumulate)

    def empty_error(self) -> TrainingError:
        """The error for an epoch whose iterator yielded no batch at all.

        Returns:
            A :class:`~trainbus.TrainingError` naming the epoch and what to check; for a
            one-shot iterator spent by an earlier epoch, saying so and what to pass instead.
        """
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
        """The epoch's batch iterator; its data order is kept for the epoch's checkpoints.

        The first epoch of a resumed run replays the saved order, skips the consumed batches
        and restores the saved RNG states where they were captured (``replay_epoch``); any
        other epoch captures its order right before ``iter()`` draws the permutation.

        Returns:
            The iterator over the epoch's (remaining) batches.
        """
        s, st, resume = self._s, self._state, self._resume
        set_sampler_epoch(s.train_data, st.epoch)  # a DistributedSampler's shuffle per epoch
        if resume is not None:
            self._resume = None
            it, order = replay_epoch(s.train_data, resume.data_order, epoch=st.epoch,
                                     skip=st.batch_in_epoch, rng=resume.rng)  # fmt: skip
        else:
            order = capture_data_order(s.train_data, epoch=st.epoch)
            it = iter(s.train_data)
        self._checkpoints.begin_epoch(order)
        return it

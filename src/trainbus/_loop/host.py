"""Prediction outputs kept on the host as they come.

``predict(return_outputs=True)`` over a test set would keep every batch's outputs on the GPU and
concatenate them there (an LM's logits over a test set run out of device memory).
:class:`HostOutputs` copies each batch's tensors to the host when the batch is done: into pinned
memory with ``non_blocking=True`` on CUDA, so the copy is queued behind the forward and the
loop goes on launching the next batch; one wait for all copies at the end, before the outputs
are read or concatenated (on the host).
"""

from __future__ import annotations

from typing import Any

import torch

from .outputs import map_tensors

__all__ = ["HostOutputs"]


class HostOutputs:
    """Per-batch outputs, copied to the host as they are added (see the module docstring).

    Args:
        device: The run's device: CUDA copies are pinned and non-blocking.
    """

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._pin = device.type == "cuda"
        self._queued = False
        self._batches: list[Any] = []

    def add(self, outputs: Any) -> None:
        """Queue the copy of one batch's outputs (tensors through tuples, lists and dicts;
        anything else kept as is)."""
        self._batches.append(self._to_host(outputs))

    def _to_host(self, outputs: Any) -> Any:
        return map_tensors(self._tensor_to_host, outputs)  # containers keep their type

    def _tensor_to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type == "cpu":
            return tensor
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=self._pin)
        host.copy_(tensor, non_blocking=self._pin)
        self._queued = self._queued or self._pin
        return host

    def batches(self) -> list[Any]:
        """The host copies of every batch added, in order, complete: waits once for the
        queued non-blocking copies (a pinned buffer is not readable before its copy ran)."""
        if self._queued:
            torch.cuda.synchronize(self._device)
            self._queued = False
        return self._batches

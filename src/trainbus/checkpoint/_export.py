"""Export: a sharded checkpoint folder turned into one plain file an unsharded model loads::

    trainbus.checkpoint.export_full("checkpoints/step-00000042", "model.pt")
    model.load_state_dict(torch.load("model.pt", weights_only=True))

The optimizer's state is not exported (it belongs to the sharded run).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch

from .._exceptions import CheckpointError, CheckpointWriteError
from ._reading import read_folder
from ._store import write_atomic

__all__ = ["export_full"]

_PREFIX = "model."


def _allocate(folder: Path) -> dict[str, torch.Tensor]:
    """An empty tensor for every model entry of the DCP index, of its full size and dtype."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(str(folder)).read_metadata()
    out: dict[str, torch.Tensor] = {}
    for key, item in metadata.state_dict_metadata.items():
        if key.startswith(_PREFIX) and isinstance(item, TensorStorageMetadata):
            out[key[len(_PREFIX) :]] = torch.empty(item.size, dtype=item.properties.dtype)
    return out


def export_full(folder: str | os.PathLike[str], path: str | os.PathLike[str]) -> Path:
    """Write the full model state of a sharded checkpoint folder as one plain file, in one
    process (no process group, no GPU), atomically.

    Args:
        folder: A sharded run's checkpoint folder (``step-<n>[-<tag>]/``).
        path: The file to write (``model.pt``); its folder must exist.

    Returns:
        ``path``: a ``torch.save`` file of ``{parameter or buffer name: full tensor}`` (each equal
        to its sharded parameter's ``full_tensor()``), for ``model.load_state_dict``.

    Raises:
        CheckpointError: ``folder`` is not a valid sharded checkpoint folder (a one-file
            checkpoint is refused: it is plain already), or its shards cannot be read.
        CheckpointWriteError: ``path`` cannot be written (an ``OSError``).
    """
    source = Path(folder)
    if source.is_file():
        raise CheckpointError("a one-file checkpoint: its 'model' entry is the full state "
                              "already; export_full reads a sharded run's checkpoint folder",
                              path=str(source))  # fmt: skip
    read_folder(source)  # the folder checks first: index, shard files, trainbus.pt
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    model = _allocate(source)
    try:
        with warnings.catch_warnings():
            # DCP warns that it loads in one process: what this call means to do.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp_load({"model": model}, checkpoint_id=str(source), no_dist=True)
    except Exception as exc:
        raise CheckpointError(f"its shards cannot be read: {exc}", path=str(source)) from exc
    target = Path(path)
    try:
        write_atomic(model, target)
    except OSError as exc:
        raise CheckpointWriteError(str(target), exc) from exc
    return target

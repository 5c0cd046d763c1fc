"""Checkpoints: safe files (atomic, validated, ``weights_only``) and what they hold."""

from .._exceptions import CheckpointWriteError as CheckpointWriteError
from ._data_order import EpochSampler as EpochSampler
from ._data_order import capture_data_order as capture_data_order
from ._data_order import replay_epoch as replay_epoch
from ._data_order import set_sampler_epoch as set_sampler_epoch
from ._rng import capture_rng as capture_rng
from ._rng import restore_rng as restore_rng
from ._sharded import export_full as export_full
from ._sharded import load_sharded as load_sharded
from ._sharded import save_sharded as save_sharded
from ._state import FORMAT_VERSION as FORMAT_VERSION
from ._state import Checkpoint as Checkpoint
from ._state import TrainState as TrainState
from ._store import CheckpointStore as CheckpointStore
from ._store import LatestScan as LatestScan
from ._store import check_checkpoint_dir as check_checkpoint_dir
from ._store import latest_checkpoint as latest_checkpoint
from ._store import load_checkpoint as load_checkpoint
from ._store import read_checkpoint as read_checkpoint
from ._store import read_folder as read_folder
from ._store import save_checkpoint as save_checkpoint

__all__ = [
    "FORMAT_VERSION",
    "Checkpoint",
    "CheckpointStore",
    "CheckpointWriteError",
    "EpochSampler",
    "LatestScan",
    "TrainState",
    "capture_data_order",
    "capture_rng",
    "check_checkpoint_dir",
    "export_full",
    "latest_checkpoint",
    "load_checkpoint",
    "load_sharded",
    "read_checkpoint",
    "read_folder",
    "replay_epoch",
    "restore_rng",
    "save_checkpoint",
    "save_sharded",
    "set_sampler_epoch",
]

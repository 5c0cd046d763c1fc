"""Resuming a run: checking ``fit(resume=...)``, loading the checkpoint, restoring the model,
optimizer and callback states, and collecting the callback states at each save."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .. import events as ev
from .._bus import EventBus
from .._distributed.data import unwrap_model
from .._distributed.group import ProcessGroup
from .._exceptions import CheckpointError, ConfigError
from .._log import get_logger
from .._loop import Settings
from .._loop.saving import config_differences, run_config
from .._tensors import is_sharded_model
from .._validate import check_bool
from ..checkpoint import Checkpoint, CheckpointStore, load_sharded, read_checkpoint
from .added import AddedCallbacks
from .calls import TrainingThread

__all__ = ["CallbackStates", "check_resume", "load_weights"]

log = get_logger(__name__)


def check_resume(
    resume: object, checkpoint_dir: Path | None, require_checkpoint: object = False
) -> str | Path | None:
    """``fit(resume=..., require_checkpoint=...)`` checked: None, ``"latest"`` (with a
    ``checkpoint_dir``) or an existing checkpoint's ``Path``."""
    check_bool("require_checkpoint", require_checkpoint)
    if resume is None:
        if require_checkpoint:
            raise ConfigError.invalid(
                "require_checkpoint",
                True,
                "False unless resume is given (resume='latest' or a checkpoint path)",
            )
        return None
    if resume == "latest":
        if checkpoint_dir is None:
            raise ConfigError.invalid("resume", resume, "'latest' only with a checkpoint_dir")
        return "latest"
    if not isinstance(resume, str | os.PathLike) or not os.fspath(resume):
        raise ConfigError.invalid("resume", resume, "a checkpoint path, 'latest' or None")
    path = Path(resume)
    if not path.exists():
        raise ConfigError.invalid(
            "resume",
            str(path),
            "an existing checkpoint file (or a sharded run's checkpoint folder)",
        )
    return path


def load_weights(model: torch.nn.Module, path: str | os.PathLike[str]) -> Checkpoint:
    """Load only the model weights of the checkpoint ``path`` into ``model`` (unwrapped)."""
    checkpoint = read_checkpoint(path, map_location="cpu")  # load_state_dict copies in place
    checkpoint.restore_weights(unwrap_model(model))
    return checkpoint


class CallbackStates:
    """Resuming a run (the checkpoint loaded, its states restored) and the stateful
    callbacks' states (of the ``added`` ones) collected at each save."""

    def __init__(self, bus: EventBus, added: AddedCallbacks, thread: TrainingThread) -> None:
        self._bus = bus
        self._added = added
        self._thread = thread
        # Where the last load() found its checkpoint (FitStarted.resume_source), else None.
        self.resume_source: ev.ResumeSource | None = None

    def collector(self) -> Callable[[], dict[str, dict[str, Any]]] | None:
        """For the training thread at each save: ``{state_key: state_dict}`` of the stateful
        callbacks, collected on the event-loop thread; None when no added callback has state."""
        if not any(cb.stateful for cb in self._added.callbacks):
            return None
        return lambda: self._thread.call_sync(self._collect)

    def _collect(self) -> dict[str, dict[str, Any]]:
        self._bus.flush()  # every event published before the save delivered
        return {cb.state_key: cb.state_dict() for cb in self._added.callbacks if cb.stateful}

    def load(
        self, s: Settings, resume: str | Path, group: ProcessGroup, *, required: bool = False
    ) -> Checkpoint | None:
        """Load ``resume`` (``"latest"``: Ray's, else the newest valid one) and restore all but
        the RNG states; None when ``"latest"`` found none (docs/reliability.md)."""
        self.resume_source = None
        latest = resume == "latest"
        where = s.checkpoint_dir if latest else resume
        source: ev.ResumeSource = "checkpoint_dir" if latest else "path"
        sharded = is_sharded_model(unwrap_model(s.model))
        handed = read_ray_checkpoint() if latest and not sharded else None
        loading = where if handed is None else handed.path
        self._bus.publish(ev.CheckpointLoading(step=0, epoch=0, path=str(loading)))
        found = ""  # what the folder held, when nothing in it was valid
        # Read to the host: load_state_dict puts each tensor where the live objects keep it.
        if sharded:
            checkpoint, found = load_sharded(
                resume,
                s.checkpoint_dir,
                model=s.model,
                optimizer=s.optimizer,
                scheduler=s.scheduler,
                scaler=s.scaler,
            )
        elif handed is not None:
            checkpoint, source = handed, "ray"
        elif latest:
            assert s.checkpoint_dir is not None
            scan = CheckpointStore(s.checkpoint_dir).find_latest(map_location="cpu")
            checkpoint, found = scan.checkpoint, scan.describe()
        else:
            checkpoint = read_checkpoint(resume, map_location="cpu")
        if checkpoint is None:
            if required:
                raise CheckpointError(
                    f"no valid checkpoint to resume from (resume='latest', "
                    f"require_checkpoint=True); the folder held: {found}",
                    path=str(s.checkpoint_dir),
                )
            log.warning(
                "resume_found_nothing",
                checkpoint_dir=str(s.checkpoint_dir),
                found=found,
                action="training from step 0; pass require_checkpoint=True to make this an error",
            )
            return None
        self.resume_source = source
        saved = int(checkpoint.meta.get("world_size", 1))
        st = checkpoint.state
        if saved != group.world_size:
            # The data is sharded otherwise: the interrupted epoch cannot be replayed.
            log.warning(
                "resume_world_size_changed",
                saved_world_size=saved,
                world_size=group.world_size,
                epoch=st.epoch,
                batch_in_epoch=st.batch_in_epoch,
                action=("resharded through DCP; " if sharded else "")
                + "resume at the next epoch boundary",
            )
            if st.batch_in_epoch > 0:
                st.epoch_done()
        if not sharded:
            checkpoint.restore(
                model=unwrap_model(s.model),
                optimizer=s.optimizer,
                scheduler=s.scheduler,
                scaler=s.scaler,
                world_size=saved,
                rng=False,
            )
        return self._restored(checkpoint)

    def _restored(self, checkpoint: Checkpoint) -> Checkpoint:
        """Restore the callback states and announce the load; the checkpoint without them."""
        by_key = {cb.state_key: cb for cb in self._added.callbacks if cb.stateful}
        for key, state in checkpoint.callbacks.items():
            cb = by_key.get(key)
            if cb is None:
                log.warning(
                    "callback_state_unmatched",
                    name=key,
                    path=str(checkpoint.path),
                    reason="no added stateful callback has this state_key; its state is ignored",
                )
                continue
            cb.load_state_dict(state)
        st = checkpoint.state
        self._bus.publish(
            ev.CheckpointLoaded(step=st.step, epoch=st.epoch, path=str(checkpoint.path))
        )
        return checkpoint.restored()

    @staticmethod
    def warn_differences(s: Settings, checkpoint: Checkpoint) -> None:
        """Warn when ``checkpoint`` already reached this run's limits, and when this run (``s``:
        after sharding) differs from the one that wrote it."""
        st = checkpoint.state
        if (s.max_steps is not None and st.step >= s.max_steps) or (
            s.max_epochs is not None and st.epoch >= s.max_epochs
        ):
            log.warning(
                "resume_past_the_end",
                path=str(checkpoint.path),
                step=st.step,
                epoch=st.epoch,
                max_steps=s.max_steps,
                max_epochs=s.max_epochs,
                action="nothing to train: raise max_steps / max_epochs to go on",
            )
        saved = checkpoint.meta.get("run")
        if not isinstance(saved, dict):
            return
        differences = config_differences(saved, run_config(s))
        if differences:
            log.warning(
                "resume_config_differs",
                path=str(checkpoint.path),
                step=checkpoint.state.step,
                differences=differences,
                action="resuming anyway; the run will not match an uninterrupted run "
                "of the checkpoint's configuration",
            )


def read_ray_checkpoint() -> Checkpoint | None:
    """The first readable trainbus checkpoint in what ``ray.train.get_checkpoint()`` hands
    this worker (Ray is never imported here), or None."""
    train = sys.modules.get("ray.train")
    try:
        handed = None if train is None else train.get_checkpoint()
    except RuntimeError:  # Ray Train is imported, but this is not one of its workers
        handed = None
    if handed is None:
        return None
    errors: list[str] = []
    with handed.as_directory() as folder:
        for path in sorted(p for p in Path(folder).iterdir() if p.is_file()):
            try:
                checkpoint = read_checkpoint(path, map_location="cpu")
            except CheckpointError as exc:
                errors.append(str(exc))
                continue
            log.info("resume_ray_checkpoint", path=str(path), step=checkpoint.state.step)
            return checkpoint
    log.warning(
        "resume_ray_checkpoint_unreadable",
        ray_checkpoint=str(handed.path),
        errors=errors or ["no file in it"],
        action="resuming from checkpoint_dir instead",
    )
    return None

"""The loop's checkpoint writer: what a checkpoint holds, ``CheckpointSaved``, and which one
the run wrote last (the file format and the atomic write are the checkpoint layer's)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import events as ev
from .._exceptions import CheckpointError, CheckpointWriteError, ConfigError
from .._log import get_logger, worth_logging
from .._tensors import is_sharded_model
from ..checkpoint import TrainState, capture_data_order, save_checkpoint, save_sharded
from ..checkpoint._sharded import folder_name

if TYPE_CHECKING:
    from .._bus import LoopPort
    from .._distributed.sync import RankSync
    from .nonfinite import NonFiniteGuard
    from .settings import Settings
    from .window import LogWindow

__all__ = ["CheckpointWriter", "config_differences", "run_config"]

log = get_logger(__name__)

_LOGGED_FIRST = 3  # refused saves logged each; then at 10, 100, 1000, ... refusals

_OTHER_EVALUATIONS = (
    "the evaluations after the checkpoint's step come at other steps than in the run that "
    "wrote it, so early stopping and keep_best decide on other evaluations"
)
# What a resume loses when an entry of run_config differs.
_LOST = {
    "eval_every": _OTHER_EVALUATIONS,
    "eval_at_epoch_end": _OTHER_EVALUATIONS,
    "accumulate": "a step takes another number of batches: the steps, the batches each one "
    "sees and so the weights differ from the run that wrote it",
    "train_data": "the interrupted epoch's batches cannot be replayed in the saved order: the "
    "batches after the checkpoint's step differ",
    "scheduler_interval": "the learning rate steps at other points than in the run that wrote it",
}
# How the Trainer spells the entries a checkpoint records under the loop's names.
_SPELLED = {
    "eval_every": "EvalSchedule.every_steps",
    "eval_at_epoch_end": "EvalSchedule.epoch_end",
    "scheduler_interval": "the scheduler's interval (PerEpoch)",
}


def run_config(settings: Settings) -> dict[str, Any]:
    """The cadences and data shape a checkpoint records, which an exact resume needs unchanged."""
    s = settings
    return {
        "eval_every": s.eval_every if s.eval_data is not None else None,
        "eval_at_epoch_end": bool(s.eval_at_epoch_end and s.eval_data is not None),
        "accumulate": s.accumulate,
        "train_data": "iterable" if s.train_len is None else f"{s.train_len} batches",
        "scheduler_interval": s.scheduler_interval if s.scheduler is not None else None,
    }


def config_differences(saved: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """One sentence per :func:`run_config` entry that differs, saying what exactness it costs."""
    out = []
    for key, lost in _LOST.items():
        if key in saved and key in now and saved[key] != now[key]:
            name = _SPELLED.get(key, key)
            out.append(
                f"{name} was {saved[key]!r} in the checkpoint's run and is {now[key]!r} now: {lost}"
            )
    return out


class CheckpointWriter:
    """Writes the run's checkpoints (a sharded model: every rank; else rank 0), once the
    ``window``'s unread losses and the ``guard`` allow it."""

    def __init__(
        self,
        settings: Settings,
        port: LoopPort,
        state: TrainState,
        callback_states: Callable[[], Mapping[str, Mapping[str, Any]]] | None,
        *,
        window: LogWindow,
        guard: NonFiniteGuard,
        sync: RankSync | None = None,
    ) -> None:
        self._settings, self._port, self._state = settings, port, state
        self._callback_states = callback_states
        self._data_order: dict[str, Any] | None = None
        self._window, self._guard = window, guard
        self._sync = sync
        self.last_checkpoint: str | None = None  # written by this run (or resumed from)
        self.last_checkpoint_step = -1  # its step (-1: none yet)
        # The last checkpoint a SaveCheckpoint wrote (or the run resumed from), with its state.
        self._once: tuple[ev.CheckpointSaved, dict[str, int]] | None = None
        self.failed_saves = 0
        self._sharded = is_sharded_model(settings.model)
        self._run = run_config(settings)

    def resumed_from(self, saved: ev.CheckpointSaved) -> None:
        """The run resumed from ``saved``: in this ``checkpoint_dir``, the last checkpoint."""
        path, folder = Path(saved.path), self._settings.checkpoint_dir
        if folder is not None and path.parent.resolve() == folder.resolve():
            self.last_checkpoint, self.last_checkpoint_step = saved.path, saved.step
            self._once = (saved, self._state.as_dict())

    def save_once(self, tag: str | None, metrics: dict[str, float]) -> ev.CheckpointSaved:
        """:meth:`save`, unless the last one had this step, tag and train state: its event."""
        now = self._state.as_dict()
        if self._once is not None:
            saved, state = self._once
            if saved.step == self._state.step and saved.tag == tag and state == now:
                return saved
        saved = self.save(tag, metrics)
        self._once = (saved, now)
        return saved

    def begin_epoch(self, data_order: dict[str, Any]) -> None:
        """The epoch in progress draws its batches in ``data_order`` (saved with it)."""
        self._data_order = data_order

    def _order_to_save(self) -> dict[str, Any] | None:
        """The data order a resume replays: the epoch in progress', or past its end the next's."""
        s, st, order = self._settings, self._state, self._data_order
        if st.closed_epoch == st.epoch or (
            s.train_len is not None and st.batch_in_epoch >= s.train_len
        ):
            return capture_data_order(s.train_data, epoch=st.epoch + 1)
        if st.batch_in_epoch == 0 and (order is None or order.get("epoch") != st.epoch):
            return capture_data_order(s.train_data, epoch=st.epoch)
        return order

    def save_final(self, ending: ev.Ending, metrics: dict[str, float]) -> None:
        """The run's last checkpoint, unless the step has one, ``skip_final`` names ``ending``
        or a non-finite loss stopped the run; refused for non-finite weights (logged)."""
        s, st = self._settings, self._state
        if (
            s.checkpoint_dir is None
            or self._guard.tripped
            or ending in s.skip_final_checkpoint
            or self.last_checkpoint_step == st.step
        ):
            return
        try:
            self.save("final", metrics)
        except CheckpointWriteError:  # the disk refused it: the run fails
            raise
        except CheckpointError as exc:  # non-finite weights: keep the last good one
            log.warning("final_checkpoint_refused", step=st.step, error=str(exc))

    def save(self, tag: str | None, metrics: dict[str, float]) -> ev.CheckpointSaved:
        """Write a checkpoint and publish ``CheckpointSaved``; ``CheckpointWriteError`` when the
        disk refused (counted, logged)."""
        s, st = self._settings, self._state
        if s.checkpoint_dir is None:
            raise ConfigError.invalid("checkpoint_dir", None, "a folder, to save checkpoints")
        self._window.check_pending()
        self._guard.check_parameters(s.model)
        self._port.publish(ev.CheckpointSaving(step=st.step, epoch=st.epoch, tag=tag))
        sync, folder = self._sync, s.checkpoint_dir

        def write() -> str:
            states = None if self._callback_states is None else self._callback_states()
            held: dict[str, Any] = {
                "state": st,
                "optimizer": s.optimizer,
                "scheduler": s.scheduler,
                "scaler": s.scaler,
                "metrics": metrics,
                "data_order": self._order_to_save(),
                "callback_states": states,
                "run": self._run,
            }
            if self._sharded:  # every rank writes its shards (a collective)
                name = folder_name(st.step, tag)
                return str(save_sharded(folder, name=name, model=s.model, **held))
            model, ranks = (s.model, 1) if sync is None else (sync.unwrap(s.model), sync.world_size)
            return str(save_checkpoint(folder, tag=tag, model=model, world_size=ranks, **held))

        try:
            path = write() if sync is None or self._sharded else sync.on_main(write)
        except CheckpointWriteError as exc:
            self._refused(exc, tag)
            raise
        self.last_checkpoint, self.last_checkpoint_step = path, st.step
        saved = ev.CheckpointSaved(
            step=st.step, epoch=st.epoch, path=path, tag=tag, metrics=metrics
        )
        self._port.publish(saved)
        return saved

    def _refused(self, exc: CheckpointWriteError, tag: str | None) -> None:
        self.failed_saves += 1
        n, st = self.failed_saves, self._state
        if not worth_logging(n, _LOGGED_FIRST):
            return
        note = "no partial file is left; the earlier checkpoints stay valid"
        if n >= _LOGGED_FIRST:
            note += "; from now on logged at 10, 100, 1000, ... (FitResult.failed_saves)"
        log.warning(
            "checkpoint_save_failed",
            step=st.step,
            epoch=st.epoch,
            tag=tag,
            path=exc.path,
            error=f"[Errno {exc.errno}] {exc.strerror}",
            failed_saves=n,
            last_checkpoint=self.last_checkpoint,
            note=note,
        )

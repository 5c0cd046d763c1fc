"""When to save: checkpoint cadence and "best so far" as small pipelines ending in commands.

The loop writes checkpoints (``Trainer(checkpoint_dir=...)``, atomically); this callback only
decides when, by sending ``SaveCheckpoint`` on the back-channel, and which older files to delete
(``keep_last`` / ``keep_best``), from the paths and metrics of ``CheckpointSaved`` events.
"""

from __future__ import annotations

import math
import os
import secrets
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import anyio.to_thread
from reactivex import Observable
from reactivex import operators as ops

from .. import commands as cmd
from .. import events as ev
from .. import operators as tbops
from .._durable import fsync_file, fsync_folder, fsync_tree
from .._exceptions import ConfigError
from .._log import get_logger
from .._validate import check_int, check_metric, check_mode, check_state_key
from ..operators import Tracker
from ._base import Callback
from ._sets import check_monitored, reads_metric

if TYPE_CHECKING:
    from ..bus import EventBus
    from ._base import RunPlan

__all__ = ["Checkpointing"]

log = get_logger(__name__)

def _improvements(
    metric: str, tracker: Tracker, *, mode: Literal["min", "max"] = "min", min_delta: float = 0.0
) -> Callable[[Observable[Any]], Observable[Any]]:
    """Keep the events whose ``metric`` beats the best value ``tracker`` has seen.

    ::

        val_loss:             -3-4-2-2-1-|
        _improvements(min):   -3---2---1-|

    NaN never improves. Evaluations that failed (``error`` set) are skipped.

    Args:
        metric: Key in the events' ``metrics``.
        tracker: Holds the best value (its owner saves and restores it across a resume).
        mode: ``"min"`` if lower is better, ``"max"`` otherwise.
        min_delta: Smallest change that counts as an improvement (>= 0).

    Raises:
        ConfigError: for an argument out of range (eagerly); the stream errors with a
            ``ConfigError`` naming the metric when an event lacks it.
    """
    metric = check_metric("metric", metric)
    mode = check_mode(mode)
    if not isinstance(min_delta, int | float) or not math.isfinite(min_delta) or min_delta < 0:
        raise ConfigError.invalid("min_delta", min_delta, "a finite number >= 0")
    delta = float(min_delta)

    def improved(e: Any) -> bool:
        metrics = getattr(e, "metrics", {})
        if metric not in metrics:
            raise ConfigError.invalid("monitor", metric, f"one of the metrics {sorted(metrics)}")
        return tracker.update(float(metrics[metric]), mode=mode, min_delta=delta,
                              step=getattr(e, "step", None))

    def _operator(source: Observable[Any]) -> Observable[Any]:
        return source.pipe(
            ops.filter(lambda e: getattr(e, "error", None) is None),
            ops.filter(reads_metric(metric)),  # named sets: only the metric's own set
            ops.filter(improved),
        )

    return _operator


def copy_as_best(source: Path, step: int) -> Path:
    """Copy the checkpoint ``source`` (of ``step``) to ``step-<step>-best.pt`` beside it,
    atomically: a hidden temporary file (``.<name>.<hex>.copy-tmp``, not the store's own
    ``.trainbus-tmp`` pattern, whose cleanup at each save would race with this copy), fsynced,
    then renamed over the final name, and the folder fsynced. A process killed mid-copy
    leaves only that hidden file.

    A sharded run's checkpoint folder is copied whole to ``step-<step>-best`` the same way (a
    hidden temporary folder, every file and folder of it fsynced, renamed into place; an older
    ``-best`` folder of that step is replaced only then).

    Returns:
        The path of the copy (``source`` itself when it already is that file).
    """
    folder = source.is_dir()
    target = source.with_name(f"step-{step:08d}-best" + ("" if folder else ".pt"))
    if target == source:
        return target
    tmp = source.with_name(f".{target.name}.{secrets.token_hex(4)}.copy-tmp")
    try:
        if folder:
            shutil.copytree(source, tmp)
            fsync_tree(tmp)
            _remove(target)  # os.replace renames a folder only onto none or an empty one
        else:
            shutil.copyfile(source, tmp)
            fsync_file(tmp)
        os.replace(tmp, target)
        fsync_folder(target.parent)  # the new name is durable once its folder's entry is
    finally:
        _remove(tmp)  # only left when the copy failed
    return target


def _remove(path: Path) -> None:
    """Delete a checkpoint: a file, or a sharded run's folder (renamed to a hidden name first,
    so a removal cut short never leaves a half folder under a checkpoint's name)."""
    if not path.is_dir():
        path.unlink(missing_ok=True)
        return
    doomed = path.with_name(f".{path.name}.{secrets.token_hex(4)}.removed-tmp")
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


class _Retention:
    """Which checkpoint files to delete after each ``CheckpointSaved``: pure bookkeeping.

    Untagged saves (the cadence's) keep the ``keep_last`` newest; ``"best"`` saves keep the
    ``keep_best`` best by ``monitor``. Other tags (``"final"``, user tags) are never deleted.
    The file just saved is never deleted: it is the newest complete checkpoint, and an older
    one is deleted only after its successor's ``CheckpointSaved`` (so the file exists and is
    complete). Only files saved during this run are known, so a resumed run never deletes the
    files of the run before it.
    """

    def __init__(
        self, keep_last: int | None, keep_best: int | None, monitor: str | None,
        mode: Literal["min", "max"],
    ) -> None:  # fmt: skip
        self.keep_last, self.keep_best = keep_last, keep_best
        self.monitor, self.mode = monitor, mode
        self._last: list[str] = []  # oldest first
        self._best: list[tuple[float, int, str]] = []  # (score, step, path): lower score better

    def saved(self, event: ev.CheckpointSaved) -> list[str]:
        """Record ``event``; return the paths that are now surplus (oldest or worst first)."""
        path = event.path
        if event.tag is None and self.keep_last is not None:
            self._last = [p for p in self._last if p != path] + [path]
            surplus, self._last = self._last[: -self.keep_last], self._last[-self.keep_last :]
            return surplus
        if event.tag == "best" and self.keep_best is not None and self.monitor is not None:
            value = event.metrics.get(self.monitor)
            if value is None or math.isnan(value):
                return []
            score = value if self.mode == "min" else -value
            entries = [e for e in self._best if e[2] != path] + [(score, event.step, path)]
            # Best first; among equals the newer first. The one just saved always stays.
            entries.sort(key=lambda e: (e[0], -e[1]))
            keep = entries[: self.keep_best]
            if all(e[2] != path for e in keep):  # a worse "best" sent by hand: still newest
                keep = [*keep[:-1], next(e for e in entries if e[2] == path)]
            self._best = keep
            return [e[2] for e in entries if e not in keep]
        return []


class Checkpointing(Callback):
    """Sends ``SaveCheckpoint`` on a cadence and when a monitored metric improves.

    Pipelines::

        StepEnded       -> every(every_steps)                      -> SaveCheckpoint()
        EpochEnded      -> filter((epoch + 1) % every_epochs == 0) -> SaveCheckpoint()
        EvaluationEnded -> scan(best so far) -> filter(improved)   -> SaveCheckpoint(tag="best")
        ... .subscribe(bus.commands)
        ExternalEvaluationEnded -> filter(has monitor) -> filter(improved) -> copy as best

    An evaluation job (:class:`EvaluateCheckpoints`) scores a checkpoint written earlier, so a
    ``SaveCheckpoint`` would save the *current* weights under the job's score. Instead, when a
    job's ``monitor`` value beats the best so far, the evaluated file itself is copied to
    ``step-<its step>-best.pt`` beside it (in a worker thread, atomically); the in-loop and the
    external evaluations share one "best so far". Copies are not pruned by ``keep_best``.

    Cadences count step and epoch *numbers*, not events seen, so a resumed run keeps saving at
    the same multiples. Every save happens at exactly the step it was decided at: the step
    cadence declares its steps to the bus' step clock (``tbops.every``), so the loop applies the
    save before the next step, and ``EpochEnded`` and ``EvaluationEnded`` are barriers by
    default. Failed epochs and evaluations never trigger a save.

    Args:
        every_steps: Save every N optimizer steps (None: never on steps).
        every_epochs: Save every N epochs (None: never on epochs). **The default, 1, also
            applies beside** ``every_steps``: ``Checkpointing(every_steps=40)`` saves every 40
            steps *and* at every epoch's end; pass ``every_epochs=None`` for steps only.
        monitor: Save ``tag="best"`` checkpoints when this evaluation metric (``"val_loss"``)
            improves; None to disable.
        mode: ``"min"`` if lower ``monitor`` is better, ``"max"`` otherwise.
        min_delta: Smallest change of ``monitor`` that counts as an improvement.
        keep_last: Keep only the N newest cadence (untagged) checkpoints of this run, deleting
            an older one once a newer one is saved; None keeps all.
        keep_best: Keep only the N best ``tag="best"`` checkpoints of this run by ``monitor``;
            None keeps all. Needs ``monitor``.
        state_key: Name of its state (the best ``monitor`` value so far) in checkpoints;
            None: ``"Checkpointing"``. A resumed run tags ``"best"`` only what beats it.

    Retention deletes only files this run saved (a resumed run leaves the earlier run's files),
    never ``"final"`` or other tagged files, and never the checkpoint just saved: a file is
    deleted after its successor's ``CheckpointSaved``, so a complete checkpoint always exists.

    Raises:
        ConfigError: for an argument out of range, or when nothing would ever be saved.
    """

    def __init__(
        self,
        every_steps: int | None = None,
        every_epochs: int | None = 1,
        monitor: str | None = None,
        mode: Literal["min", "max"] = "min",
        *,
        min_delta: float = 0.0,
        keep_last: int | None = None,
        keep_best: int | None = None,
        state_key: str | None = None,
    ) -> None:
        self.state_key = check_state_key(state_key)
        self.every_steps = check_int("every_steps", every_steps, 1, optional=True)
        self.every_epochs = check_int("every_epochs", every_epochs, 1, optional=True)
        self.monitor = None if monitor is None else check_metric("monitor", monitor)
        self.mode = check_mode(mode)
        self.min_delta = min_delta
        self.tracker = Tracker()
        """The best ``monitor`` value so far (a fresh one at each attach)."""
        if self.monitor is not None:  # validates min_delta now
            _improvements(self.monitor, self.tracker, mode=self.mode, min_delta=min_delta)
        self.keep_last = check_int("keep_last", keep_last, 1, optional=True)
        self.keep_best = check_int("keep_best", keep_best, 1, optional=True)
        if self.keep_best is not None and self.monitor is None:
            raise ConfigError.invalid("keep_best", keep_best, "None unless monitor is set")
        self._retention = _Retention(self.keep_last, self.keep_best, self.monitor, self.mode)
        if self.every_steps is None and self.every_epochs is None and self.monitor is None:
            raise ConfigError.invalid(
                "every_epochs", None, "an int >= 1 when every_steps and monitor are None too "
                "(otherwise Checkpointing never saves)",
            )  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        """The best ``monitor`` value so far (``{"best": None}`` before any evaluation)."""
        return {"best": self.tracker.best}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (before the resumed run's first evaluation).

        Raises:
            ConfigError: ``state`` has no ``"best"`` number.
        """
        best = state.get("best")
        if best is not None and not isinstance(best, int | float):
            raise ConfigError.invalid("Checkpointing state", dict(state), "{'best': float | None}")
        self.tracker.best = None if best is None else float(best)

    def check(self, plan: RunPlan) -> None:
        """Refuse, before the run starts, a run where it could never save what it promises.

        Raises:
            ConfigError: the Trainer has no ``checkpoint_dir`` (every save would be refused);
                or ``monitor`` is not among the metrics of ``eval_data``, or there is no
                ``eval_data`` and no evaluation job (``EvaluateCheckpoints``) either: no
                ``"best"`` checkpoint would ever be written.
        """
        if plan.checkpoint_dir is None:
            raise ConfigError.invalid("checkpoint_dir", None, "a folder when Checkpointing is "
                                      "attached (Trainer(checkpoint_dir=...))")  # fmt: skip
        if self.monitor is not None:
            check_monitored(plan, "Checkpointing.monitor", self.monitor, external=True)

    def setup(self, bus: EventBus) -> None:
        """Subscribe the decision pipelines to ``bus.commands``."""
        self.tracker = Tracker()
        if (n := self.every_steps) is not None:
            bus.stream(ev.StepEnded).pipe(
                tbops.every(n),  # declares the decision steps: saved at exactly n, 2n, ...
                ops.map(lambda _: cmd.SaveCheckpoint()),
            ).subscribe(bus.commands, name="Checkpointing.every_steps")
        if (m := self.every_epochs) is not None:
            bus.stream(ev.EpochEnded).pipe(
                ops.filter(lambda e: e.error is None and (e.epoch + 1) % m == 0),
                ops.map(lambda _: cmd.SaveCheckpoint()),
            ).subscribe(bus.commands, name="Checkpointing.every_epochs")
        if self.monitor is not None:
            improved = _improvements(self.monitor, self.tracker, mode=self.mode,
                                     min_delta=self.min_delta)  # fmt: skip
            bus.stream(ev.EvaluationEnded).pipe(
                improved,
                ops.map(lambda _: cmd.SaveCheckpoint(tag="best")),
            ).subscribe(bus.commands, name="Checkpointing.best")
            monitor = self.monitor
            external = _improvements(monitor, self.tracker, mode=self.mode,
                                     min_delta=self.min_delta)  # fmt: skip
            bus.subscribe_async(
                bus.stream(ev.ExternalEvaluationEnded).pipe(
                    ops.filter(lambda e: monitor in e.metrics),  # a job scoring other metrics
                    external,
                ),
                self._mark_best,
                name="Checkpointing.best_external",
            )
        if self.keep_last is not None or self.keep_best is not None:
            bus.subscribe(bus.stream(ev.CheckpointSaved), self._prune,
                          name="Checkpointing.retention")  # fmt: skip

    async def _mark_best(self, event: ev.ExternalEvaluationEnded) -> None:
        source = Path(event.checkpoint)
        best = await anyio.to_thread.run_sync(copy_as_best, source, event.step)
        log.info("checkpoint_marked_best", step=event.step, path=str(best), source=str(source),
                 metrics=dict(event.metrics))  # fmt: skip

    def _prune(self, event: ev.CheckpointSaved) -> None:
        for path in self._retention.saved(event):
            _remove(Path(path))
            log.info("checkpoint_removed", step=event.step, path=path,
                     reason="keep_last" if event.tag is None else "keep_best")  # fmt: skip

"""When to save (cadence, best so far) as pipelines ending in ``SaveCheckpoint``, and which of
this run's files to delete; the loop writes them."""

from __future__ import annotations

import math
import os
import re
import secrets
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import anyio.to_thread
from reactivex import operators as ops
from reactivex.subject import Subject

from .. import commands as cmd
from .. import events as ev
from .. import operators as tbops
from .._durable import fsync_file, fsync_folder, fsync_tree
from .._exceptions import ConfigError
from .._log import get_logger
from .._validate import check_bool, check_int, check_metric, check_mode, check_number
from ..operators import Tracker
from ._base import Callback
from ._monitored import check_monitored, evaluations, lightning_names

if TYPE_CHECKING:
    from .._bus import EventBus
    from .._loop.result import FitResult
    from ._base import RunPlan

__all__ = ["Checkpointing"]

log = get_logger(__name__)


def copy_as_best(source: Path, step: int) -> Path:
    """Copy ``source`` (of ``step``) to ``step-<step>-best[.pt]`` beside it, atomically; return
    the copy's path. (Not the store's ``.trainbus-tmp`` name: its cleanup would race.)"""
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


@dataclass(frozen=True, slots=True)
class _Removal:
    path: Path
    step: int
    reason: str


async def _remove_logged(removal: _Removal) -> None:
    await anyio.to_thread.run_sync(_remove, removal.path)
    log.info("checkpoint_removed", step=removal.step, path=str(removal.path), reason=removal.reason)


def _remove(path: Path) -> None:
    """Delete a checkpoint file or folder (renamed away first: never half a checkpoint)."""
    if not path.is_dir():
        path.unlink(missing_ok=True)
        return
    doomed = path.with_name(f".{path.name}.{secrets.token_hex(4)}.removed-tmp")
    try:
        os.replace(path, doomed)
    except FileNotFoundError:  # removed meanwhile
        return
    shutil.rmtree(doomed, ignore_errors=True)


class _Retention:
    """Which files of this run to delete after each ``CheckpointSaved``, and the best; the
    lineage a resumed run adopts."""

    def __init__(
        self,
        keep_last: int | None,
        keep_best: int | None,
        monitor: str | None,
        mode: Literal["min", "max"],
    ) -> None:
        self.keep_last, self.keep_best = keep_last, keep_best
        self.monitor, self.mode = monitor, mode
        self._last: list[str] = []  # oldest first
        self._best: list[tuple[float, int, str]] = []  # (score, step, path): best first
        self._value: float | None = None  # the monitor's last value (what a save stores)
        self._saving: tuple[int, str | None, float | None] | None = None
        self._restored: dict[str, Any] | None = None  # a resumed run's lineage, to adopt

    @property
    def tracking(self) -> bool:
        return self.keep_last is not None or self.monitor is not None

    @property
    def best_path(self) -> str | None:
        return self._best[0][2] if self._best else None

    def evaluated(self, event: ev.EvaluationEnded) -> None:
        # the monitored value the next save's state holds
        if self.monitor is not None and event.error is None and self.monitor in event.metrics:
            self._value = float(event.metrics[self.monitor])

    def saving(self, event: ev.CheckpointSaving) -> None:
        self._saving = (event.step, event.tag, self._value)

    def saved(self, event: ev.CheckpointSaved) -> list[str]:
        """Record ``event``; return the paths that are now surplus (oldest or worst first)."""
        self._saving = None
        value = None if self.monitor is None else event.metrics.get(self.monitor)
        return self._record(event.path, event.step, event.tag, value)

    def _record(self, path: str, step: int, tag: str | None, value: float | None) -> list[str]:
        if tag is None and self.keep_last is not None:
            self._last = [p for p in self._last if p != path] + [path]
            surplus, self._last = self._last[: -self.keep_last], self._last[-self.keep_last :]
            return surplus
        if tag == "best" and self.monitor is not None:
            if value is None or math.isnan(value):
                return []
            score = value if self.mode == "min" else -value
            entries = [e for e in self._best if e[2] != path] + [(score, step, path)]
            # Best first; among equals the newer first. The one just saved always stays.
            entries.sort(key=lambda e: (e[0], -e[1]))
            if self.keep_best is None:
                self._best = entries
                return []
            keep = entries[: self.keep_best]
            if all(e[2] != path for e in keep):  # a worse "best" sent by hand: still newest
                keep = [*keep[:-1], next(e for e in entries if e[2] == path)]
            self._best = keep
            return [e[2] for e in entries if e not in keep]
        return []

    def state_dict(self) -> dict[str, Any]:
        return {
            "last": [Path(p).name for p in self._last],
            "best": [[score, step, Path(p).name] for score, step, p in self._best],
            "saving": None if self._saving is None else list(self._saving),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Hold a saved lineage until :meth:`adopt`; ``ConfigError`` for a malformed one."""
        last: Any = state.get("last")
        best: Any = state.get("best")
        saving: Any = state.get("saving")
        ok = (
            isinstance(last, list)
            and all(isinstance(n, str) for n in last)
            and isinstance(best, list)
            and all(_shaped(e, float | int, int, str) for e in best)
            and (saving is None or _shaped(saving, int, object, object))
        )
        if not ok:
            raise ConfigError.invalid(
                "Checkpointing state",
                dict(state),
                "{'last': [name], 'best': [[score, step, name]], "
                "'saving': [step, tag, value] | None}",
            )
        self._restored = {"last": list(last), "best": [tuple(e) for e in best], "saving": saving}

    def adopt(self, resumed: Path, directory: Path | None) -> list[str]:
        """Take over ``resumed``'s lineage when it lies in ``directory``, redo the pruning done
        after its state was collected; return the paths now surplus."""
        restored, self._restored = self._restored, None
        if restored is None:
            return []
        if directory is None or not _same_folder(resumed.parent, directory):
            log.info(
                "checkpoint_lineage_left",
                path=str(resumed),
                checkpoint_dir=str(directory),
                reason="the resumed checkpoint is not in this run's checkpoint_dir: "
                "retention starts afresh and deletes none of the earlier files",
            )
            return []
        self._last = [
            str(directory / n)
            for n in restored["last"]
            if self.keep_last is not None and (directory / n).exists()
        ]
        self._best = sorted(
            (
                (float(score), int(step), str(directory / name))
                for score, step, name in restored["best"]
                if self.monitor is not None and (directory / name).exists()
            ),
            key=lambda e: (e[0], -e[1]),
        )
        saving = restored["saving"]
        parsed = _parse_checkpoint_entry(resumed.name)
        surplus: list[str] = []
        if saving is not None and parsed == (int(saving[0]), saving[1]):
            step, tag, value = parsed[0], parsed[1], saving[2]
            # A "final" checkpoint resumed from no longer ends the run: it counts as untagged.
            surplus = self._record(str(resumed), step, None if tag == "final" else tag, value)
            # A step's cadence save cannot name its "best" save of the same poll: adopt it.
            if tag is None and self.monitor is not None and value is not None:
                named = (directory / f"step-{step:08d}-best{ext}" for ext in (".pt", ""))
                sibling = next((p for p in named if p.exists()), None)
                if sibling is not None:
                    surplus += self._record(str(sibling), step, "best", value)
        if parsed is not None:
            # Files of later steps are named in no lineage: nothing proves them this run's.
            newer = sorted(
                p.name
                for p in directory.iterdir()
                if (entry := _parse_checkpoint_entry(p.name)) and entry[0] > parsed[0]
            )
            if newer:
                log.info(
                    "checkpoint_newer_left",
                    step=parsed[0],
                    names=newer,
                    reason="written after the checkpoint resumed from; retention deletes "
                    "only the files named in its lineage",
                )
        return surplus


# The checkpoint layer's names (``step-00000042[-<tag>].pt``, a sharded run's folder without
# ``.pt``), copied: the layer rules keep callbacks off that package.
_CHECKPOINT_NAME = re.compile(r"^step-(\d+)(?:-([A-Za-z0-9_.-]+?))?(\.pt)?$")


def _shaped(value: object, *kinds: Any) -> bool:
    """``value`` is a list or tuple of one item of each of ``kinds``, in order."""
    return (
        isinstance(value, list | tuple)
        and len(value) == len(kinds)
        and all(isinstance(v, k) for v, k in zip(value, kinds, strict=True))
    )


def _parse_checkpoint_entry(name: str) -> tuple[int, str | None] | None:
    """``(step, tag)`` of a checkpoint's name in its folder, or None for any other name."""
    m = _CHECKPOINT_NAME.match(name)
    return None if m is None else (int(m.group(1)), m.group(2))


# Lightning's ModelCheckpoint arguments that trainbus spells otherwise.
_LIGHTNING = {
    "dirpath": "Trainer(checkpoint_dir=...) (the Trainer writes the files; Checkpointing "
    "decides when)",
    "save_top_k": "keep_best=N (the N best by monitor=), or keep_last=N (the N newest)",
    "every_n_train_steps": "every_steps=N",
    "every_n_epochs": "every_epochs=N",
}


def _same_folder(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve() or os.path.samefile(a, b)
    except OSError:
        return False


class Checkpointing(Callback):
    """Sends ``SaveCheckpoint`` on a cadence and when a monitored metric improves, and deletes
    the files of this run that ``keep_last`` / ``keep_best`` make surplus. See
    docs/callbacks/checkpointing.md.

    Args:
        every_steps: Save every N optimizer steps (None: never on steps).
        every_epochs: Save every N epochs (None: never on epochs). **The default, 1, also
            applies beside** ``every_steps``: pass ``every_epochs=None`` for steps only.
        monitor: Save ``tag="best"`` checkpoints when this evaluation metric (``"val_loss"``)
            improves; None to disable.
        mode: ``"min"`` if lower ``monitor`` is better, ``"max"`` if higher is; ``"auto"``:
            from the name (see docs/callbacks/index.md).
        min_delta: Smallest change of ``monitor`` that counts as an improvement.
        keep_last: Keep only the N newest untagged checkpoints of this run (None: all).
        keep_best: Keep only the N best ``tag="best"`` checkpoints of this run (None: all).
            Needs ``monitor``.
        load_best_at_end: When ``fit()`` ends without an exception, load :attr:`best_path`'s
            weights. Needs ``monitor``; not with a sharded (FSDP2) model.
        state_key: Name of its state in checkpoints (None: ``"Checkpointing"``).

    Raises:
        ConfigError: for an argument out of range, or when nothing would ever be saved;
            ``keep_best`` or ``load_best_at_end`` without ``monitor``.
        TypeError: an unknown keyword; one of Lightning's ``ModelCheckpoint`` names its
            trainbus equivalent (``save_top_k``: ``keep_best``).
    """

    @lightning_names("Checkpointing", "ModelCheckpoint", _LIGHTNING)
    def __init__(
        self,
        every_steps: int | None = None,
        every_epochs: int | None = 1,
        monitor: str | None = None,
        mode: Literal["min", "max", "auto"] = "auto",
        *,
        min_delta: float = 0.0,
        keep_last: int | None = None,
        keep_best: int | None = None,
        load_best_at_end: bool = False,
        state_key: str | None = None,
    ) -> None:
        self.state_key = state_key
        self.every_steps = check_int("every_steps", every_steps, 1, optional=True)
        self.every_epochs = check_int("every_epochs", every_epochs, 1, optional=True)
        self.monitor = None if monitor is None else check_metric("monitor", monitor)
        self.mode = check_mode(mode, self.monitor)
        self.min_delta = check_number("min_delta", min_delta)
        self.tracker = Tracker()
        """The best ``monitor`` value so far (a fresh one each time it is added)."""
        self.keep_last = check_int("keep_last", keep_last, 1, optional=True)
        self.keep_best = check_int("keep_best", keep_best, 1, optional=True)
        if self.keep_best is not None and self.monitor is None:
            raise ConfigError.invalid("keep_best", keep_best, "None unless monitor is set")
        if check_bool("load_best_at_end", load_best_at_end) and self.monitor is None:
            raise ConfigError.invalid(
                "load_best_at_end",
                True,
                "False unless monitor is set (the best checkpoint is the best by monitor)",
            )
        self.load_best_at_end = load_best_at_end
        self._retention = _Retention(self.keep_last, self.keep_best, self.monitor, self.mode)
        self._checkpoint_dir: Path | None = None
        if self.every_steps is None and self.every_epochs is None and self.monitor is None:
            raise ConfigError.invalid(
                "every_epochs",
                None,
                "an int >= 1 when every_steps and monitor are None too "
                "(otherwise Checkpointing never saves)",
            )

    @property
    def best_path(self) -> str | None:
        """The best ``"best"`` checkpoint of this run by ``monitor`` (the newest among equals),
        or None."""
        return self._retention.best_path

    def weights_at_end(self) -> str | None:
        """:attr:`best_path` with ``load_best_at_end=True``, else None."""
        return self.best_path if self.load_best_at_end else None

    def after_fit(self, result: FitResult) -> None:
        """With ``load_best_at_end``, log when no ``"best"`` checkpoint was written."""
        if self.load_best_at_end and self.best_path is None:
            log.info(
                "best_checkpoint_none",
                monitor=self.monitor,
                steps=result.steps,
                action="no evaluation improved on the best so far; the model keeps its "
                "last weights",
            )

    def state_dict(self) -> dict[str, Any]:
        """The best ``monitor`` value so far (``"best"``) and the files this run keeps
        (``"files"``)."""
        state: dict[str, Any] = {"best": self.tracker.best}
        if self._retention.tracking:
            state["files"] = self._retention.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; the files are taken over at ``CheckpointLoaded``.

        Raises:
            ConfigError: ``state`` has no ``"best"`` number, or malformed ``"files"``.
        """
        best = state.get("best")
        if best is not None and not isinstance(best, int | float):
            raise ConfigError.invalid("Checkpointing state", dict(state), "{'best': float | None}")
        self.tracker.best = None if best is None else float(best)
        files = state.get("files")  # absent in checkpoints of runs that kept no files
        if files is not None:
            if not isinstance(files, Mapping):
                raise ConfigError.invalid(
                    "Checkpointing state", dict(state), "{'best': float | None, 'files': {...}}"
                )
            self._retention.load_state_dict(files)

    def check(self, plan: RunPlan) -> None:
        """Refuse a run where it could never save what it promises.

        Raises:
            ConfigError: the Trainer has no ``checkpoint_dir``; ``monitor`` is not a metric of
                ``eval_data``, or there is neither ``eval_data`` nor an evaluation job;
                ``load_best_at_end`` with a sharded model.
        """
        if plan.checkpoint_dir is None:
            raise ConfigError.invalid(
                "checkpoint_dir",
                None,
                "a folder when Checkpointing is added (Trainer(checkpoint_dir=...))",
            )
        if self.load_best_at_end and plan.sharded:
            raise ConfigError.invalid(
                "load_best_at_end",
                True,
                "False with a sharded (fully_shard) model: its best "
                "checkpoint is a folder of every rank's shards; load it after fit() with "
                "trainbus.checkpoint.export_full, or resume from it",
            )
        self._checkpoint_dir = Path(plan.checkpoint_dir)
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
        if (monitor := self.monitor) is not None:
            tracker = self.tracker

            def improved(e: ev.EvaluationEnded | ev.ExternalEvaluationEnded) -> bool:
                if monitor not in e.metrics:
                    raise ConfigError.invalid("monitor", monitor, f"one of {sorted(e.metrics)}")
                value = float(e.metrics[monitor])
                return tracker.update(value, mode=self.mode, min_delta=self.min_delta, step=e.step)

            evaluations(bus, monitor, ev.EvaluationEnded).pipe(
                ops.filter(improved),
                ops.map(lambda _: cmd.SaveCheckpoint(tag="best")),
            ).subscribe(bus.commands, name="Checkpointing.best")
            bus.subscribe_async(
                evaluations(bus, monitor, ev.ExternalEvaluationEnded).pipe(ops.filter(improved)),
                self._mark_best,
                name="Checkpointing.best_external",
            )
        self._retention = _Retention(self.keep_last, self.keep_best, self.monitor, self.mode)
        if self._retention.tracking:
            # Every rank keeps the books (load_best_at_end loads on each), in event order; rank
            # 0 deletes, off the event loop (a barrier never waits for a slow disk), in order.
            removals: Subject[_Removal] | None = None
            if bus.rank == 0:
                removals = Subject()
                bus.subscribe_async(
                    removals, _remove_logged, overflow="block", name="Checkpointing.removal"
                )
            books = bus.stream(
                ev.EvaluationEnded, ev.CheckpointSaving, ev.CheckpointSaved, ev.CheckpointLoaded
            )
            bus.subscribe(
                books,
                partial(self._keep_books, removals=removals),
                ranks="all",
                name="Checkpointing.retention",
            )

    async def _mark_best(self, event: ev.ExternalEvaluationEnded) -> None:
        source = Path(event.checkpoint)
        best = await anyio.to_thread.run_sync(copy_as_best, source, event.step)
        log.info(
            "checkpoint_marked_best",
            step=event.step,
            path=str(best),
            source=str(source),
            metrics=dict(event.metrics),
        )

    def _keep_books(self, event: ev.BaseEvent, *, removals: Subject[_Removal] | None) -> None:
        retention = self._retention
        match event:
            case ev.EvaluationEnded():
                return retention.evaluated(event)
            case ev.CheckpointSaving():
                return retention.saving(event)
            case ev.CheckpointLoaded(path=path):
                surplus, reason = retention.adopt(Path(path), self._checkpoint_dir), "resume"
            case ev.CheckpointSaved():
                surplus = retention.saved(event)
                reason = "keep_last" if event.tag is None else "keep_best"
            case _:
                return
        if removals is not None:  # rank 0 deletes
            for path in surplus:
                removals.on_next(_Removal(Path(path), event.step, reason))

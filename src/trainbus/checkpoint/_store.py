"""The checkpoint folder: atomic writes, safe reads, the newest valid checkpoint, stale temps;
and the three calls the loop and the trainer make (save, load, find the latest). The
guarantees are docs/reliability.md's ("Checkpoint files")."""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import secrets
import shutil
import tempfile
import threading
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from .._durable import fsync_folder
from .._exceptions import CheckpointError, CheckpointWriteError, ConfigError
from .._log import get_logger
from .._tensors import is_sharded_model
from ._rng import capture_rng
from ._state import Checkpoint, TrainState, build_payload, parse_payload

__all__ = [
    "STATE_FILE",
    "TEMP_SUFFIX",
    "CheckpointStore",
    "LatestScan",
    "check_checkpoint_dir",
    "folder_name",
    "latest_checkpoint",
    "load_checkpoint",
    "one_line_reason",
    "parse_checkpoint_name",
    "rank_file",
    "read_checkpoint",
    "read_folder",
    "read_rank_file",
    "save_checkpoint",
    "temp_name",
    "write_atomic",
]

log = get_logger(__name__)

TEMP_SUFFIX = ".trainbus-tmp"
_FOLDER = re.compile(r"^step-(\d+)(?:-([A-Za-z0-9_.-]+))?$")  # a sharded run's checkpoint
_NAME = re.compile(_FOLDER.pattern.removesuffix("$") + r"\.pt$")
_TEMP = re.compile(r"^\..+\.(\d+)\.[0-9a-f]+" + re.escape(TEMP_SUFFIX) + "$")

# Temp files this process is writing right now: the same pid can belong to a killed writer of
# an earlier container run (pid 1 restarts as pid 1), so "my pid" alone does not mean "mine".
_in_flight: set[str] = set()
_in_flight_lock = threading.Lock()


def folder_name(step: int, tag: str | None) -> str:
    """``step-00000042`` or ``step-00000042-best``: a sharded checkpoint's folder name."""
    return f"step-{step:08d}" + (f"-{tag}" if tag else "")


def parse_checkpoint_name(name: str) -> tuple[int, str | None] | None:
    """``(step, tag)`` of a ``step-<n>[-<tag>].pt`` name, or None for any other name."""
    m = _NAME.match(name)
    return None if m is None else (int(m.group(1)), m.group(2))


def check_checkpoint_dir(path: object) -> Path:
    """Check up front that ``path`` is, or can be made, a writable folder; nothing is left behind.

    Args:
        path: The ``checkpoint_dir`` setting.

    Returns:
        The path as a :class:`~pathlib.Path`.

    Raises:
        ConfigError: naming ``checkpoint_dir``: not a path, a file, under a file, or in a
            folder this process may not write to.
    """
    if not isinstance(path, str | os.PathLike) or not os.fspath(path):
        raise ConfigError.invalid("checkpoint_dir", path, "a folder path (str or pathlib.Path)")
    folder = Path(path)
    probe = folder.absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if probe == folder.absolute() and not probe.is_dir():
        raise ConfigError.invalid("checkpoint_dir", str(folder), "a folder (this path is a file)")
    if not probe.is_dir():
        raise ConfigError.invalid(
            "checkpoint_dir",
            str(folder),
            f"a folder path; {probe} is a file, so no folder can be created under it",
        )
    try:  # a real folder made and removed: os.access alone trusts root on /proc, say
        os.rmdir(tempfile.mkdtemp(prefix=".trainbus-probe-", dir=probe))
    except OSError as exc:
        raise ConfigError.invalid(
            "checkpoint_dir",
            str(folder),
            f"a folder this process can write; no folder can be "
            f"created in {probe} ({exc.strerror})",
        ) from None
    return folder


STATE_FILE = "trainbus.pt"
"""The file of a checkpoint folder holding trainbus' own state (rank 0 writes it)."""
_METADATA = ".metadata"


def one_line_reason(exc: BaseException) -> str:
    """An exception in one line (torch.load's refusals are a page around one line)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    for i, line in enumerate(lines):
        if "WeightsUnpickler error" in line:
            return " ".join(lines[i : i + 2])
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def read_file(path: Path, *, map_location: Any = "cpu") -> Checkpoint:
    """:func:`~trainbus.checkpoint.read_checkpoint` of a file."""
    where = str(path)
    if not path.is_file():
        raise CheckpointError("no such file", path=where)
    if path.stat().st_size == 0:
        raise CheckpointError("empty file (0 bytes): a write that never completed", path=where)
    # A damaged zip raises many kinds (BadZipFile, EOFError, struct.error, zlib.error...).
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except MemoryError:
        raise
    except Exception as exc:
        raise CheckpointError(
            f"not a complete checkpoint archive (truncated or not a torch file): {exc}", path=where
        ) from exc
    if bad is not None:
        raise CheckpointError(
            f"corrupt: the archive member {bad!r} fails its CRC check", path=where
        )
    try:
        payload = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        what = (
            "refused by safe loading (weights_only=True): it holds objects other than "
            "tensors and plain containers, so it is not a trainbus checkpoint and may be "
            f"crafted to run code ({one_line_reason(exc)})"
        )
        raise CheckpointError(what, path=where) from exc
    except MemoryError:
        raise
    except Exception as exc:
        why = one_line_reason(exc)
        raise CheckpointError(f"torch.load cannot read it: {why}", path=where) from exc
    return parse_payload(payload, path)


def rank_file(rank: int) -> str:
    """Rank ``rank``'s own file in a checkpoint folder."""
    return f"rank-{rank}.pt"


def _check_dcp_files(folder: Path) -> None:
    """The DCP index parses and names files that are all present and long enough."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    if not (folder / _METADATA).is_file():
        raise CheckpointError(
            "no DCP index (.metadata): not a complete sharded checkpoint", path=str(folder)
        )
    try:
        metadata = FileSystemReader(str(folder)).read_metadata()
    except Exception as exc:
        raise CheckpointError(
            f"its DCP index (.metadata) cannot be read: {one_line_reason(exc)}", path=str(folder)
        ) from exc
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = int(info.offset) + int(info.length)
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for relative, end in sorted(needed.items()):
        file = folder / relative
        if not file.is_file():
            raise CheckpointError(
                f"missing the shard file {relative} (a rank's part of the "
                "model and optimizer state)",
                path=str(folder),
            )
        size = file.stat().st_size
        if size < end:
            raise CheckpointError(
                f"the shard file {relative} is truncated ({size} bytes, the index needs {end})",
                path=str(folder),
            )


def read_folder(folder: str | os.PathLike[str]) -> Checkpoint:
    """Read and check a sharded checkpoint folder; nothing is applied to a model yet.

    Args:
        folder: The checkpoint folder (``step-<n>[-<tag>]/``).

    Returns:
        The :class:`~trainbus.checkpoint.Checkpoint` of ``trainbus.pt`` (``meta["sharded"]``
        True; empty ``model`` and ``optimizer``: they are in the DCP files).

    Raises:
        CheckpointError: not a folder, the DCP index is missing or unreadable, a shard file
            or a rank's ``rank-<r>.pt`` is missing or truncated, or ``trainbus.pt`` is not a
            valid trainbus payload. The message names the folder.
    """
    path = Path(folder)
    if not path.is_dir():
        raise CheckpointError("no such checkpoint folder", path=str(path))
    _check_dcp_files(path)
    if not (path / STATE_FILE).is_file():
        raise CheckpointError(
            f"missing {STATE_FILE} (trainbus' own state, written by rank 0)", path=str(path)
        )
    inner = read_file(path / STATE_FILE)
    checkpoint = replace(inner, path=path)
    if not checkpoint.meta.get("sharded"):
        raise CheckpointError(f"its {STATE_FILE} is not a sharded checkpoint's", path=str(path))
    world = int(checkpoint.meta["world_size"])
    missing = [rank_file(r) for r in range(world) if not (path / rank_file(r)).is_file()]
    if missing:
        raise CheckpointError(
            f"missing {', '.join(missing)} (each rank's RNG and data order; "
            f"written by {world} ranks)",
            path=str(path),
        )
    return checkpoint


def read_rank_file(folder: Path, rank: int) -> dict[str, Any]:
    """Rank ``rank``'s RNG states and data order; ``CheckpointError`` when it is missing,
    damaged or foreign."""
    path = folder / rank_file(rank)
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError as exc:
        raise CheckpointError(f"missing {rank_file(rank)}", path=str(folder)) from exc
    except Exception as exc:
        why = one_line_reason(exc)
        raise CheckpointError(
            f"{rank_file(rank)} cannot be read (damaged, or not written by trainbus): {why}",
            path=str(folder),
        ) from exc
    if not isinstance(saved, dict) or not {"rng", "data_order"} <= set(saved):
        raise CheckpointError(f"{rank_file(rank)} is not a trainbus rank file", path=str(folder))
    return saved


def read_checkpoint(path: str | os.PathLike[str], *, map_location: Any = "cpu") -> Checkpoint:
    """Read and check a ``.pt`` checkpoint or a sharded run's folder; nothing is applied yet.

    Args:
        path: The ``.pt`` file, or a ``step-<n>[-<tag>]/`` folder a sharded run wrote.
        map_location: Where tensors are loaded (as in ``torch.load``).

    Returns:
        The :class:`~trainbus.checkpoint.Checkpoint`; call its ``restore(...)`` to apply it.

    Raises:
        CheckpointError: naming the file or folder (the low-level error is the ``__cause__``):
            missing, empty, truncated, corrupt (a CRC fails), holding anything but tensors and
            plain containers (``weights_only`` refuses it, so crafted code never runs), not a
            trainbus checkpoint of this format, or an incomplete sharded folder.
    """
    p = Path(path)
    if p.is_dir():
        return read_folder(p)
    return read_file(p, map_location=map_location)


def temp_name(name: str) -> str:
    """A hidden temp name for writing ``name``, holding the writer's pid."""
    return f".{name}.{os.getpid()}.{secrets.token_hex(4)}{TEMP_SUFFIX}"


def write_atomic(obj: Any, path: Path) -> None:
    """``torch.save`` to a fsynced temp file renamed over ``path``; ``OSError``: none is left."""
    tmp_name = temp_name(path.name)
    tmp = path.with_name(tmp_name)
    with _in_flight_lock:
        _in_flight.add(tmp_name)
    try:
        # O_EXCL: never write through a file someone else put there; 0o666 & ~umask like
        # a plain open().
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
        with os.fdopen(fd, "wb") as f:
            sink = _Sink(f)
            try:
                torch.save(obj, sink)  # type: ignore[arg-type]  # write + flush suffice
            except Exception as exc:  # torch reports a refused write without its errno
                if sink.error is None or isinstance(exc, OSError):
                    raise
                raise sink.error from exc
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):  # also NotADirectoryError: a path under a file
            tmp.unlink(missing_ok=True)
        raise
    finally:
        with _in_flight_lock:
            _in_flight.discard(tmp_name)
    fsync_folder(path.parent)  # the rename is durable once the folder is


class _Sink:
    """``torch.save``'s file, remembering the ``OSError`` a write raised."""

    __slots__ = ("_file", "error")

    def __init__(self, file: Any) -> None:
        self._file = file
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return int(self._file.write(data))
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        self._file.flush()


@dataclass(frozen=True, slots=True)
class LatestScan:
    """What :meth:`CheckpointStore.find_latest` found in a checkpoint folder.

    Attributes:
        directory: The folder scanned.
        checkpoint: The newest valid checkpoint, or None.
        exists: Whether the folder exists (a folder path).
        skipped: ``(file name, reason)`` of each checkpoint file skipped as invalid, newest first.
        others: Names of the other entries when no checkpoint was found (files not named like
            a checkpoint, ``step-<n>.pt``: a folder of another tool, or a mistyped one).
    """

    directory: Path
    checkpoint: Checkpoint | None
    exists: bool = field(kw_only=True)
    skipped: tuple[tuple[str, str], ...] = field(default=(), kw_only=True)
    others: tuple[str, ...] = field(default=(), kw_only=True)

    def describe(self, *, limit: int = 5) -> str:
        """What the folder held, in words (``"no such folder"``, ``"an empty folder"``, ...).

        Args:
            limit: Names listed at most (then ``"... and N more"``).
        """
        if not self.exists:
            return "no such folder"

        def listed(names: list[str], sep: str) -> str:
            more = f"{sep}... and {len(names) - limit} more" if len(names) > limit else ""
            return sep.join(names[:limit]) + more

        parts: list[str] = []
        if n := len(self.skipped):
            what = "file, invalid" if n == 1 else "files, all invalid"
            names = [f"{name} ({reason})" for name, reason in self.skipped]
            parts.append(f"{n} checkpoint {what}: " + listed(names, "; "))
        if self.checkpoint is None and (n := len(self.others)):
            prefix = "" if self.skipped else "no checkpoint file (step-<n>.pt); "
            entries = f"entr{'y' if n == 1 else 'ies'}"
            parts.append(f"{prefix}{n} other {entries}: " + listed(list(self.others), ", "))
        return "; ".join(parts) if parts else "an empty folder"


class CheckpointStore:
    """One checkpoint folder: writes files atomically, finds the newest valid one; the folder is
    created by the first :meth:`save`.

    Args:
        directory: The checkpoint folder.
        clean: Remove stale temp files now (the default).
    """

    def __init__(self, directory: str | os.PathLike[str], *, clean: bool = True) -> None:
        self._directory = Path(directory)
        if clean:
            self.clean_stale()

    def clean_stale(self) -> list[Path]:
        """Remove the temp files whose writer is gone (its pid is not running, or is this one's).

        Returns:
            The files removed.
        """
        if not self._directory.is_dir():
            return []
        removed: list[Path] = []
        for entry in self._directory.iterdir():
            m = _TEMP.match(entry.name)
            if m is None or not self._stale(entry.name, int(m.group(1))):
                continue
            if entry.is_dir():  # a sharded save's temporary folder
                shutil.rmtree(entry, ignore_errors=True)
            elif entry.is_file():
                entry.unlink(missing_ok=True)
            else:
                continue
            removed.append(entry)
            log.info("checkpoint_temp_removed", path=str(entry), reason="writer is gone")
        return removed

    @staticmethod
    def _stale(name: str, pid: int) -> bool:
        if pid == os.getpid():
            with _in_flight_lock:
                return name not in _in_flight
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except OSError:  # alive under another user, or cannot tell: keep
            pass
        return False

    def save(self, payload: dict[str, Any], *, step: int, tag: str | None = None) -> Path:
        """Write ``payload`` atomically as ``step-<step>[-<tag>].pt`` and return its path.

        Args:
            payload: The checkpoint's contents: tensors and plain containers only.
            step: The optimizer step (names the file).
            tag: Optional name part (``"best"``, ``"final"``).

        Returns:
            The final path; it exists and is complete when this returns.

        Raises:
            CheckpointWriteError: an ``OSError`` naming the file (disk full, permissions);
                earlier checkpoints are untouched.
        """
        path = self._directory / f"{folder_name(step, tag)}.pt"
        try:
            self._directory.mkdir(parents=True, exist_ok=True)
            write_atomic(payload, path)
        except OSError as exc:
            # The OS error alone names no file (torch.save's ENOSPC names nothing at all).
            raise CheckpointWriteError(str(path), exc) from exc
        return path

    def checkpoints(self) -> list[Path]:
        """Files named like checkpoints, newest first (highest step, then latest written)."""
        if not self._directory.is_dir():
            return []
        found: list[tuple[int, int, Path]] = []
        for entry in self._directory.iterdir():
            file = entry.name.endswith(".pt")  # else a sharded checkpoint's folder (sharded.py)
            m = _FOLDER.match(entry.name.removesuffix(".pt"))
            if m is None or not (entry.is_file() if file else entry.is_dir()):
                continue
            step = int(m.group(1))
            try:
                mtime = entry.stat().st_mtime_ns
            except FileNotFoundError:  # removed meanwhile (retention)
                continue
            found.append((step, mtime, entry))
        found.sort(key=lambda t: (t[0], t[1]), reverse=True)
        return [p for _, _, p in found]

    def find_latest(self, *, map_location: Any = "cpu") -> LatestScan:
        """Read the newest valid checkpoint, skipping the others (each logged as
        ``checkpoint_skipped`` with its reason, never deleted).

        Returns:
            The scan: the newest valid checkpoint (or None), the files skipped and why, and what
            else the folder held.
        """
        if not self._directory.is_dir():
            return LatestScan(self._directory, None, exists=False)
        skipped: list[tuple[str, str]] = []
        for path in self.checkpoints():
            try:
                found = read_checkpoint(path, map_location=map_location)
            except CheckpointError as exc:
                log.warning("checkpoint_skipped", path=str(path), reason=str(exc))
                skipped.append((path.name, str(exc)))
                continue
            return LatestScan(self._directory, found, exists=True, skipped=tuple(skipped))
        others = sorted(e.name for e in self._directory.iterdir() if _TEMP.match(e.name) is None)
        return LatestScan(
            self._directory,
            None,
            exists=True,
            skipped=tuple(skipped),
            others=tuple(o for o in others if o not in dict(skipped)),
        )

    def latest_valid(self) -> Path | None:
        """Path of the newest valid checkpoint (see :meth:`find_latest`), or None."""
        found = self.find_latest().checkpoint
        return None if found is None else found.path


def save_checkpoint(
    directory: Path,
    *,
    tag: str | None,
    state: TrainState,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any | None,
    scaler: Any | None,
    metrics: Mapping[str, float],
    rng: dict[str, Any] | None = None,
    data_order: dict[str, Any] | None = None,
    callback_states: Mapping[str, Mapping[str, Any]] | None = None,
    world_size: int = 1,
    run: Mapping[str, Any] | None = None,
) -> Path:
    """Write a checkpoint atomically and return its path.

    Args:
        directory: The checkpoint folder (created on the first save).
        tag: Name part of the file (``step-<n>-<tag>.pt``), or None.
        state: Where the loop is.
        model, optimizer, scheduler, scaler: Saved through their ``state_dict()``.
        metrics: The last evaluation's metrics.
        rng: RNG states to store (:func:`~trainbus.checkpoint.capture_rng`); None captures the
            current ones.
        data_order: :func:`~trainbus.checkpoint.capture_data_order` of the epoch in progress.
        callback_states: ``{name: state dict}`` of tensors and plain containers.
        world_size: Processes training together.
        run: The run's cadences and data shape, compared by a resume (``meta["run"]``).

    Returns:
        The checkpoint's path; the file is complete when this returns.

    Raises:
        ConfigError: a callback state or the data order cannot be saved safely, or the
            model is sharded (:func:`~trainbus.checkpoint.save_sharded` saves it).
        OSError: the folder cannot be written; earlier checkpoints are untouched.
    """
    if is_sharded_model(model):
        raise ConfigError.invalid(
            "model",
            type(model).__name__,
            "an unsharded model: a fully_shard model's "
            "state_dict holds only this rank's shards; save it from every rank with "
            "trainbus.checkpoint.save_sharded (the Trainer does)",
        )
    payload = build_payload(
        state=state,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=scaler,
        metrics=metrics,
        rng=capture_rng() if rng is None else rng,
        data_order=data_order,
        callback_states=callback_states,
        world_size=world_size,
        run=run,
    )
    return CheckpointStore(directory).save(payload, step=state.step, tag=tag)


def latest_checkpoint(directory: Path) -> Path | None:
    """The newest valid checkpoint in ``directory`` (:meth:`CheckpointStore.find_latest`), or
    None."""
    return CheckpointStore(directory).latest_valid()


def load_checkpoint(
    path: Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any | None,
    scaler: Any | None,
    map_location: torch.device | str = "cpu",
    restore_rng: bool = True,
    world_size: int = 1,
) -> tuple[TrainState, dict[str, float]]:
    """Restore everything saved by :func:`save_checkpoint`; return the train state and metrics.

    Args:
        path: The checkpoint file.
        model, optimizer, scheduler, scaler: Restored in place.
        map_location: Where tensors are loaded.
        restore_rng: Set the random generators to the saved states (the default).
        world_size: Processes training together now.

    Raises:
        CheckpointError: the file is missing, damaged, not a trainbus checkpoint, or does not
            fit the model, optimizer or world size (nothing is restored then).
    """
    checkpoint = read_checkpoint(path, map_location=map_location)
    checkpoint.restore(
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=scaler,
        world_size=world_size,
        rng=restore_rng,
    )
    return checkpoint.state, dict(checkpoint.metrics)

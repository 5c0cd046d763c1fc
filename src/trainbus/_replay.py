"""Replay a recorded run: the events of a ``JsonlEventLog`` file as an Observable in time
(docs/replay.md); a folder of runs (``runs/demo/<timestamp>``) names its newest by a ``latest``
pointer."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import reactivex
from reactivex import Observable, abc
from reactivex.disposable import CompositeDisposable, Disposable
from reactivex.scheduler import CurrentThreadScheduler

from . import _wire as wire
from . import events as ev
from ._exceptions import ConfigError

__all__ = ["LATEST", "EventFilter", "load_events", "new_run_dir", "replay", "resolve_run"]

LATEST = "latest"
"""The pointer in a folder of runs (``runs/demo/latest``) to its newest run: a symbolic link,
or a text file naming the run's folder where links cannot be made."""


def resolve_run(path: str | os.PathLike[str]) -> Path:
    """The event log a path names: the ``.jsonl`` file itself, ``<run dir>/events.jsonl``, or
    for a folder of runs the newest run's log, by its ``latest`` pointer. The file may not
    exist."""
    file = Path(path)
    if not file.is_dir():
        return file
    latest = file / LATEST
    if not (file / "events.jsonl").exists():
        if latest.is_dir():  # a symbolic link
            return latest / "events.jsonl"
        if latest.is_file():  # a pointer file
            name = latest.read_text(encoding="utf-8").strip()
            if name and Path(name).name == name:  # a folder beside it, never a path elsewhere
                return file / name / "events.jsonl"
    return file / "events.jsonl"


def new_run_dir(root: Path) -> Path:
    """Create and return the empty run folder ``root/<timestamp>`` (``-2``, ``-3``... on a
    clash) and point ``root/latest`` at it."""
    root.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_dir, n = root / stamp, 1
    while True:
        try:
            run_dir.mkdir()
            break
        except FileExistsError:
            n += 1
            run_dir = root / f"{stamp}-{n}"
    latest = root / LATEST
    if latest.is_symlink() or latest.is_file():
        latest.unlink()
    try:
        latest.symlink_to(run_dir.name, target_is_directory=True)
    except OSError:  # no symbolic links here (Windows without the privilege)
        latest.write_text(run_dir.name + "\n", encoding="utf-8")
    return run_dir


@dataclass(frozen=True, slots=True)
class EventFilter:
    """Which recorded events to keep: by class (empty: all) and by step range, inclusive (None:
    open); the ``trainbus replay`` options."""

    types: tuple[type[ev.BaseEvent], ...] = ()
    first_step: int | None = None
    last_step: int | None = None

    @classmethod
    def parse(cls, types: Iterable[str] = (), steps: str | None = None) -> EventFilter:
        """From ``--type`` class names (comma-separated counts as several) and ``--steps``
        ``START:END`` (either side may be left out; ``N`` is ``N:N``); else ``ConfigError``."""
        known = {t.__name__: t for t in ev.EVENT_TYPES}
        chosen: list[type[ev.BaseEvent]] = []
        for name in (n.strip() for text in types for n in text.split(",")):
            if name not in known:
                raise ConfigError.invalid(
                    "--type", name, "an event class name: " + ", ".join(sorted(known))
                )
            chosen.append(known[name])
        first = last = None
        if steps is not None:
            start, colon, end = steps.partition(":")
            try:
                first = int(start) if start.strip() else None
                last = (int(end) if end.strip() else None) if colon else first
            except ValueError:
                raise ConfigError.invalid(
                    "--steps", steps, "START:END with integers, either side may be left out"
                ) from None
            if first is not None and last is not None and first > last:
                raise ConfigError.invalid(
                    "--steps", steps, f"START <= END (the range is inverted: {first} > {last})"
                )
        return cls(tuple(chosen), first, last)

    def matches(self, event: ev.BaseEvent) -> bool:
        """Whether ``event`` passes the filter."""
        if self.types and not isinstance(event, self.types):
            return False
        if self.first_step is not None and event.step < self.first_step:
            return False
        return self.last_step is None or event.step <= self.last_step


def load_events(path: str | os.PathLike[str]) -> Iterator[ev.BaseEvent]:
    """The events of a ``JsonlEventLog`` file (or of what :func:`resolve_run` finds for a run
    folder); ``ConfigError`` for no such file or a line that is not an event's record."""
    file = resolve_run(path)
    if not file.is_file():
        raise ConfigError.invalid(
            "path",
            os.fspath(path),
            "a JsonlEventLog file, a run folder, or a folder of runs with a 'latest' pointer",
        )
    with open(file, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                event = wire.loads(line)
            except ConfigError as exc:
                raise ConfigError(f"{file}:{n}: {exc}") from None
            if not isinstance(event, ev.BaseEvent):
                raise ConfigError.invalid(
                    f"{file}:{n} type", type(event).__name__, "an event class"
                )
            yield event


def replay(path: str | os.PathLike[str]) -> Observable[ev.BaseEvent]:
    """The recorded run at ``path`` as a cold Observable of its events, each at its original
    time relative to the first, on the scheduler given to ``subscribe`` (docs/replay.md).

    Args:
        path: A ``JsonlEventLog`` file, or a run folder holding ``events.jsonl``.

    Returns:
        An Observable of the rebuilt events (read once, when this is called).

    Raises:
        ConfigError: see :func:`load_events`.
    """
    events = list(load_events(path))

    def subscribe(
        observer: abc.ObserverBase[ev.BaseEvent], scheduler: abc.SchedulerBase | None = None
    ) -> abc.DisposableBase:
        sched = scheduler or CurrentThreadScheduler.singleton()
        if not events:
            return sched.schedule(lambda *_: observer.on_completed())
        disposables = CompositeDisposable()
        # One chain: each event schedules the next at its delay, so order is kept exactly even
        # when two events share a timestamp.

        def emit(_: abc.SchedulerBase, i: Any) -> None:
            observer.on_next(events[i])
            if i + 1 == len(events):
                observer.on_completed()
                return
            delay = max(0.0, events[i + 1].time - events[i].time)
            disposables.add(sched.schedule_relative(delay, emit, i + 1))

        disposables.add(sched.schedule_relative(0.0, emit, 0))
        return Disposable(disposables.dispose)

    return reactivex.create(subscribe)

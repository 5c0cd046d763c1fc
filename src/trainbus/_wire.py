"""The wire format: events and commands as plain, versioned JSON records, one codec for every
place they leave the process (docs/distributed.md, "The wire format"). Nothing is pickled:
decoding builds only the classes of ``EVENT_TYPES`` and ``COMMAND_TYPES``."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any, TypeAlias, cast

import torch

from . import commands as cmd
from . import events as ev
from ._exceptions import ConfigError, RecordedError

__all__ = [
    "FORMAT_VERSION",
    "Message",
    "decode",
    "dumps",
    "encode",
    "loads",
    "record",
]

FORMAT_VERSION = 1
"""Version of the records written (their ``v`` field)."""

Message: TypeAlias = "ev.BaseEvent | cmd.Command"
"""What crosses: an event or a command."""

_KINDS: Mapping[str, type[Any]] = {t.__name__: t for t in (*ev.EVENT_TYPES, *cmd.COMMAND_TYPES)}
# Each class's field names, read once: dataclasses.fields() per message costs as much as the
# rest of encoding a small event.
_FIELDS: Mapping[type[Any], tuple[str, ...]] = {
    kind: tuple(f.name for f in dataclasses.fields(kind)) for kind in _KINDS.values()
}
_ENCODER = json.JSONEncoder(allow_nan=True, separators=(",", ":"))


def _value(v: Any) -> Any:
    if v is None or isinstance(v, bool | int | float | str):
        return v
    if isinstance(v, torch.Tensor):
        # Reads the device: callers run this off the training thread (the JSONL writer's
        # worker thread, the link's sender thread).
        return float(v) if v.numel() == 1 else v.detach().cpu().tolist()
    if isinstance(v, RecordedError):  # already a repr: re-encoding a decoded event is exact
        return str(v)
    if isinstance(v, BaseException):
        return repr(v)
    if isinstance(v, ev.BaseEvent) or isinstance(v, cmd.COMMAND_TYPES):
        return record(cast("Message", v))
    if isinstance(v, Mapping):
        return {str(k): _value(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_value(x) for x in v]
    if isinstance(v, os.PathLike):
        return os.fspath(v)
    return repr(v)


def record(message: Message) -> dict[str, Any]:
    """The JSON-ready record of an event or command, without the version field."""
    names = _FIELDS.get(type(message))
    if names is None:  # a subclass or foreign dataclass: its own fields
        names = tuple(f.name for f in dataclasses.fields(message))
    return {"type": type(message).__name__, **{n: _value(getattr(message, n)) for n in names}}


def encode(message: Message) -> dict[str, Any]:
    """The versioned record of ``message``: :func:`record` with ``"v"`` first."""
    return {"v": FORMAT_VERSION, **record(message)}


def _build(rec: Mapping[str, Any]) -> Message:
    name = rec.get("type")
    kind = _KINDS.get(str(name))
    if kind is None:
        raise ConfigError.invalid("type", name, "a trainbus event or command class name")
    kwargs = {k: v for k, v in rec.items() if k in _FIELDS[kind]}
    # Only these fields hold non-JSON values; decoding by field name (not by the shape of the
    # value) keeps a metric mapping with a "type" key a mapping.
    if isinstance(kwargs.get("error"), str):
        kwargs["error"] = RecordedError(kwargs["error"])
    for k in ("command", "result"):
        if isinstance(kwargs.get(k), dict):
            kwargs[k] = _build(kwargs[k])
    try:
        return cast("Message", kind(**kwargs))
    except TypeError as exc:  # a required field is missing
        raise ConfigError.invalid(str(name), dict(rec), f"a complete record ({exc})") from None


def decode(rec: Mapping[str, Any]) -> Message:
    """Rebuild the event or command of a record from :func:`encode` (no ``v``: version 1);
    ``ConfigError`` for anything else."""
    if not isinstance(rec, Mapping):
        raise ConfigError.invalid("record", rec, "a JSON object")
    version = rec.get("v", 1)
    if version != FORMAT_VERSION:
        raise ConfigError.invalid(
            "v", version, f"{FORMAT_VERSION}, the version this trainbus reads"
        )
    return _build(rec)


def dumps(message: Message) -> bytes:
    """One JSON line (UTF-8, ending in ``\\n``) of ``encode(message)``."""
    return (_ENCODER.encode(encode(message)) + "\n").encode()


def loads(line: bytes | str) -> Message:
    """The event or command of one JSON line (``ConfigError``: not JSON, or see :func:`decode`)."""
    try:
        rec = json.loads(line)
    except ValueError as exc:
        raise ConfigError.invalid("line", line[:200], f"one JSON object ({exc})") from None
    return decode(rec)

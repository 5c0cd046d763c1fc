"""The link protocol's vocabulary: the environment variables, the control records and the
handshake. Every end and transport of the link imports it; it imports none of them."""

from __future__ import annotations

import hmac
import json
import os
from typing import Any

from .. import _wire as wire
from .. import events as ev

__all__ = [
    "ADDR_ENV",
    "TOKEN_ENV",
    "check_hello",
    "control_record",
    "control_types",
    "event_types",
    "hello_record",
]

ADDR_ENV = "TRAINBUS_DRIVER_ADDR"  # where the driver is: host:port, or <scheme>:...
TOKEN_ENV = "TRAINBUS_DRIVER_TOKEN"  # the run's token


def control_record(kind: str, **fields: Any) -> bytes:
    """One control line (``hello``, ``welcome``, ``bye``, ``status``, ``wants``, ``streams``)."""
    return (json.dumps({"v": wire.FORMAT_VERSION, "type": kind, **fields}) + "\n").encode()


def hello_record(token: str, **fields: Any) -> bytes:
    """The connecting side's first line: the token, its rank and pid, and ``fields``."""
    return control_record("hello", token=token, rank=0, pid=os.getpid(), **fields)


def check_hello(hello: bytes, token: str) -> dict[str, Any] | None:
    """The hello record when ``hello`` is one carrying ``token`` (``hmac.compare_digest``),
    else None."""
    try:
        record = json.loads(hello)
    except ValueError:
        return None
    if not isinstance(record, dict) or record.get("type") != "hello":
        return None
    sent = record.get("token")
    if not isinstance(sent, str) or not hmac.compare_digest(sent.encode(), token.encode()):
        return None
    return record


def control_types(line: bytes, kind: str) -> tuple[type[ev.BaseEvent], ...] | None:
    """The event types a control line of ``kind`` names, or None: not such a record (empty:
    the other side refused)."""
    try:
        record = json.loads(line) if line else None
    except ValueError:
        return None
    if not isinstance(record, dict) or record.get("type") != kind:
        return None
    return event_types(record.get("events"))


def event_types(names: Any) -> tuple[type[ev.BaseEvent], ...]:
    """The event types ``names`` (a list) names, in ``EVENT_TYPES`` order; others dropped."""
    wanted = {n for n in names if isinstance(n, str)} if isinstance(names, list) else set()
    return tuple(t for t in ev.EVENT_TYPES if t.__name__ in wanted)

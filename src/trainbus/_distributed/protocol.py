"""The link protocol's shared vocabulary: where the driver is, the run's token, the control
records (``hello``, ``welcome``, ``bye``; for attachments ``status``, ``wants``, ``streams``)
and the two halves of the handshake. Every end and transport of the link imports it; it
imports none of them.

The side that connects sends ``hello`` with the token (:func:`hello_record`); the other checks
it (:func:`check_hello`) and answers ``welcome`` naming the event types that will flow
(:func:`control_types`), or closes. An attachment may later send ``wants {events}``; the job
answers ``streams {events}`` where the new set takes effect (:func:`control_types`).
"""

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

ADDR_ENV = "TRAINBUS_DRIVER_ADDR"
"""Environment variable holding where the driver is (``host:port``, or ``<scheme>:...``)."""
TOKEN_ENV = "TRAINBUS_DRIVER_TOKEN"
"""Environment variable holding the run's token."""


def control_record(kind: str, **fields: Any) -> bytes:
    """One control line of the link protocol (``hello``, ``welcome``, ``bye``, ``status``)."""
    return (json.dumps({"v": wire.FORMAT_VERSION, "type": kind, **fields}) + "\n").encode()


def hello_record(token: str, **fields: Any) -> bytes:
    """The connecting side's first line: the token, its rank and pid, and ``fields`` (an
    attachment names the event types it wants: ``events=[...]``)."""
    return control_record("hello", token=token, rank=0, pid=os.getpid(), **fields)


def check_hello(hello: bytes, token: str) -> dict[str, Any] | None:
    """The hello record when ``hello`` is one carrying ``token`` (compared with
    ``hmac.compare_digest``), else None (malformed, or a wrong token)."""
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
    """The event types a control line of ``kind`` (``welcome``, ``wants``, ``streams``)
    names, or None when ``line`` is not such a record (empty: the other side refused)."""
    try:
        record = json.loads(line) if line else None
    except ValueError:
        return None
    if not isinstance(record, dict) or record.get("type") != kind:
        return None
    return event_types(record.get("events"))


def event_types(names: Any) -> tuple[type[ev.BaseEvent], ...]:
    """The trainbus event types ``names`` (a list) names, in
    :data:`trainbus.events.EVENT_TYPES` order; unknown names are dropped."""
    wanted = {n for n in names if isinstance(n, str)} if isinstance(names, list) else set()
    return tuple(t for t in ev.EVENT_TYPES if t.__name__ in wanted)

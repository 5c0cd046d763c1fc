"""The link protocol's shared vocabulary: where the driver is, the run's token, and the three
control records (``hello``, ``welcome``, ``bye``). Both ends of the link
(:mod:`~trainbus.distributed.link`, :mod:`~trainbus.distributed.driver_link`) and every
transport (:mod:`~trainbus.distributed.socket_link`, :mod:`trainbus.ray`) import it, and it
imports none of them.
"""

from __future__ import annotations

import json
import os
from typing import Any

from .. import wire

__all__ = ["ADDR_ENV", "TOKEN_ENV", "control_record", "hello_record"]

ADDR_ENV = "TRAINBUS_DRIVER_ADDR"
"""Environment variable holding where the driver is (``host:port``, or ``<scheme>:...``)."""
TOKEN_ENV = "TRAINBUS_DRIVER_TOKEN"
"""Environment variable holding the run's token."""


def control_record(kind: str, **fields: Any) -> bytes:
    """One control line of the link protocol (``hello``, ``welcome``, ``bye``)."""
    return (json.dumps({"v": wire.FORMAT_VERSION, "type": kind, **fields}) + "\n").encode()


def hello_record(token: str) -> bytes:
    """The worker's first line: the token, its rank and pid."""
    return control_record("hello", token=token, rank=0, pid=os.getpid())

"""The same training function on a Ray cluster, with its events and commands at the driver.

Needs the ``ray`` extra (``pip install 'trainbus[ray]'``); without it, :func:`launch` and
:class:`RayLauncher` raise :class:`~trainbus.MissingExtraError`. See docs/distributed.md
("Ray: trainbus.ray") for an example.
"""

from __future__ import annotations

from .._distributed.link import WorkerTransport, register_transport
from ._launcher import RayLauncher as RayLauncher
from ._launcher import RayLaunchResult as RayLaunchResult
from ._launcher import launch as launch
from ._report import ReportToRay as ReportToRay

__all__ = ["RayLaunchResult", "RayLauncher", "ReportToRay", "launch"]


def _transport(address: str, timeout: float) -> WorkerTransport:
    from ._transport import RayTransport  # imports ray: only where a Ray driver linked

    return RayTransport(address, timeout)


register_transport("ray", _transport)

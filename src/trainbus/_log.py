"""Library-style logging: through structlog when the application configured it, else through
the standard library's :mod:`logging` under the module's name (warnings and errors by default),
decided at each call; a library never configures structlog."""

from __future__ import annotations

import logging
from typing import Any

import structlog

__all__ = ["get_logger", "worth_logging"]

_KEY_VALUES = structlog.processors.KeyValueRenderer(key_order=["event"], sort_keys=True)


def _render(logger: Any, method: str, event_dict: dict[str, Any]) -> str:
    """``key=value`` pairs on one line, then a traceback or stack as Python prints them."""
    below = [event_dict.pop(key) for key in ("stack", "exception") if key in event_dict]
    return "\n".join([_KEY_VALUES(logger, method, event_dict), *below])


_STDLIB_PROCESSORS: list[Any] = [
    structlog.stdlib.filter_by_level,  # first: a filtered call builds nothing
    structlog.stdlib.add_log_level,
    structlog.processors.StackInfoRenderer(),
    structlog.processors.format_exc_info,
    _render,
]


class LibraryLogger:
    """A logger proxy: the application's structlog setup if any, else stdlib ``logging``, chosen
    at each call (so configuring structlog later still takes effect)."""

    __slots__ = ("_fallback", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self._fallback: Any = None

    def _target(self) -> Any:
        if structlog.is_configured():
            return structlog.get_logger(self.name)
        if self._fallback is None:
            self._fallback = structlog.wrap_logger(
                logging.getLogger(self.name),
                processors=_STDLIB_PROCESSORS,
                wrapper_class=structlog.stdlib.BoundLogger,
            )
        return self._fallback

    def debug(self, event: str, **kw: Any) -> None:
        self._target().debug(event, **kw)

    def info(self, event: str, **kw: Any) -> None:
        self._target().info(event, **kw)

    def warning(self, event: str, **kw: Any) -> None:
        self._target().warning(event, **kw)

    def error(self, event: str, **kw: Any) -> None:
        self._target().error(event, **kw)


def get_logger(name: str) -> LibraryLogger:
    """The logger trainbus modules use (``log = get_logger(__name__)``); ``name`` is also the
    stdlib logger's when structlog is unconfigured."""
    return LibraryLogger(name)


def worth_logging(count: int, first: int = 1) -> bool:
    """Whether the ``count``-th repeat of a failure is logged: the first ``first`` of them, then
    the 10th, 100th, 1000th, ..."""
    return count <= first or (count >= 10 and count == 10 ** (len(str(count)) - 1))

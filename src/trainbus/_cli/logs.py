"""How the command line logs: structlog to stderr (through ``tqdm.write`` when installed, so a
progress bar stays intact), console lines for humans or JSON lines."""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["configure_logging"]


class _StderrLogger:
    """A structlog logger writing each rendered line to the current ``sys.stderr``."""

    def __init__(self) -> None:
        try:
            from tqdm import tqdm
        except ImportError:
            self._tqdm_write: Any = None
        else:
            self._tqdm_write = tqdm.write

    def msg(self, message: str) -> None:
        if self._tqdm_write is not None:  # clears and redraws active bars around the line
            self._tqdm_write(message, file=sys.stderr)
        else:
            sys.stderr.write(message + "\n")
            sys.stderr.flush()

    log = debug = info = warn = warning = error = critical = exception = fatal = failure = msg


def _round_floats(_: Any, __: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    return {k: (float(f"{v:.4g}") if isinstance(v, float) else v) for k, v in event_dict.items()}


def configure_logging(*, json_logs: bool) -> None:
    """Configure structlog for the CLI: console lines for humans, or JSON lines."""
    import structlog

    p = structlog.processors
    rendering: list[Any] = (
        [p.TimeStamper(fmt="iso", utc=True), p.dict_tracebacks, p.JSONRenderer()]
        if json_logs
        else [
            p.TimeStamper(fmt="%H:%M:%S", utc=False),
            _round_floats,
            structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty()),
        ]
    )
    structlog.configure(
        processors=[structlog.contextvars.merge_contextvars, p.add_log_level, *rendering],
        logger_factory=lambda *args: _StderrLogger(),
        wrapper_class=structlog.make_filtering_bound_logger(20),  # INFO and above
        cache_logger_on_first_use=False,
    )

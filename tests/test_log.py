"""trainbus logs like a library: silent below warning unless the application asks for more."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest
import structlog

from trainbus._log import get_logger

_RUN = textwrap.dedent(
    """
    import logging, sys
    from trainbus import Trainer
    from trainbus.testing import tiny_loader, tiny_model
    import torch

    if sys.argv[1] == "stdlib-debug":
        logging.basicConfig(level=logging.DEBUG, stream=sys.stderr)
    model = tiny_model()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_loader(),
                      loss_fn=torch.nn.functional.cross_entropy,
                      max_steps=3)
    result = trainer.fit_sync()
    assert result.reason == "completed", result
    """
)


def _run(mode: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _RUN, mode], capture_output=True, text=True, timeout=60
    )


@pytest.mark.slow
def test_unconfigured_application_sees_nothing_below_warning() -> None:
    done = _run("plain")
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""
    assert "fit_ended" not in done.stderr
    assert "debug" not in done.stderr.lower()


@pytest.mark.slow
def test_stdlib_logging_at_debug_shows_trainbus_lines() -> None:
    done = _run("stdlib-debug")
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""
    assert "fit_ended" in done.stderr  # routed through the stdlib logger of the module


@pytest.fixture
def structlog_unconfigured() -> Iterator[None]:
    """structlog as an application that never configured it finds it (another test, or a docs
    page, may have configured it in this process); the configuration is restored after."""
    configured, saved = structlog.is_configured(), structlog.get_config()
    structlog.reset_defaults()
    yield
    if configured:
        structlog.configure(**saved)


@pytest.mark.usefixtures("structlog_unconfigured")
def test_a_traceback_prints_as_python_prints_it(caplog: pytest.LogCaptureFixture) -> None:
    """Through the standard library (structlog unconfigured), the ``key=value`` line comes
    first and the traceback follows on its own lines, not as one escaped string."""
    assert not structlog.is_configured()
    try:
        raise RuntimeError("boom")
    except RuntimeError as exc:
        error = exc
    with caplog.at_level(logging.ERROR, logger="trainbus.tests.traceback"):
        get_logger("trainbus.tests.traceback").error(
            "subscriber_failed", subscription="s", exc_info=error
        )
    (record,) = caplog.records
    first, *below = record.getMessage().splitlines()
    assert first == "event='subscriber_failed' level='error' subscription='s'"
    assert below[0] == "Traceback (most recent call last):"
    assert below[-1] == "RuntimeError: boom"

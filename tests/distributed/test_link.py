"""WorkerLink's configuration and connection errors (its streaming is tested end to end in
test_launcher.py)."""

from __future__ import annotations

import pytest

from trainbus import ConfigError, LaunchError
from trainbus._distributed.link import WorkerLink
from trainbus._distributed.protocol import ADDR_ENV, TOKEN_ENV

from ._torchrun import free_port


def test_not_launched_means_no_link() -> None:
    assert WorkerLink.from_env({}) is None


@pytest.mark.parametrize(
    ("environ", "field"),
    [
        ({ADDR_ENV: "127.0.0.1:5000"}, TOKEN_ENV),
        ({TOKEN_ENV: "t"}, ADDR_ENV),
        ({ADDR_ENV: "10.0.0.7:5000", TOKEN_ENV: "t"}, ADDR_ENV),  # loopback only
        ({ADDR_ENV: "127.0.0.1", TOKEN_ENV: "t"}, ADDR_ENV),
    ],
)
def test_bad_link_variables_name_the_variable(environ: dict[str, str], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        WorkerLink.from_env(environ)


def test_an_unreachable_driver_is_a_launch_error() -> None:
    link = WorkerLink.from_env({ADDR_ENV: f"127.0.0.1:{free_port()}", TOKEN_ENV: "t"}, timeout=2)
    assert link is not None
    with pytest.raises(LaunchError, match="cannot reach the trainbus driver"):
        link.connect()
    link.close()  # nothing to close: idempotent


@pytest.mark.asyncio
async def test_the_driver_end_refuses_what_is_not_an_event_and_goes_on() -> None:
    import structlog

    from trainbus import EventBus
    from trainbus import _wire as wire
    from trainbus import commands as cmd
    from trainbus import events as ev
    from trainbus._distributed.driver_link import DriverLink

    bus = EventBus()
    link = DriverLink(bus, "t")
    assert link.greet(b'{"v":1,"type":"hello","token":"t","rank":0}', "test") is not None
    step = ev.StepEnded(step=1, epoch=0, loss=0.5, lr=0.1, grad_norm=None, samples=4,
                        duration_s=0.1)  # fmt: skip
    data = b"".join([b"not json\n", wire.dumps(cmd.StopTraining(reason="x")),
                     b'{"v":9,"type":"StepEnded"}\n', wire.dumps(step)])  # fmt: skip
    with structlog.testing.capture_logs() as logs:
        link.receive(data)
    assert [e["event"] for e in logs] == ["driver_record_refused"] * 3
    assert link.received == 1 and link.last_event == step  # the good one still arrived
    link.receive(b'{"v":1,"type":"bye","sent":1}\n')
    assert link.unlinked

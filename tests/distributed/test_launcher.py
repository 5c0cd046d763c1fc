"""The launcher end to end: torchrun workers (tests/distributed/scripts/link_worker.py) stream
rank 0's events to the driver's bus, the driver's commands stop them, failures are clear."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import structlog

from trainbus import Callback, ConfigError, EventBus, Launcher, LaunchError
from trainbus import commands as cmd
from trainbus import events as ev

from ._torchrun import SCRIPTS

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("src_on_path")]


def read(out: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]


def worker(out: Path, mode: str, steps: int = 40, nproc: int = 2, **kw: Any) -> Launcher:
    return Launcher(SCRIPTS / "link_worker.py", str(out), mode, str(steps),
                    nproc_per_node=nproc, on_signal=None, **kw)  # fmt: skip


@pytest.mark.asyncio
async def test_every_event_reaches_the_driver_in_order_and_a_driver_stop_stops_both(
    tmp_path: Path,
) -> None:
    counter = Counter()
    launcher = worker(tmp_path, "run", callbacks=[counter])
    bus = launcher.bus
    received: list[ev.BaseEvent] = []
    answers: list[ev.BaseEvent] = []
    bus.events.subscribe(received.append)

    async def stop_at_5(e: ev.StepEnded) -> None:  # an async subscriber using request()
        answers.append(await bus.request(cmd.StopTraining(reason="driver")))

    bus.subscribe_async(bus.stream(ev.StepEnded).pipe(_step(5)), stop_at_5)
    result = await launcher.launch()
    types = [type(e).__name__ for e in received]
    assert types[0] == "FitStarted" and types[-1] == "FitEnded"
    steps = [e.step for e in received if isinstance(e, ev.StepEnded)]
    assert steps == list(range(1, len(steps) + 1))  # every step, in order
    assert counter.steps == steps  # a class callback's async on_step_ended ran in the driver
    assert float(received[1].loss) == 1.0  # type: ignore[attr-defined]  # tensors as numbers
    ended = received[-1]
    assert isinstance(ended, ev.FitEnded) and ended.reason == "stopped"
    assert ended.stop_reason == "driver" and ended.step < 40
    assert len(answers) == 1 and isinstance(answers[0], ev.CommandApplied)  # request() resolved
    ranks = read(tmp_path)
    assert [r["stop_step"] for r in ranks] == [ended.step, ended.step]  # both ranks, same step
    assert ranks[0]["sent"] == len(received) == result.received
    assert result.events == tuple(received)[-100:] and result.last_event is received[-1]
    assert result.stop_reason == "driver"  # the workers' own reason, from their FitEnded
    assert result.returncode == 0 and result.last_event == ended


@pytest.mark.asyncio
@pytest.mark.parametrize("on_signal", ["return", "raise"])
async def test_a_sigint_on_the_driver_stops_the_workers_then_returns_or_raises(
    tmp_path: Path, on_signal: Any
) -> None:
    launcher = Launcher(SCRIPTS / "link_worker.py", str(tmp_path), "run", "400",
                        nproc_per_node=1, on_signal=on_signal)  # fmt: skip
    bus = launcher.bus
    bus.subscribe(bus.stream(ev.StepEnded).pipe(_step(3)),
                  lambda e: signal.raise_signal(signal.SIGINT))  # fmt: skip
    if on_signal == "raise":
        with pytest.raises(KeyboardInterrupt) as info:
            await launcher.launch()
        assert "SIGINT stopped the workers gracefully" in str(info.value.__notes__)
    else:
        result = await launcher.launch()
        assert result.signal == signal.SIGINT and result.stop_reason == "signal"
    assert launcher.stop_reason == "signal"
    assert read(tmp_path)[0]["stop_step"] < 400  # stopped gracefully, not run to the end


def _step(n: int) -> Any:
    from reactivex import operators as ops

    return ops.filter(lambda e: e.step == n)


@pytest.mark.asyncio
async def test_a_killed_worker_ends_the_launch_with_a_clear_error(tmp_path: Path) -> None:
    launcher = worker(tmp_path, "die", nproc=1)
    launcher.bus.stream(ev.StepEnded).subscribe(lambda e: None)  # per-step events: wanted
    with pytest.raises(LaunchError, match="torchrun exited with code 1 after") as info:
        await launcher.launch()
    err = info.value
    assert err.returncode == 1
    steps = [e.step for e in err.events if isinstance(e, ev.StepEnded)]
    assert isinstance(err.events[0], ev.FitStarted)  # the events that arrived before it died
    assert steps == [1, 2, 3, 4, 5]
    assert "StepEnded at step 5" in str(err)
    assert "rank 0 exited with code -9 (SIGKILL)" in str(err)


@pytest.mark.asyncio
async def test_the_killed_rank_is_named_with_its_own_exit_code_and_signal(tmp_path: Path) -> None:
    # Rank 1 SIGKILLs itself; torchrun then SIGTERMs rank 0. The error blames rank 1 with -9,
    # never rank 1 with rank 0's -15 (what pairing the nearest "exitcode" used to report).
    launcher = worker(tmp_path, "die1")
    with pytest.raises(LaunchError) as info:
        await launcher.launch()
    err = info.value
    assert err.rank == 1 and err.rank_exitcode == -9 and err.rank_signal == "SIGKILL"
    message = str(err).split("; stderr tail:")[0]
    assert "rank 1 exited with code -9 (SIGKILL)" in message
    assert "rank 1 exited with code -15" not in message
    # What the others did comes after, each rank with its own code.
    assert "then rank 0 exited with code -15 (SIGTERM)" in message
    assert err.received == len(err.events) > 0 and err.last_event is err.events[-1]
    assert err.stop_reason is None


@pytest.mark.asyncio
async def test_a_script_that_fails_to_import_is_a_clear_error(tmp_path: Path) -> None:
    launcher = Launcher(SCRIPTS / "broken_import.py", on_signal=None)
    with pytest.raises(LaunchError, match="before rank 0 linked") as info:
        await launcher.launch()
    assert "trainbus_no_such_module" in info.value.stderr


@pytest.mark.asyncio
async def test_a_connection_without_the_token_is_refused_and_logged(tmp_path: Path) -> None:
    launcher = worker(tmp_path, "token", steps=4, nproc=1)
    with structlog.testing.capture_logs() as logs:
        result = await launcher.launch()
    (rank0,) = read(tmp_path)
    assert "refused this worker's link" in rank0["impostor"]
    assert launcher.refused == 1 and result.received == rank0["sent"] > 0
    refused = [entry for entry in logs if entry["event"] == "driver_connection_refused"]
    assert len(refused) == 1 and refused[0]["reason"] == "wrong token"


@pytest.mark.asyncio
async def test_a_driver_subscriber_that_raises_stops_the_workers(tmp_path: Path) -> None:
    launcher = worker(tmp_path, "run", steps=3000, nproc=1)

    def boom(e: ev.StepEnded) -> None:
        if e.step == 3:
            raise RuntimeError("driver-side bug")

    launcher.bus.stream(ev.StepEnded).subscribe(boom, on_error="raise")
    with pytest.raises(RuntimeError, match="driver-side bug"):
        await launcher.launch()
    (rank0,) = read(tmp_path)
    assert rank0["reason"] == "stopped" and rank0["stop_step"] < 3000  # stopped, not killed


class Counter(Callback):
    def __init__(self) -> None:
        self.steps: list[int] = []

    async def on_step_ended(self, e: ev.StepEnded) -> None:
        self.steps.append(e.step)


class WithHook(Callback):
    def hook_loss(self, ctx: Any) -> None:
        pass


def test_callbacks_subscribe_their_methods_and_hooks_are_refused() -> None:
    counter = Counter()
    launcher = Launcher(SCRIPTS / "link_worker.py", callbacks=[counter])
    assert launcher.bus.wants(ev.StepEnded)  # so rank 0 will stream StepEnded
    with pytest.raises(ConfigError, match="hook_loss"):
        Launcher(SCRIPTS / "link_worker.py", callbacks=[WithHook])


@pytest.mark.asyncio
async def test_a_missing_interpreter_is_a_launch_error(tmp_path: Path) -> None:
    launcher = Launcher(SCRIPTS / "link_worker.py", python=str(tmp_path / "no-python"),
                        on_signal=None)  # fmt: skip
    with pytest.raises(LaunchError, match="cannot start torchrun"):
        await launcher.launch()


def test_bad_arguments_name_the_argument(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="script"):
        Launcher(tmp_path / "missing.py")
    with pytest.raises(ConfigError, match="nproc_per_node"):
        Launcher(SCRIPTS / "link_worker.py", nproc_per_node=0)
    with pytest.raises(ConfigError, match="torchrun_args"):
        Launcher(SCRIPTS / "link_worker.py", torchrun_args="--standalone")  # type: ignore[arg-type]


def test_on_signal_is_spelt_as_the_trainers() -> None:
    assert Launcher(SCRIPTS / "link_worker.py").on_signal == "return"
    assert Launcher(SCRIPTS / "link_worker.py", on_signal="raise").on_signal == "raise"
    with pytest.raises(ConfigError, match="on_signal='stop' is invalid"):
        Launcher(SCRIPTS / "link_worker.py", on_signal="stop")  # type: ignore[arg-type]


def test_handle_signals_is_a_type_error_naming_on_signal() -> None:
    with pytest.raises(TypeError) as info:
        Launcher(SCRIPTS / "link_worker.py", handle_signals=False)  # type: ignore[call-arg]
    assert str(info.value) == (
        "Launcher() got an unexpected keyword argument 'handle_signals': on_signal=None "
        "(no handler)"
    )


def test_the_command_line_adds_standalone_unless_addressed() -> None:
    plain = Launcher(SCRIPTS / "link_worker.py", "a", nproc_per_node=2, bus=EventBus())
    assert plain.command_line()[2:5] == ["torch.distributed.run", "--standalone",
                                         "--nproc_per_node=2"]  # fmt: skip
    assert plain.command_line()[-1] == "a"
    addressed = Launcher(SCRIPTS / "link_worker.py", torchrun_args=["--master_port=29511"])
    assert "--standalone" not in addressed.command_line()
    assert os.fspath(SCRIPTS / "link_worker.py") in addressed.command_line()


def test_launch_result_and_launch_error_share_their_fields_by_name_and_type() -> None:
    import dataclasses
    import inspect

    from trainbus import LaunchResult

    error_params = inspect.signature(LaunchError.__init__).parameters
    for field in dataclasses.fields(LaunchResult):
        assert field.name in error_params, field.name
        if field.name == "returncode":
            continue  # int on a result (0), None too on an error (torchrun never started)
        # The exception module imports no events: an event is an object there, and an
        # Ending (a StrEnum) a str.
        result_type = str(field.type).replace("ev.BaseEvent", "object")
        result_type = result_type.replace("ev.Ending", "str")
        assert result_type == str(error_params[field.name].annotation), field.name
    err = LaunchError("x", events=(1, 2), received=5, last_event=2, stop_reason="driver")
    assert (err.events, err.received, err.last_event, err.stop_reason) == ((1, 2), 5, 2, "driver")

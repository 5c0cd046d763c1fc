"""SIGINT/SIGTERM stop a run cleanly (final checkpoint), then the interrupt reaches the caller
(KeyboardInterrupt, SystemExit(143)) unless on_signal="return"; a second SIGINT aborts.

Each test runs a real training script in a subprocess, waits for its READY line (printed by a
subscriber after the first StepEnded), then signals it. Timeouts are deadlock guards only.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals and process groups"),
]

GUARD_S = 60.0  # generous: only a hung process gets anywhere near it

SCRIPT = textwrap.dedent(
    """
    import sys
    import time

    import torch
    import torch.nn.functional as F

    from trainbus import Trainer
    from trainbus import events as ev
    from trainbus.testing import tiny_loader

    mode, ckpt = sys.argv[1], sys.argv[2]
    pace = {"sleep": 0.01}
    ready = []


    class Slow(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(32, 10)

        def forward(self, x):
            if pace["sleep"] > 1 and not ready:
                # slow mode: READY once the slow forward has begun (the training thread says
                # it: the first signal then lands mid-step, wherever the event loop is).
                ready.append(0)
                print("READY", flush=True)
            time.sleep(pace["sleep"])
            return self.lin(x)


    model = Slow()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), tiny_loader(4, 8),
                      loss_fn=F.cross_entropy, max_steps=1_000_000, checkpoint_dir=ckpt)
    bus = trainer.bus


    def on_step(event):
        if mode == "counted":
            print("STEP", event.step, flush=True)
        if mode != "slow" and not ready:
            ready.append(event.step)
            print("READY", flush=True)


    bus.subscribe(bus.stream(ev.StepEnded), on_step)
    bus.subscribe(bus.stream(ev.FitEnded),
                  lambda e: print("FITENDED", e.reason, e.stop_reason, flush=True))
    if mode == "slow":
        # After the first step, each step takes long: a second signal lands mid-step.
        def slow_down(ctx):
            pace["sleep"] = 2.0

        trainer.add_hook("after_optimizer_step", slow_down)
    if mode == "uncaught":  # the interrupt as Python delivers it: nothing catches it
        trainer.fit_sync()
    try:
        result = trainer.fit_sync()
    except (KeyboardInterrupt, SystemExit) as exc:
        print("RAISED", type(exc).__name__, getattr(exc, "code", None), flush=True)
        if trainer.result is None or trainer.result.reason == "cancelled":
            raise  # aborted by a second SIGINT
        result = trainer.result
    print("RESULT", result.reason, result.stop_reason, result.last_checkpoint, result.ending,
          flush=True)
    """
)


# What a shell does for a script's background job (`python train.py &`): SIGINT ignored, then
# the program started (an ignored signal stays ignored across exec).
IGNORING_SIGINT = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
    "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
)


class Proc:
    def __init__(self, tmp_path: Path, mode: str, *, sigint_ignored: bool = False) -> None:
        script = tmp_path / "train.py"
        script.write_text(SCRIPT)
        self.ckpt = tmp_path / "ckpt"
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        start = [sys.executable, "-c", IGNORING_SIGINT] if sigint_ignored else [sys.executable]
        self.popen = subprocess.Popen(
            [*start, str(script), mode, str(self.ckpt)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.output: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        with self.popen.stdout:
            for line in self.popen.stdout:
                self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def wait_for(self, text: str) -> None:
        while True:
            try:
                line = self.lines.get(timeout=GUARD_S)
            except queue.Empty:
                self.kill()
                pytest.fail(f"no {text!r} line; output so far:\n" + "\n".join(self.output))
            if line is None:
                pytest.fail(f"exited before {text!r}:\n" + "\n".join(self.output))
            self.output.append(line)
            if line.strip() == text:
                return

    def wait_for_prefix(self, prefix: str) -> str:
        while True:
            try:
                line = self.lines.get(timeout=GUARD_S)
            except queue.Empty:
                self.kill()
                pytest.fail(f"no {prefix!r} line; output so far:\n" + "\n".join(self.output))
            if line is None:
                pytest.fail(f"exited before {prefix!r}:\n" + "\n".join(self.output))
            self.output.append(line)
            if line.startswith(prefix + " "):
                return line

    def wait_for_file(self, folder: Path, suffix: str) -> Path:
        """Poll ``folder`` (reading output meanwhile) until a file ending in ``suffix``."""
        for _ in range(int(GUARD_S / 0.05)):
            found = sorted(folder.glob(f"*{suffix}")) if folder.is_dir() else []
            if found:
                while not self.lines.empty():
                    line = self.lines.get_nowait()
                    if line is not None:
                        self.output.append(line)
                return found[0]
            try:
                line = self.lines.get(timeout=0.05)
            except queue.Empty:
                continue
            if line is None:
                pytest.fail(f"exited before a *{suffix} file:\n" + "\n".join(self.output))
            self.output.append(line)
        self.kill()
        pytest.fail(f"no *{suffix} file in {folder}:\n" + "\n".join(self.output))

    def finish(self) -> tuple[int, list[str]]:
        try:
            code = self.popen.wait(timeout=GUARD_S)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail("the process did not exit:\n" + "\n".join(self.output))
        self.reader.join(timeout=GUARD_S)
        while True:
            line = self.lines.get_nowait() if not self.lines.empty() else None
            if line is None:
                break
            self.output.append(line)
        return code, self.output

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait()
        self.reader.join(timeout=GUARD_S)  # the reader closes stdout at EOF


@pytest.fixture
def proc_factory(tmp_path: Path):  # type: ignore[no-untyped-def]
    procs: list[Proc] = []

    def make(mode: str) -> Proc:
        p = Proc(tmp_path, mode)
        procs.append(p)
        return p

    yield make
    for p in procs:
        p.kill()


def _line(output: list[str], prefix: str) -> list[str]:
    found = [line.split() for line in output if line.startswith(prefix + " ")]
    assert len(found) == 1, "\n".join(output)
    return found[0]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_one_signal_stops_cleanly_with_a_final_checkpoint(proc_factory, signum: int) -> None:  # type: ignore[no-untyped-def]
    proc = proc_factory("fast")
    proc.wait_for("READY")
    proc.popen.send_signal(signum)
    code, output = proc.finish()
    text = "\n".join(output)
    assert code == 0, text
    assert _line(output, "FITENDED")[1:] == ["stopped", "signal"]
    # After the graceful stop the interrupt reached the caller (on_signal="raise").
    expected = (["KeyboardInterrupt", "None"] if signum == signal.SIGINT
                else ["SystemExit", str(128 + signal.SIGTERM)])  # fmt: skip
    assert _line(output, "RAISED")[1:] == expected, text
    result = _line(output, "RESULT")
    assert result[1:3] == ["stopped", "signal"] and result[4] == "signal"
    final = Path(result[3])
    assert final.parent == proc.ckpt and final.is_file(), text
    assert final.name.startswith("step-") and final.name.endswith("-final.pt")
    assert not any(p.name.endswith(".tmp") for p in proc.ckpt.iterdir())


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_an_uncaught_interrupt_ends_the_process_as_the_signal_would(  # type: ignore[no-untyped-def]
    proc_factory, signum: int
) -> None:
    proc = proc_factory("uncaught")
    proc.wait_for("READY")
    proc.popen.send_signal(signum)
    code, output = proc.finish()
    text = "\n".join(output)
    assert _line(output, "FITENDED")[1:] == ["stopped", "signal"], text
    assert not any(line.startswith("RESULT ") for line in output), text
    # The final checkpoint was written before the interrupt went on.
    assert any(p.name.endswith("-final.pt") for p in proc.ckpt.iterdir()), text
    if signum == signal.SIGTERM:
        assert code == 128 + signal.SIGTERM, text  # SystemExit(143): a SIGTERM'd process' status
    else:
        # An uncaught KeyboardInterrupt: Python ends the process by SIGINT (-2) after the
        # traceback, as for any program on Ctrl-C.
        assert code == -signal.SIGINT and "KeyboardInterrupt" in text, text


def test_a_sigint_the_process_ignores_stays_ignored(tmp_path: Path) -> None:
    """Started as a script's background job (SIGINT ignored), the run trains on through a
    SIGINT, as any program would; SIGTERM still stops it gracefully."""
    proc = Proc(tmp_path, "counted", sigint_ignored=True)
    proc.wait_for("READY")
    proc.popen.send_signal(signal.SIGINT)
    # Handled, the SIGINT would have stopped the run at the next step (a step is ~10 ms).
    proc.wait_for("STEP 100")
    proc.popen.send_signal(signal.SIGTERM)
    code, output = proc.finish()
    text = "\n".join(output)
    assert code == 0, text  # SystemExit(143) caught by the script, which printed its result
    assert _line(output, "RESULT")[1:3] == ["stopped", "signal"], text
    assert "signal='SIGTERM'" in text and "signal='SIGINT'" not in text, text
    steps = [int(line.split()[1]) for line in output if line.startswith("STEP ")]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 100, text


def test_second_sigint_aborts(proc_factory) -> None:  # type: ignore[no-untyped-def]
    proc = proc_factory("slow")
    proc.wait_for("READY")  # step 2's forward (2 s) is under way
    proc.popen.send_signal(signal.SIGINT)
    # The first signal's StopTraining waits for the end of the step; the second must not.
    threading.Event().wait(0.2)
    proc.popen.send_signal(signal.SIGINT)
    code, output = proc.finish()  # returns well before GUARD_S, or fails the test
    text = "\n".join(output)
    assert code != 0, text
    assert _line(output, "FITENDED")[1] == "cancelled", text
    assert not any(line.startswith("RESULT ") for line in output), text
    assert "KeyboardInterrupt" in text
    # The abort's own traceback, not the portal's event loop shutting down around it.
    assert "unhandled exception during asyncio.run() shutdown" not in text, text
    assert "ExceptionGroup" not in text, text


BLOCKING_SCRIPT = textwrap.dedent(
    """
    import sys
    import time

    import anyio
    import torch
    import torch.nn.functional as F

    from trainbus import Trainer
    from trainbus import events as ev
    from trainbus.testing import tiny_loader

    mode, ckpt = sys.argv[1], sys.argv[2]


    class Paced(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(32, 10)

        def forward(self, x):
            time.sleep(0.05)
            return self.lin(x)


    model = Paced()
    # One long epoch: no epoch-end barrier waits for the blocked event loop meanwhile.
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01),
                      tiny_loader(100_000, 2), loss_fn=F.cross_entropy, max_steps=100_000,
                      checkpoint_dir=ckpt, progress=False, on_signal="return")
    blocked = []


    def block(event):
        # A sync subscriber that blocks the event-loop thread for 30 s, once.
        if not blocked:
            blocked.append(event.step)
            print("BLOCKING", event.step, flush=True)
            time.sleep(30)
            print("WOKE", flush=True)


    trainer.bus.subscribe(trainer.bus.stream(ev.StepEnded), block)
    trainer.bus.subscribe(trainer.bus.stream(ev.FitEnded),
                          lambda e: print("FITENDED", e.reason, e.stop_reason, flush=True))
    # The training thread says where it is, whatever the event loop does.
    trainer.add_hook("after_optimizer_step", lambda ctx: print("STEP", ctx.step, flush=True))
    if mode == "sync":
        result = trainer.fit_sync()          # the event loop runs in a portal thread
    else:
        async def main():
            return await trainer.fit()  # the event loop runs on the main thread itself
        result = anyio.run(main)
    print("RESULT", result.reason, result.stop_reason, result.last_checkpoint, flush=True)
    """
)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_sigint_stops_training_at_the_next_step_while_a_sync_subscriber_blocks(
    tmp_path: Path, mode: str
) -> None:
    script = tmp_path / "blocked.py"
    script.write_text(BLOCKING_SCRIPT)
    ckpt = tmp_path / "ckpt"
    proc = Proc.__new__(Proc)  # the same reader, on another script
    proc.ckpt = ckpt
    proc.popen = subprocess.Popen(
        [sys.executable, str(script), mode, str(ckpt)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    proc.lines = queue.Queue()
    proc.output = []
    proc.reader = threading.Thread(target=proc._read, daemon=True)
    proc.reader.start()
    try:
        proc.wait_for_prefix("BLOCKING")
        # Training goes on while the subscriber blocks: wait for a step after it.
        seen = int(proc.wait_for_prefix("STEP").split()[1])
        proc.popen.send_signal(signal.SIGINT)
        # The final checkpoint is written while the subscriber still sleeps.
        final = proc.wait_for_file(ckpt, "-final.pt")
        assert not any(line == "WOKE" for line in proc.output), "\n".join(proc.output)
        step = int(final.name.split("-")[1])
        # Stopped at the next step: the signal came after step `seen`; a few steps may have
        # been under way between the line and the signal (pipe lag), never thousands.
        assert seen <= step <= seen + 5, (seen, step, "\n".join(proc.output))
        code, output = proc.finish()
    finally:
        proc.kill()
    text = "\n".join(output)
    assert code == 0, text
    assert "WOKE" in output, text  # the blocked subscriber ran to its end, then fit() returned
    assert _line(output, "FITENDED")[1:] == ["stopped", "signal"]
    result = _line(output, "RESULT")
    assert result[1:3] == ["stopped", "signal"] and Path(result[3]) == final


def test_the_drivers_and_the_trainer_take_over_only_the_signals_not_ignored() -> None:
    """`not_ignored` is what `fit()`'s handler and the launch drivers' signal receivers use."""
    from trainbus._signals import STOP_SIGNALS, not_ignored

    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        assert not_ignored() == STOP_SIGNALS == (signal.SIGINT, signal.SIGTERM)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        assert not_ignored() == (signal.SIGTERM,)
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


# A Ctrl-C while a call's end waits for async subscribers cancels their pending work.
#
# By default the end of ``fit()`` waits up to ``close_timeout`` (300 s) for async subscribers,
# with a ``bus_close_waiting`` notice. A real subprocess runs a short fit whose async subscriber
# never finishes an item; once the notice is printed, the test sends SIGINT: the pending items
# are cancelled, counted as lost work in ``FitResult.lost_work``, and the process ends normally.


AT_END_GUARD_S = 60.0  # a deadlock guard only


AT_END_SCRIPT = textwrap.dedent(
    """
    import anyio
    import structlog
    import torch
    import torch.nn.functional as F

    from trainbus import Trainer
    from trainbus import events as ev
    from trainbus.testing import tiny_loader, tiny_model


    def announce(logger, method, event_dict):
        if event_dict.get("event") == "bus_close_waiting":
            print("WAITING", sorted(event_dict["pending"].items()), flush=True)
        return event_dict


    structlog.configure(processors=[announce, structlog.processors.KeyValueRenderer()])

    model = tiny_model()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_loader(6, 8),
                      loss_fn=F.cross_entropy, max_steps=6, progress=False)


    async def hang(event):
        await anyio.sleep_forever()  # a service that never answers


    trainer.bus.subscribe_async(trainer.bus.stream(ev.StepEnded), hang, name="hang",
                                buffer=100)
    result = trainer.fit_sync()
    print("RESULT", result.reason, result.steps, result.lost_work["hang"].cancelled,
          sum(x.total for x in result.lost_work.values()), flush=True)
    """
)


def test_ctrl_c_while_a_call_end_waits_cancels_the_pending_work(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(AT_END_SCRIPT)
    output: list[str] = []
    with subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    ) as proc:
        guard = threading.Timer(AT_END_GUARD_S, proc.kill)
        guard.start()
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                output.append(line.rstrip("\n"))
                if line.startswith("WAITING"):
                    # Training is over (6 steps) and the call's end waits for "hang".
                    proc.send_signal(signal.SIGINT)
            code = proc.wait()
        finally:
            guard.cancel()
    text = "\n".join(output)
    assert code == 0, text
    waiting = [x for x in output if x.startswith("WAITING")]
    assert waiting == ["WAITING [('hang', 6)]"], text  # one notice, naming who and how much
    assert "cancel pending async work" in text, text
    (result,) = [x.split() for x in output if x.startswith("RESULT")]
    # Completed training; the six items it held (one running, five queued) cancelled and lost.
    assert result == ["RESULT", "completed", "6", "6", "6"], text


# One Ctrl-C is one Ctrl-C with DataLoader workers.
#
# A terminal sends SIGINT to the whole foreground process group: the training process and its
# DataLoader workers. The run must stop as for one SIGINT (a final checkpoint, a normal exit),
# whether the workers were forked (they would run a copy of trainbus' handler) or spawned (they
# would raise KeyboardInterrupt, exit, and fail the batch the loop waits for). Each test runs a
# real training script in its own session, waits for its READY line, then signals the group
# once. Timeouts are deadlock guards only.


WORKERS_GUARD_S = 90.0


WORKERS_SCRIPT = textwrap.dedent(
    """
    import sys
    import time

    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, Dataset

    from trainbus import Trainer
    from trainbus import events as ev


    class SlowData(Dataset):
        # Slow items: the loop spends its time waiting for the workers' next batch, which is
        # where a worker that died of the Ctrl-C fails the run.
        def __len__(self):
            return 100_000

        def __getitem__(self, i):
            time.sleep(0.02)
            g = torch.Generator().manual_seed(i)
            return torch.randn(8, generator=g), i % 3


    if __name__ == "__main__":
        method, ckpt = sys.argv[1], sys.argv[2]
        loader = DataLoader(SlowData(), batch_size=4, num_workers=2,
                            multiprocessing_context=method)
        model = torch.nn.Linear(8, 3)
        trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), loader,
                          loss_fn=F.cross_entropy, max_steps=1_000_000, checkpoint_dir=ckpt,
                          progress=False)
        ready = []

        def on_step(event):
            if event.step >= 3 and not ready:
                ready.append(event.step)
                print("READY", flush=True)

        trainer.bus.subscribe(trainer.bus.stream(ev.StepEnded), on_step)
        try:
            trainer.fit_sync()
            raised = "returned"
        except KeyboardInterrupt:  # on_signal="raise", the default: after the graceful stop
            raised = "KeyboardInterrupt"
        result = trainer.result
        print("RESULT", result.reason, result.stop_reason, result.last_checkpoint, raised,
              flush=True)
    """
)


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_one_sigint_to_the_process_group_stops_gracefully(tmp_path: Path, method: str) -> None:
    script = tmp_path / "train.py"
    script.write_text(WORKERS_SCRIPT)
    ckpt = tmp_path / "ckpt"
    proc = subprocess.Popen(
        [sys.executable, str(script), method, str(ckpt)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )
    output: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            output.append(line.rstrip("\n"))
            if line.strip() == "READY":
                os.killpg(proc.pid, signal.SIGINT)  # once, to the group: a Ctrl-C
                break
        rest, _ = proc.communicate(timeout=WORKERS_GUARD_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    output += rest.splitlines()
    text = "\n".join(output)
    assert proc.returncode == 0, text
    results = [line.split() for line in output if line.startswith("RESULT ")]
    assert len(results) == 1, text
    _, reason, stop_reason, checkpoint, raised = results[0]
    assert (reason, stop_reason, raised) == ("stopped", "signal", "KeyboardInterrupt"), text
    assert checkpoint.endswith("-final.pt") and Path(checkpoint).is_file(), text
    # One Ctrl-C is one signal to the trainer: no worker ran its handler, nothing aborted.
    received = [line for line in output if "signal_received" in line]
    assert len(received) == 1 and "stop after this step" in received[0], text
    assert "abort" not in text and "exited unexpectedly" not in text, text


def test_a_second_sigint_after_the_stop_took_effect_says_the_run_ended_gracefully(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two Ctrl-C in quick succession: the second lands while the final checkpoint is being
    written, after the first's stop took effect. Nothing can be aborted any more; the
    ``KeyboardInterrupt`` says that the run stopped gracefully, and where its checkpoint is."""
    import time

    import torch
    import torch.nn.functional as F
    from structlog.testing import capture_logs

    from trainbus import Trainer
    from trainbus.testing import tiny_loader, tiny_model

    def interrupt_and_wait(handled: int) -> None:
        """Send SIGINT to this process; return once the trainer's handler has run."""
        os.kill(os.getpid(), signal.SIGINT)
        deadline = time.monotonic() + GUARD_S
        while sum(x["event"] == "signal_received" for x in logs) < handled:
            assert time.monotonic() < deadline, "the signal was never handled"
            time.sleep(0.005)

    save = torch.save

    def final_save(obj: object, f: object, *args: object, **kwargs: object) -> None:
        interrupt_and_wait(2)  # the second Ctrl-C, while the final checkpoint is written
        save(obj, f, *args, **kwargs)  # type: ignore[arg-type]

    model = tiny_model()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05), tiny_loader(40),
                      loss_fn=F.cross_entropy, max_steps=40, checkpoint_dir=tmp_path,
                      progress=False)  # fmt: skip
    trainer.add_hook("loss", lambda ctx: interrupt_and_wait(1) if ctx.step == 3 else None)
    monkeypatch.setattr(torch, "save", final_save)  # the only save: the final one
    with capture_logs() as logs, pytest.raises(KeyboardInterrupt) as raised:
        trainer.fit_sync()
    assert "came after the run had ended (stopped at step 4" in str(raised.value)
    result = trainer.result
    assert result is not None and (result.reason, result.stop_reason) == ("stopped", "signal")
    assert result.last_checkpoint is not None and result.last_checkpoint.endswith("-final.pt")
    assert Path(result.last_checkpoint).is_file() and result.last_checkpoint in str(raised.value)

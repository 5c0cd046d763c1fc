"""How a run's ending reaches its caller: typed endings (``Ending``), the interrupt after a
signal's graceful stop (``on_signal``), and ``CheckpointDir(skip_final=)``."""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from trainbus import CheckpointDir, ConfigError, Trainer
from trainbus import commands as cmd
from trainbus import events as ev
from trainbus.events import Ending
from trainbus.testing import EventRecorder, tiny_loader, tiny_model


def make(tmp: Path | CheckpointDir | None = None, **kw: Any) -> Trainer:
    model = tiny_model()
    args: dict[str, Any] = dict(loss_fn=F.cross_entropy, max_steps=6, progress=False,
                                checkpoint_dir=tmp)  # fmt: skip
    args.update(kw)
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_loader(4), **args)


def stop_at(trainer: Trainer, step: int, reason: str) -> None:
    def hook(ctx: Any) -> None:
        if ctx.step == step:
            trainer.bus.send(cmd.StopTraining(reason=reason))

    trainer.add_hook("after_optimizer_step", hook)


@pytest.mark.parametrize(
    ("reason", "stop_reason", "ending"),
    [
        ("completed", None, Ending.COMPLETED),
        ("stopped", "early stopping: val_loss", Ending.STOPPED),
        ("stopped", "pruned", Ending.PRUNED),
        ("stopped", "signal", Ending.SIGNAL),
        ("failed", None, Ending.FAILED),
        ("cancelled", None, Ending.CANCELLED),
    ],
)
def test_an_ending_tells_a_stops_cause_apart(
    reason: str, stop_reason: str | None, ending: Ending
) -> None:
    assert Ending.of(reason, stop_reason) is ending
    assert ev.FitEnded(step=1, epoch=0, reason=reason, stop_reason=stop_reason).ending is ending
    assert ending == ending.value  # a StrEnum: logs and JSON keep the plain word


def test_an_unknown_reason_is_refused() -> None:
    with pytest.raises(ValueError, match="'finished' is not an end reason"):
        Ending.of("finished", None)


@pytest.mark.parametrize("stop", ["pruned", "budget", None])
def test_fit_result_ending(stop: str | None) -> None:
    trainer = make()
    if stop is not None:
        stop_at(trainer, 2, stop)
    result = trainer.fit_sync()
    expected = {"pruned": Ending.PRUNED, "budget": Ending.STOPPED, None: Ending.COMPLETED}[stop]
    assert result.ending is expected
    assert result.reason == ("completed" if stop is None else "stopped")  # the old field holds
    assert result.steps == (6 if stop is None else 2)


def test_skip_final_checkpoint_of_a_pruned_run_only(tmp_path: Path) -> None:
    pruned = make(CheckpointDir(tmp_path / "pruned", skip_final={"pruned"}))
    stop_at(pruned, 2, "pruned")
    recorder = EventRecorder(pruned.bus)
    result = pruned.fit_sync()
    assert result.ending is Ending.PRUNED and result.last_checkpoint is None
    assert recorder.of_type(ev.CheckpointSaved) == []
    assert not (tmp_path / "pruned").exists()  # created at the first save, never before

    stopped = make(CheckpointDir(tmp_path / "stopped", skip_final={Ending.PRUNED}))
    stop_at(stopped, 2, "early stopping")
    result = stopped.fit_sync()
    assert result.ending is Ending.STOPPED
    assert result.last_checkpoint is not None and result.last_checkpoint.endswith("-final.pt")

    completed = make(CheckpointDir(tmp_path / "completed", skip_final={"pruned", "stopped"}))
    assert completed.fit_sync().last_checkpoint is not None  # a completed run always writes it


@pytest.mark.parametrize("bad", ["pruned", ["completed"], ["finished"], 3])
def test_skip_final_refuses_what_is_not_a_stop(bad: object, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^CheckpointDir\.skip_final="):
        CheckpointDir(tmp_path, skip_final=bad)  # type: ignore[arg-type]


def test_on_signal_is_checked() -> None:
    with pytest.raises(ConfigError, match=r"on_signal.*'raise'.*'return'.*None"):
        make(on_signal="ignore")


def raise_signal_at(trainer: Trainer, step: int, signum: int) -> None:
    def hook(ctx: Any) -> None:
        if ctx.step == step:
            # To the main thread, which waits in run(): where the kernel delivers a terminal's
            # or kill's signal in a single-threaded wait (raise_signal would target this one).
            signal.pthread_kill(threading.main_thread().ident or 0, signum)

    trainer.add_hook("after_optimizer_step", hook)


pytestmark_posix = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")


@pytestmark_posix
def test_sigint_stops_gracefully_then_raises_keyboard_interrupt(tmp_path: Path) -> None:
    assert threading.current_thread() is threading.main_thread()
    trainer = make(tmp_path, max_steps=1_000)
    raise_signal_at(trainer, 3, signal.SIGINT)
    recorder = EventRecorder(trainer.bus)
    with pytest.raises(KeyboardInterrupt, match="SIGINT stopped the run gracefully at step"):
        trainer.fit_sync()
    result = trainer.result
    assert result is not None and result.ending is Ending.SIGNAL
    assert (
        result.last_checkpoint is not None and Path(result.last_checkpoint).is_file()
    )  # written first
    assert [e.ending for e in recorder.of_type(ev.FitEnded)] == [Ending.SIGNAL]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored


@pytestmark_posix
def test_sigterm_stops_gracefully_then_raises_system_exit_143(tmp_path: Path) -> None:
    previous = signal.getsignal(signal.SIGTERM)
    trainer = make(tmp_path, max_steps=1_000)
    raise_signal_at(trainer, 3, signal.SIGTERM)
    with pytest.raises(SystemExit) as info:
        trainer.fit_sync()
    assert info.value.code == 128 + signal.SIGTERM
    assert trainer.result is not None and trainer.result.ending is Ending.SIGNAL
    assert trainer.result.last_checkpoint is not None
    assert signal.getsignal(signal.SIGTERM) is previous


@pytestmark_posix
def test_on_signal_return_keeps_the_result(tmp_path: Path) -> None:
    trainer = make(tmp_path, max_steps=1_000, on_signal="return")
    raise_signal_at(trainer, 3, signal.SIGINT)
    result = trainer.fit_sync()
    assert result.ending is Ending.SIGNAL and result.reason == "stopped"
    # The handler runs when the main thread next gets the GIL: after step 3, a step or so later.
    assert 3 <= result.steps < 1_000 and result.last_checkpoint is not None


@pytestmark_posix
def test_handle_signals_off_leaves_sigint_to_python(tmp_path: Path) -> None:
    # No handler of trainbus: Python's own raises KeyboardInterrupt in the main thread at once.
    trainer = make(tmp_path, max_steps=1_000, on_signal=None)
    raise_signal_at(trainer, 3, signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        trainer.fit_sync()
    assert trainer.result is not None and trainer.result.ending is Ending.CANCELLED

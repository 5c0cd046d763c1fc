"""Trainer(attach=...), the prompt's grammar, and a run folder too long for AF_UNIX."""

from __future__ import annotations

import io
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import trainbus
from trainbus import ConfigError
from trainbus import _wire as wire
from trainbus import commands as cmd
from trainbus import events as ev
from trainbus._attachment import locate
from trainbus._cli.attach import CommandSyntaxError, View, parse_command
from trainbus._distributed.attach_server import attach_folder, max_socket_path
from trainbus.testing import tiny_model


def trainer(**kw: object) -> trainbus.Trainer:
    model = tiny_model()
    data = [(torch.randn(4, 32), torch.randint(0, 10, (4,))) for _ in range(4)]
    return trainbus.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
                            loss_fn=F.cross_entropy, progress=False, **kw)  # type: ignore[arg-type]  # fmt: skip


def test_attach_option_is_checked_up_front(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="attach"):
        trainer(max_steps=1, attach=42)
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="a folder \\(this is a file\\)"):
        trainer(max_steps=1, attach=tmp_path / "file")
    assert attach_folder(True, None) is None
    assert attach_folder(False, tmp_path) is None
    assert attach_folder(True, tmp_path) == tmp_path
    assert attach_folder(str(tmp_path / "new"), None) == tmp_path / "new"


def test_the_prompt_grammar() -> None:
    assert parse_command("  ") is None
    assert parse_command("stop") == cmd.StopTraining(reason="attach")
    assert parse_command("stop loss diverged") == cmd.StopTraining(reason="loss diverged")
    assert parse_command("save") == cmd.SaveCheckpoint(tag=None)
    assert parse_command("save best") == cmd.SaveCheckpoint(tag="best")
    assert parse_command("evaluate") == cmd.Evaluate()
    assert parse_command("lr 1e-3") == cmd.SetLearningRate(lr=1e-3)
    assert parse_command("help") == "help" and parse_command("detach") == "detach"
    for bad in ("lr", "lr x", "lr -1", "save a b", "evaluate now", "jump"):
        with pytest.raises(CommandSyntaxError, match=r"commands: stop \[reason\], save \[tag\]"):
            parse_command(bad)


def test_a_run_folder_too_long_for_af_unix_listens_through_a_symlink(tmp_path: Path) -> None:
    folder = tmp_path / ("x" * 60) / ("y" * 60)
    assert len(os.fsencode(str(folder / "attach.sock"))) > max_socket_path()
    t = trainer(max_steps=100_000, attach=folder)
    started = threading.Event()
    t.add_hook("after_optimizer_step", lambda ctx: started.set())
    worker = threading.Thread(target=t.fit_sync)
    worker.start()
    try:
        assert started.wait(60)
        sock = folder / "attach.sock"
        assert sock.is_symlink() and Path(os.path.realpath(sock)).is_socket()
        private = Path(os.path.realpath(sock)).parent
        with trainbus.attach(folder, timeout=10) as att:
            stopped = att.request_sync(cmd.StopTraining(reason="long path"))
            ended = att.wait_sync(60)
        assert isinstance(stopped, ev.CommandApplied)
        assert ended is not None and ended.step == stopped.step
    finally:
        t.bus.send(cmd.StopTraining())
        worker.join(60)
    assert t.result is not None and t.result.stop_reason == "long path"
    assert not os.path.lexists(folder / "attach.sock") and not private.exists()
    assert not folder.exists()  # created for the socket only: removed again


def test_a_subscriber_blocking_the_job_shows_as_a_warning(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    folder = tmp_path
    t = trainer(max_steps=100_000, attach=folder, watchdog_s=0.05)
    started = threading.Event()

    def slow(e: ev.StepEnded) -> None:
        started.set()
        time.sleep(0.2)  # blocks the job's event loop: the watchdog counts a stall

    t.bus.subscribe(t.bus.stream(ev.StepEnded), slow, name="slow_uploader")
    worker = threading.Thread(target=t.fit_sync)
    worker.start()
    try:
        assert started.wait(60)
        with trainbus.attach(folder, timeout=30) as att:
            deadline = time.monotonic() + 60
            while not att.status.get("stalled") and time.monotonic() < deadline:
                time.sleep(0.05)
            status = att.status
            att.request_sync(cmd.StopTraining())
    finally:
        t.bus.send(cmd.StopTraining())
        worker.join(60)
    assert [s["name"] for s in status["stalled"]] == ["slow_uploader"]
    view = View(sys.stdout, json_records=False)
    view.status(status)
    view.status(status)  # said once, not at every status record
    out = capsys.readouterr().out
    assert out.count("warning: sync subscriber slow_uploader blocked the job's event loop") == 1


def test_json_view_prints_wire_records_that_read_back() -> None:
    out = io.StringIO()
    view = View(out, json_records=True)
    event = ev.CommandApplied(step=7, epoch=0, command=cmd.SetLearningRate(lr=0.5))
    view.show(event)
    view.status({"holding": [{"name": "uploader", "waited_s": 1.5}], "attached": 2})
    first, second = out.getvalue().splitlines()
    back = wire.loads(first.encode())
    assert isinstance(back, ev.CommandApplied) and back.step == 7
    assert back.command == cmd.SetLearningRate(lr=0.5)
    assert json.loads(second) == {"v": 1, "type": "status", "attached": 2,
                                  "holding": [{"name": "uploader", "waited_s": 1.5}]}  # fmt: skip


def test_without_af_unix_attach_is_off_or_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delattr(socket, "AF_UNIX")  # what Python on Windows has
    assert attach_folder(True, tmp_path) is None  # the default: silently off
    with pytest.raises(ConfigError, match="no Unix domain sockets"):
        attach_folder(tmp_path, None)
    with pytest.raises(trainbus.AttachError, match="this platform has no Unix domain sockets"):
        locate(tmp_path)  # what entering an Attachment checks first


def test_a_file_given_as_the_run_folder_is_named_as_a_file(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(trainbus.AttachError, match=r"afile: not a folder \(a file\)"):
        locate(afile)
    with pytest.raises(trainbus.AttachError, match="no such folder"):
        locate(tmp_path / "missing")

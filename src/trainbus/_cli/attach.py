"""``trainbus attach RUN_DIR``: watch a running job live (stdout) and steer it from a prompt
(stdin) or options (docs/attach.md)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import os
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TextIO

import anyio
import anyio.from_thread
import anyio.lowlevel

from .. import _wire as wire
from .. import commands as cmd
from .. import events as ev
from .._attachment import AttachError, Attachment
from .._bus import CommandError
from .._distributed.protocol import control_record
from .._exceptions import BusClosedError, ConfigError

__all__ = ["COMMANDS", "main", "parse_command"]

COMMANDS = "stop [reason], save [tag], evaluate, lr VALUE, help, detach"
"""What the prompt takes."""

_VIEW = (
    ev.FitStarted,
    ev.FitEnded,
    ev.EpochEnded,
    ev.StepEnded,
    ev.MetricsLogged,
    ev.EvaluationEnded,
    ev.CheckpointSaved,
    ev.CommandApplied,
)


# The status record's lists: (its key, the count that changes, the warning).
_WARNINGS = (
    (
        "holding",
        "waited_s",
        "training waits for subscriber {name} (waited {waited_s:.1f} s so far)",
    ),
    (
        "stalled",
        "stalls",
        "sync subscriber {name} blocked the job's event loop {stalls} time(s) ({blocked_s:.1f} s)",
    ),
    ("failed", "failed", "subscriber {name} failed {failed} time(s): {last_error}"),
)


class CommandSyntaxError(ValueError):
    """A prompt line that is not a command (the message lists the commands)."""


def parse_command(line: str) -> cmd.Command | str | None:
    """One prompt line as a command, ``"help"``/``"detach"``, or None for an empty line;
    ``CommandSyntaxError`` for anything else."""
    words = line.split()
    if not words:
        return None
    name, rest = words[0].lower(), words[1:]
    if name in ("help", "?"):
        return "help"
    if name in ("detach", "quit", "exit") and not rest:
        return "detach"
    if name == "stop":
        return cmd.StopTraining(reason=" ".join(rest) or "attach")
    if name == "save" and len(rest) <= 1:
        return cmd.SaveCheckpoint(tag=rest[0] if rest else None)
    if name in ("evaluate", "eval") and not rest:
        return cmd.Evaluate()
    if name == "lr" and len(rest) == 1:
        try:
            return cmd.SetLearningRate(lr=float(rest[0]))
        except (ValueError, ConfigError):
            raise CommandSyntaxError(
                f"lr needs a positive number, not {rest[0]!r} (commands: {COMMANDS})"
            ) from None
    raise CommandSyntaxError(
        f"unknown or malformed command {line.strip()!r} (commands: {COMMANDS})"
    )


def short(command: Any) -> str:
    """A command as ``Name(field=value, ...)`` without its bookkeeping (``decided_at``)."""
    fields = ", ".join(
        f"{f.name}={getattr(command, f.name)!r}"
        for f in dataclasses.fields(command)
        if f.name != "decided_at"
    )
    return f"{type(command).__name__}({fields})"


def _fmt(values: Any) -> str:
    if not isinstance(values, dict):
        return ""
    return "  ".join(
        f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items()
    )


class View:
    """What the attachment prints: human lines, or wire records with ``json`` (other lines on
    ``err``); each flushed as written, and none once the reader closed the pipe (``gone``)."""

    def __init__(self, out: TextIO, *, json_records: bool, err: TextIO | None = None) -> None:
        self.out = out
        self.err = err if err is not None else sys.stderr
        self.json = json_records
        self.gone = anyio.Event()
        self._max_steps: int | None = None
        self._last_progress = 0.0
        self._warned: dict[str, Any] = {}

    def _write(self, text: str) -> None:
        if self.gone.is_set():
            return
        try:
            self.out.write(text)
            self.out.flush()
        except BrokenPipeError:
            # The reader went away (`| head`): detach. What is left in the buffer goes to
            # /dev/null, so the interpreter's flush at exit has nowhere to fail.
            with contextlib.suppress(OSError, ValueError):
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, self.out.fileno())
                os.close(devnull)
            self.gone.set()

    def line(self, text: str) -> None:
        """A human line: on ``out``, or on ``err`` with ``json`` (stdout is records only)."""
        if self.json:
            self.err.write(text + "\n")
            self.err.flush()
        else:
            self._write(text + "\n")

    def show(self, e: ev.BaseEvent) -> None:
        if self.json:
            self._write(wire.dumps(e).decode())
            return
        if isinstance(e, ev.FitStarted):
            self._max_steps = e.max_steps
            self.line(f"fit started: max_steps={e.max_steps} device={e.device}")
        elif isinstance(e, ev.StepEnded):
            now = time.monotonic()
            if now - self._last_progress >= 1.0:
                self._last_progress = now
                total = f"/{self._max_steps}" if self._max_steps else ""
                self.line(
                    f"step {e.step}{total}  epoch {e.epoch}  loss {float(e.loss):.4g}  "
                    f"lr {e.lr:.3g}"
                )
        elif isinstance(e, ev.MetricsLogged):
            self.line(f"metrics @ step {e.step}: {_fmt(dict(e.metrics))}")
        elif isinstance(e, ev.EvaluationEnded):
            self.line(
                f"evaluation {e.dataset} @ step {e.step} ({e.trigger}): {_fmt(dict(e.metrics))}"
            )
        elif isinstance(e, ev.CheckpointSaved):
            self.line(f"checkpoint @ step {e.step}: {e.path}")
        elif isinstance(e, ev.EpochEnded):
            self.line(f"epoch {e.epoch} ended @ step {e.step}")
        elif isinstance(e, ev.CommandApplied):
            outcome = "failed" if e.error is not None else "applied"
            error = f": {e.error}" if e.error is not None else ""
            self.line(f"{outcome}: {short(e.command)} at step {e.step}{error}")
        elif isinstance(e, ev.FitEnded):
            why = f" ({e.stop_reason})" if e.stop_reason else ""
            self.line(f"run ended at step {e.step}: {e.reason}{why}")

    def status(self, status: dict[str, Any]) -> None:
        """Warnings from the job's status record, each when it changes."""
        if self.json:
            if status:
                self._write(control_record("status", **status).decode())
            return
        for kind, count, text in _WARNINGS:
            for s in status.get(kind, ()):
                key = f"{kind}:{s['name']}"
                if self._warned.get(key) != s[count]:
                    self._warned[key] = s[count]
                    self.line("warning: " + text.format(**s))


def _stdin_lines(send: Any, token: Any) -> None:
    """A daemon thread: stdin's lines into the event loop (None at its end)."""
    for line in itertools.chain(sys.stdin, [None]):
        try:
            anyio.from_thread.run_sync(send.send_nowait, line, token=token)
        except Exception:  # the loop ended
            return


async def _ask(att: Attachment, command: cmd.Command, view: View) -> bool:
    try:
        await att.request(command)
    except CommandError as exc:
        view.line(f"error: {short(command)} failed: {exc}")
        return False
    except BusClosedError:
        view.line(f"not applied: {short(command)} (the run ended first)")
        return False
    return True


async def _prompt(att: Attachment, view: View, done: anyio.Event) -> None:
    send, receive = anyio.create_memory_object_stream[str | None](64)
    threading.Thread(
        target=_stdin_lines,
        args=(send, anyio.lowlevel.current_token()),
        name="trainbus-attach-stdin",
        daemon=True,
    ).start()
    async with anyio.create_task_group() as tg:
        async for line in receive:
            if line is None:  # stdin ended: keep watching when it is not a terminal
                if sys.stdin.isatty():
                    done.set()
                return
            try:
                parsed = parse_command(line)
            except CommandSyntaxError as exc:
                view.line(f"error: {exc}")
                continue
            if parsed == "help":
                view.line(f"commands: {COMMANDS}")
            elif parsed == "detach":
                done.set()
                return
            elif parsed is not None and not isinstance(parsed, str):
                tg.start_soon(_ask, att, parsed, view)


async def _watch_status(att: Attachment, view: View) -> None:
    while True:
        await anyio.sleep(0.5)
        view.status(att.status)


async def _then_set(wait: Callable[[], Awaitable[object]], done: anyio.Event) -> None:
    await wait()
    done.set()


async def _attach(args: argparse.Namespace, commands: list[cmd.Command]) -> int:
    view = View(sys.stdout, json_records=args.json)
    att = Attachment(args.run_dir, events=_VIEW, timeout=args.timeout)
    att.subscribe(att.stream(*_VIEW), view.show, name="trainbus-attach-view")
    async with att:
        job = att.job
        if not args.json:
            view.line(
                f"attached to {args.run_dir} (pid {job.get('pid')}, rank "
                f"{job.get('rank')}); commands: {COMMANDS}"
            )
        if commands:
            ok = True
            for c in commands:
                ok = await _ask(att, c, view) and ok
            if ok and any(isinstance(c, cmd.StopTraining) for c in commands):
                await att.wait()  # show the run's end
            return 0 if ok else 1
        done = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(_prompt, att, view, done)
            tg.start_soon(_watch_status, att, view)
            # Detach when the run ends or the pipe's reader closed it.
            tg.start_soon(_then_set, att.wait, done)
            tg.start_soon(_then_set, view.gone.wait, done)
            await done.wait()
            tg.cancel_scope.cancel()
        if att.ended is None and not args.json:
            view.line("detached (the run goes on)" if att.linked else "the job went away")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``trainbus attach``."""
    p = argparse.ArgumentParser(
        prog="trainbus attach",
        description="Watch a running trainbus job live and steer it: its rank 0 listens on "
        "RUN_DIR/attach.sock (Trainer(attach=...), on by default with a checkpoint_dir). "
        f"Prompt commands: {COMMANDS}.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="the job's run folder")
    p.add_argument(
        "--json",
        action="store_true",
        help="print the events as wire records, one JSON object per line",
    )
    p.add_argument(
        "--stop",
        nargs="?",
        const="attach",
        metavar="REASON",
        help="stop the run (at its next step), then detach",
    )
    p.add_argument(
        "--save",
        nargs="?",
        const="",
        metavar="TAG",
        help="save a checkpoint now (optionally tagged), then detach",
    )
    p.add_argument("--evaluate", action="store_true", help="evaluate now, then detach")
    p.add_argument("--lr", type=float, metavar="VALUE", help="set the learning rate, then detach")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to connect (default 5)")
    return p


def main(argv: Sequence[str]) -> int:
    """Run ``trainbus attach``; return the exit code (0 ok, 1 error, 2 usage)."""
    parser = build_parser()
    try:
        args = parser.parse_args(list(argv))
    except SystemExit as exc:
        return int(exc.code or 0)
    commands: list[cmd.Command] = []
    try:
        if args.save is not None:
            commands.append(cmd.SaveCheckpoint(tag=args.save or None))
        if args.evaluate:
            commands.append(cmd.Evaluate())
        if args.lr is not None:
            commands.append(cmd.SetLearningRate(lr=args.lr))
        if args.stop is not None:
            commands.append(cmd.StopTraining(reason=args.stop))
    except ConfigError as exc:
        print(f"trainbus attach: {exc}", file=sys.stderr)
        return 2
    try:
        return anyio.run(_attach, args, commands)
    except AttachError as exc:
        print(f"trainbus attach: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        if not args.json:  # as the prompt's detach and Ctrl-D say it (docs/attach.md)
            print("detached (the run goes on)", flush=True)
        return 0  # Ctrl-C detaches; the run goes on

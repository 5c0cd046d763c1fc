"""The ``trainbus`` command line (``demo``, ``launch``, ``attach``, ``replay``, ``plot``,
``export``): the one place that configures structlog (to stderr, through ``tqdm.write`` when
installed, so a progress bar stays intact) and prints (to stdout)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .demo import run_demo

__all__ = ["configure_logging", "main", "split_launch_args"]


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


LAUNCH_USAGE = """usage: trainbus launch [--json-logs] [torchrun options] script.py [script args]

Run script.py under torchrun (python -m torch.distributed.run) with this process as the
driver: rank 0 streams its events here over 127.0.0.1 (a per-run token), where the metrics are
logged; Ctrl-C stops the workers gracefully (StopTraining, final checkpoint), a second Ctrl-C
terminates them. Without --master_port/--rdzv*/--nnodes options, --standalone is added.

example: trainbus launch --nproc_per_node=2 train.py --lr 0.1
"""


def split_launch_args(tokens: Sequence[str]) -> tuple[list[str], int, bool, str, list[str]]:
    """``[torchrun options] script.py [args]`` -> (torchrun options without nproc, nproc,
    json_logs, script, script args); ``ValueError`` for no script or a bad nproc."""
    options: list[str] = []
    nproc, json_logs = 1, False
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if not tok.startswith("-") and tok.endswith(".py"):
            return options, nproc, json_logs, tok, list(tokens[i + 1 :])
        name, eq, value = tok.partition("=")
        if name == "--json-logs":
            json_logs = True
        elif name in ("--nproc_per_node", "--nproc-per-node"):
            if not eq:
                i += 1
                value = tokens[i] if i < len(tokens) else ""
            try:
                nproc = int(value)
            except ValueError:
                raise ValueError(f"--nproc_per_node takes an integer, not {value!r}") from None
        else:
            options.append(tok)
        i += 1
    raise ValueError("no script.py given")


def run_launch(tokens: Sequence[str]) -> int:
    """``trainbus launch``: the driver with the metrics logger; return the exit code."""
    if not tokens or tokens[0] in ("-h", "--help"):
        print(LAUNCH_USAGE, file=sys.stdout if tokens else sys.stderr)
        return 0 if tokens else 2
    try:
        options, nproc, json_logs, script, args = split_launch_args(tokens)
    except ValueError as exc:
        print(f"trainbus launch: {exc}\n{LAUNCH_USAGE}", file=sys.stderr)
        return 2
    configure_logging(json_logs=json_logs)
    from .._exceptions import ConfigError, LaunchError
    from .._launcher import Launcher
    from ..callbacks import MetricsLogger

    try:
        launcher = Launcher(
            script, *args, nproc_per_node=nproc, torchrun_args=options, callbacks=[MetricsLogger()]
        )
        result = launcher.run()
    except (ConfigError, LaunchError) as exc:
        print(f"trainbus launch: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ConfigError) else 1
    last = result.last_event
    print(
        f"launch ended: {result.received} events from rank 0"
        + (f", last {type(last).__name__} at step {last.step}" if last else "")
        + (f" (stopped: {result.stop_reason})" if result.stop_reason else "")
    )
    # Stopped gracefully by Ctrl-C/SIGTERM: the shell's convention, 128 + the signal's number
    # (a script that runs launches in turn sees the interrupt, as with any program).
    return 0 if result.signal is None else 128 + result.signal


def run_replay(args: argparse.Namespace) -> int:
    """Print the events of a recorded run ``--type`` and ``--steps`` select, one a line."""
    import dataclasses

    from .._replay import EventFilter, load_events

    keep = EventFilter.parse(args.type or (), args.steps)  # refused before reading the file
    events = list(load_events(args.run_dir))
    t0 = events[0].time if events else 0.0
    for e in filter(keep.matches, events):
        fields = " ".join(
            f"{f.name}={getattr(e, f.name)!r}"
            for f in dataclasses.fields(e)
            if f.name not in ("time", "step", "epoch")
        )
        print(
            f"{e.time - t0:9.3f}s step={e.step:<6} epoch={e.epoch:<3} "
            f"{type(e).__name__} {fields}".rstrip()
        )
    return 0


def run_plot(args: argparse.Namespace) -> int:
    """Draw the curves of a recorded run with CurvePlot's renderer."""
    from .. import events as ev
    from .._replay import load_events, resolve_run
    from ..callbacks._plot import render

    events = list(load_events(args.run_dir))
    train = [(e.step, float(e.loss)) for e in events if isinstance(e, ev.StepEnded)]
    val = [
        (e.step, e.metrics)
        for e in events
        if isinstance(e, ev.EvaluationEnded) and e.error is None and e.metrics
    ]
    out: Path = args.output or resolve_run(args.run_dir).parent / "curves.png"
    render(out, train, val, f"trainbus: {args.run_dir}")
    print(f"wrote {out}")
    return 0


EXPORT_DESCRIPTION = (
    "Write the full model state of a sharded (fully_shard) run's checkpoint folder as one "
    "torch.save file an unsharded model loads: model.load_state_dict(torch.load(OUTPUT, "
    "weights_only=True)). Each tensor equals full_tensor() of the sharded parameter."
)


def run_export(args: argparse.Namespace) -> int:
    """Print the file :func:`trainbus.checkpoint.export_full` wrote (exit code 1 if none)."""
    from .._exceptions import CheckpointError
    from ..checkpoint import export_full

    try:
        path = export_full(args.folder, args.output)
    except CheckpointError as exc:
        print(f"trainbus export: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not >= 1")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``trainbus`` command."""
    parser = argparse.ArgumentParser(
        prog="trainbus",
        description="A PyTorch trainer whose callbacks are an async reactive event bus.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = sub.add_parser(
        "demo",
        help="train an MLP on scikit-learn's digits with the default callback kit",
        description="Train an MLP on scikit-learn's bundled digits data set (no download) "
        "with progress, logging, checkpoints, early stopping and a plot of the curves.",
    )
    demo.add_argument(
        "--epochs",
        type=_positive_int,
        default=15,
        help="maximum epochs (default: 15; early stopping may stop sooner)",
    )
    demo.add_argument(
        "--run-dir",
        type=Path,
        default=None,
        help="run folder (default: runs/demo/<timestamp>, with runs/demo/latest pointing at it)",
    )
    demo.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    demo.add_argument(
        "--json-logs",
        action="store_true",
        help="log JSON lines instead of console lines (on stderr)",
    )
    sub.add_parser(
        "launch",
        help="run a script under torchrun with the subscribers in this driver process",
        description=LAUNCH_USAGE,
        add_help=False,
    )
    sub.add_parser(
        "attach",
        help="watch a running job live and steer it (stop, save, evaluate, lr)",
        add_help=False,
    )
    for name, text in (
        ("replay", "print a recorded run, one line per event"),
        ("plot", "draw the curves PNG of a recorded run"),
    ):
        p = sub.add_parser(name, help=text, description=text + " (its events.jsonl).")
        p.add_argument(
            "run_dir",
            type=Path,
            metavar="RUN_DIR",
            help="run folder holding events.jsonl, the .jsonl file, or a folder "
            "of runs (runs/demo: its latest run)",
        )
        if name == "plot":
            p.add_argument(
                "--output",
                type=Path,
                default=None,
                help="PNG to write (default: RUN_DIR/curves.png)",
            )
        else:
            p.add_argument(
                "--type",
                action="append",
                metavar="EVENT",
                help="only events of this class (StepEnded; repeat or use commas for several)",
            )
            p.add_argument(
                "--steps",
                metavar="START:END",
                default=None,
                help="only events with START <= step <= END (10:20, 10:, :20)",
            )
        p.add_argument("--json-logs", action="store_true", help=argparse.SUPPRESS)
    p = sub.add_parser(
        "export",
        help="turn a sharded checkpoint folder into one plain file",
        description=EXPORT_DESCRIPTION,
    )
    p.add_argument(
        "folder",
        type=Path,
        metavar="FOLDER",
        help="the checkpoint folder (checkpoints/step-00000042)",
    )
    p.add_argument("output", type=Path, metavar="OUTPUT", help="the file to write (model.pt)")
    p.add_argument("--json-logs", action="store_true", help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``trainbus`` command line on ``argv`` (default: ``sys.argv[1:]``); the exit
    code: 0 completed or stopped, 1 failed, 130 aborted by a second Ctrl-C, 2 usage error."""
    tokens = list(sys.argv[1:] if argv is None else argv)
    if tokens[:1] == ["launch"]:  # torchrun's options are not ours to parse: split by hand
        return run_launch(tokens[1:])
    if tokens[:1] == ["attach"]:
        from .attach import main as attach_main

        configure_logging(json_logs=False)
        return attach_main(tokens[1:])
    parser = build_parser()
    try:
        args = parser.parse_args(tokens)
    except SystemExit as exc:  # argparse exits on --help and on usage errors
        return int(exc.code or 0)
    configure_logging(json_logs=args.json_logs)
    if args.command == "demo":
        return run_demo(args)
    if args.command == "export":
        return run_export(args)
    from .._exceptions import ConfigError

    try:
        return run_replay(args) if args.command == "replay" else run_plot(args)
    except ConfigError as exc:
        print(f"trainbus {args.command}: {exc}", file=sys.stderr)
        return 2

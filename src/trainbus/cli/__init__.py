"""The ``trainbus`` command line.

``trainbus demo`` trains an MLP on scikit-learn's bundled digits (8x8 images, 10 classes; no
download) with the default kit, and writes a run folder (logged as ``demo_started run_dir=``
at the start, printed at the end)::

    runs/demo/
        latest -> <timestamp>   the newest run (a symbolic link, or a file naming it)
        <timestamp>/            one run (YYYYmmdd-HHMMSS)
            events.jsonl        every event of the run, one JSON record per line
            checkpoints/        the 2 newest epoch-<n>.pt, the 2 best *-best.pt by val_loss,
                                and the final one
            curves.png          training loss, val_loss and val_acc per step

so ``trainbus replay runs/demo`` and ``trainbus plot runs/demo`` read the newest run.
``--run-dir DIR`` writes one run into DIR instead (no ``latest`` pointer). Progress follows
the Trainer's default: a bar on a terminal, none in a log; ``--json-logs`` logs progress lines.

``trainbus launch [torchrun options] script.py [args]`` runs a script under torchrun with this
process as the driver (see :mod:`trainbus.launcher`). ``trainbus attach RUN_DIR`` watches and
steers a running job (see :mod:`trainbus.cli.attach`).

``trainbus export FOLDER OUTPUT`` writes a sharded (FSDP2) run's checkpoint folder as one plain
file an unsharded model loads (see :func:`trainbus.checkpoint.export_full`).

The CLI is the one place that configures structlog (a console renderer for humans, JSON lines
with ``--json-logs``) and prints. Logs go to stderr (through ``tqdm.write`` when tqdm is there, so
the progress bar stays intact); the summary goes to stdout.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .export import add_export_parser, run_export

__all__ = ["main"]


# ----------------------------------------------------------------------------- logging setup
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

    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
    ]
    if json_logs:
        processors = [
            *shared,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.dict_tracebacks,
            structlog.processors.JSONRenderer(),
        ]
    else:
        processors = [
            *shared,
            structlog.processors.TimeStamper(fmt="%H:%M:%S", utc=False),
            _round_floats,
            structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty()),
        ]
    structlog.configure(
        processors=processors,
        logger_factory=lambda *args: _StderrLogger(),
        wrapper_class=structlog.make_filtering_bound_logger(20),  # INFO and above
        cache_logger_on_first_use=False,
    )


# ----------------------------------------------------------------------------- demo
def _digits_loaders(seed: int, batch_size: int = 64) -> tuple[Any, Any]:
    import torch
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    from sklearn.preprocessing import StandardScaler
    from torch.utils.data import DataLoader, TensorDataset

    x, y = load_digits(return_X_y=True)
    x_train, x_val, y_train, y_val = train_test_split(
        x, y, test_size=0.2, random_state=seed, stratify=y
    )
    scaler = StandardScaler().fit(x_train)  # fitted on the training split only

    def dataset(xs: Any, ys: Any) -> TensorDataset:
        return TensorDataset(
            torch.tensor(scaler.transform(xs), dtype=torch.float32),
            torch.tensor(ys, dtype=torch.long),
        )

    gen = torch.Generator().manual_seed(seed)
    train = DataLoader(dataset(x_train, y_train), batch_size=batch_size, shuffle=True,
                       generator=gen)  # fmt: skip
    val = DataLoader(dataset(x_val, y_val), batch_size=256)
    return train, val


def _accuracy(outputs: Any, targets: Any) -> Any:
    return (outputs.argmax(dim=1) == targets).float().mean()


def run_demo(args: argparse.Namespace) -> int:
    """Train the digits MLP with the default kit; return the exit code."""
    import structlog
    import torch
    import torch.nn.functional as F

    from .. import Ending, Trainer, seed_everything
    from ..callbacks import (
        Checkpointing,
        CurvePlot,
        EarlyStopping,
        JsonlEventLog,
        MetricsLogger,
        Progress,
    )

    log = structlog.get_logger("trainbus.cli")
    from .._rundirs import new_run_dir

    run_dir: Path = args.run_dir or new_run_dir(Path("runs") / "demo")
    seed_everything(args.seed)  # first: the model's initial weights
    train, val = _digits_loaders(args.seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(128, 10)
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    trainer = Trainer(
        model, optimizer, train, loss_fn=F.cross_entropy, eval_data=val,
        max_epochs=args.epochs, checkpoint_dir=run_dir / "checkpoints", seed=args.seed,
        metrics={"acc": _accuracy}, device="cpu", log_every=10,
        progress=False if args.json_logs else None,
        callbacks=[
            # A terminal gets the Trainer's default bar (progress=None); a log gets no bar,
            # JSON logs get progress lines.
            *([Progress(bar=False)] if args.json_logs else []),
            MetricsLogger(every_s=2.0),
            JsonlEventLog(run_dir / "events.jsonl"),
            Checkpointing(every_epochs=5, monitor="val_loss", keep_last=2, keep_best=2),
            EarlyStopping(metric="val_loss", patience=3),
            CurvePlot(run_dir / "curves.png", title="trainbus demo: digits MLP"),
        ],
    )  # fmt: skip
    log.info("demo_started", run_dir=str(run_dir), max_epochs=args.epochs, seed=args.seed)
    try:
        result = trainer.fit_sync()
    except KeyboardInterrupt:  # Ctrl-C: after the graceful stop (on_signal="raise"), or aborted
        stopped = trainer.result
        if stopped is not None and stopped.ending is Ending.SIGNAL:
            print(f"stopped by Ctrl-C after {stopped.steps} steps; checkpoint: "
                  f"{stopped.checkpoint}; run folder: {run_dir}", file=sys.stderr)  # fmt: skip
        else:
            print(f"aborted; run folder: {run_dir}", file=sys.stderr)
        return 130
    except Exception as exc:
        log.error("demo_failed", error=repr(exc), run_dir=str(run_dir))
        return 1
    acc = result.metrics.get("val_acc")
    print(f"run folder: {run_dir}")
    print(f"ended: {result.ending} after {result.steps} steps ({result.epochs} epochs)"
          + (f" - {result.stop_reason}" if result.stop_reason else ""))  # fmt: skip
    print("final val accuracy: " + (f"{acc:.2%}" if acc is not None else "n/a"))
    return 0 if result.reason in ("completed", "stopped") else 1


# ----------------------------------------------------------------------------- launch
LAUNCH_USAGE = """usage: trainbus launch [--json-logs] [torchrun options] script.py [script args]

Run script.py under torchrun (python -m torch.distributed.run) with this process as the
driver: rank 0 streams its events here over 127.0.0.1 (a per-run token), where the metrics are
logged; Ctrl-C stops the workers gracefully (StopTraining, final checkpoint), a second Ctrl-C
terminates them. Without --master_port/--rdzv*/--nnodes options, --standalone is added.

example: trainbus launch --nproc_per_node=2 train.py --lr 0.1
"""


def split_launch_args(tokens: Sequence[str]) -> tuple[list[str], int, bool, str, list[str]]:
    """``[torchrun options] script.py [args]`` -> (torchrun options without nproc, nproc,
    json_logs, script, script args).

    Raises:
        ValueError: no ``.py`` script, or a bad ``--nproc_per_node``.
    """
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
    from ..callbacks import MetricsLogger
    from ..launcher import Launcher

    try:
        launcher = Launcher(script, *args, nproc_per_node=nproc, torchrun_args=options,
                            callbacks=[MetricsLogger()])  # fmt: skip
        result = launcher.run()
    except ConfigError as exc:
        print(f"trainbus launch: {exc}", file=sys.stderr)
        return 2
    except LaunchError as exc:
        print(f"trainbus launch: {exc}", file=sys.stderr)
        return 1
    last = result.last_event
    print(f"launch ended: {result.received} events from rank 0"
          + (f", last {type(last).__name__} at step {last.step}" if last else "")
          + (f" (stopped: {result.stop_reason})" if result.stop_reason else ""))  # fmt: skip
    # Stopped gracefully by Ctrl-C/SIGTERM: the shell's convention, 128 + the signal's number
    # (a script that runs launches in turn sees the interrupt, as with any program).
    return 0 if result.signal is None else 128 + result.signal


# ----------------------------------------------------------------------------- replay, plot
def run_replay(args: argparse.Namespace) -> int:
    """Print a recorded run, one line per event: offset in seconds, class, fields; only the
    events ``--type`` and ``--steps`` select (offsets stay relative to the run's start)."""
    from ..replay import EventFilter, load_events

    keep = EventFilter.parse(args.type or (), args.steps)  # refused before reading the file
    events = list(load_events(args.run_dir))
    t0 = events[0].time if events else 0.0
    for e in filter(keep.matches, events):
        fields = " ".join(
            f"{k}={v!r}" for k, v in _fields(e).items() if k not in ("time", "step", "epoch")
        )
        print(f"{e.time - t0:9.3f}s step={e.step:<6} epoch={e.epoch:<3} "
              f"{type(e).__name__} {fields}".rstrip())  # fmt: skip
    return 0


def _fields(event: Any) -> dict[str, Any]:
    import dataclasses

    return {f.name: getattr(event, f.name) for f in dataclasses.fields(event)}


def run_plot(args: argparse.Namespace) -> int:
    """Draw the curves of a recorded run with CurvePlot's renderer."""
    from .. import events as ev
    from .._rundirs import resolve_run
    from ..callbacks.plot import render
    from ..replay import load_events

    events = list(load_events(args.run_dir))
    train = [(e.step, float(e.loss)) for e in events if isinstance(e, ev.StepEnded)]
    val = [(e.step, e.metrics) for e in events
           if isinstance(e, ev.EvaluationEnded) and e.error is None and e.metrics]  # fmt: skip
    out: Path = args.output or resolve_run(args.run_dir).parent / "curves.png"
    render(out, train, val, f"trainbus: {args.run_dir}")
    print(f"wrote {out}")
    return 0


# ----------------------------------------------------------------------------- entry point
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
    demo.add_argument("--run-dir", type=Path, default=None,
                      help="run folder (default: runs/demo/<timestamp>, with "
                      "runs/demo/latest pointing at it)")  # fmt: skip
    demo.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    demo.add_argument("--json-logs", action="store_true",
                      help="log JSON lines instead of console lines (on stderr)")  # fmt: skip
    sub.add_parser(
        "launch",
        help="run a script under torchrun with the subscribers in this driver process",
        description=LAUNCH_USAGE,
        add_help=False,
    )
    sub.add_parser("attach", help="watch a running job live and steer it (stop, save, "
                   "evaluate, lr)", add_help=False)  # fmt: skip
    for name, text in (("replay", "print a recorded run, one line per event"),
                       ("plot", "draw the curves PNG of a recorded run")):  # fmt: skip
        p = sub.add_parser(name, help=text, description=text + " (its events.jsonl).")
        p.add_argument("run_dir", type=Path, metavar="RUN_DIR",
                       help="run folder holding events.jsonl, the .jsonl file, or a folder "
                       "of runs (runs/demo: its latest run)")  # fmt: skip
        if name == "plot":
            p.add_argument("--output", type=Path, default=None,
                           help="PNG to write (default: RUN_DIR/curves.png)")  # fmt: skip
        else:
            p.add_argument("--type", action="append", metavar="EVENT",
                           help="only events of this class (StepEnded; repeat or use commas "
                           "for several)")  # fmt: skip
            p.add_argument("--steps", metavar="START:END", default=None,
                           help="only events with START <= step <= END "
                           "(10:20, 10:, :20)")  # fmt: skip
        p.add_argument("--json-logs", action="store_true", help=argparse.SUPPRESS)
    add_export_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``trainbus`` command line.

    Args:
        argv: Arguments without the program name (default: ``sys.argv[1:]``).

    Returns:
        The exit code: 0 when the run completed or stopped (early stopping, Ctrl-C), 1 when it
        failed, 130 when aborted by a second Ctrl-C; 2 for a usage error.
    """
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
    if args.command in ("replay", "plot"):
        from .._exceptions import ConfigError

        try:
            return run_replay(args) if args.command == "replay" else run_plot(args)
        except ConfigError as exc:
            print(f"trainbus {args.command}: {exc}", file=sys.stderr)
            return 2
    parser.error(f"unknown command {args.command!r}")  # unreachable: subparsers are required
    return 2


if __name__ == "__main__":
    sys.exit(main())

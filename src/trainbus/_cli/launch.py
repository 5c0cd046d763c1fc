"""``trainbus launch``: a script under torchrun with this process as the driver."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from .logs import configure_logging

__all__ = ["LAUNCH_USAGE", "run_launch", "split_launch_args"]


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

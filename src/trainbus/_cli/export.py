"""``trainbus export FOLDER OUTPUT``: a sharded checkpoint folder as one plain file.

The command line's side of :func:`trainbus.checkpoint.export_full`: the full model state of a
sharded (FSDP2) run's checkpoint folder, written as one ``torch.save`` file that an unsharded
model loads (``model.load_state_dict(torch.load(OUTPUT, weights_only=True))``). Runs in one
process, without torchrun or a GPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["add_export_parser", "run_export"]

DESCRIPTION = (
    "Write the full model state of a sharded (fully_shard) run's checkpoint folder as one "
    "torch.save file an unsharded model loads: model.load_state_dict(torch.load(OUTPUT, "
    "weights_only=True)). Each tensor equals full_tensor() of the sharded parameter."
)


def add_export_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``export`` to the ``trainbus`` command's subcommands."""
    p = sub.add_parser("export", help="turn a sharded checkpoint folder into one plain file",
                       description=DESCRIPTION)  # fmt: skip
    p.add_argument("folder", type=Path, metavar="FOLDER",
                   help="the checkpoint folder (checkpoints/step-00000042)")  # fmt: skip
    p.add_argument("output", type=Path, metavar="OUTPUT", help="the file to write (model.pt)")
    p.add_argument("--json-logs", action="store_true", help=argparse.SUPPRESS)


def run_export(args: argparse.Namespace) -> int:
    """Run ``trainbus export``: print the file written; return the exit code (1: the folder
    is not a valid sharded checkpoint, or the file cannot be written)."""
    from .._exceptions import CheckpointError
    from ..checkpoint import export_full

    try:
        path = export_full(args.folder, args.output)
    except CheckpointError as exc:
        print(f"trainbus export: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0

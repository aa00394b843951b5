"""The ``ckptio`` command line: one module per subcommand."""

from __future__ import annotations

import argparse
import sys

from ..errors import CheckpointError
from . import (consolidate_cmd, convert_cmd, inspect_cmd, list_cmd, nemo_cmd, prune_cmd, quantize_cmd, report_cmd,
               verify_cmd)

__all__ = ["main"]

_COMMANDS = (inspect_cmd, list_cmd, consolidate_cmd, prune_cmd, verify_cmd, nemo_cmd, quantize_cmd, convert_cmd,
             report_cmd)


def build_parser() -> argparse.ArgumentParser:
    """The ``ckptio`` argument parser with every subcommand registered."""
    from .. import __version__

    parser = argparse.ArgumentParser(prog="ckptio", description="Inspect and manage PyTorch training checkpoints.")
    parser.add_argument("--version", action="version", version=f"ckptio {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in _COMMANDS:
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the ``ckptio`` command line; returns the exit code (1 with a one-line error for a bad checkpoint or path)."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except (CheckpointError, OSError) as exc:
        print(f"ckptio {args.command}: error: {exc}", file=sys.stderr)
        return 2

"""The ``ckptio`` command line: one module per subcommand."""

from __future__ import annotations

import argparse
import os
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
        code = int(args.run(args) or 0)
        sys.stdout.flush()  # a reader that left early (| head) is found here, not at the interpreter's exit
        return code
    except BrokenPipeError:
        return _reader_gone()
    except (CheckpointError, OSError) as exc:
        print(f"ckptio {args.command}: error: {exc}", file=sys.stderr)
        return 2


def _reader_gone() -> int:
    """The reader of the output left (``ckptio inspect … | head``): quiet, as Unix tools are, with the status of one
    killed by SIGPIPE; the output still buffered goes nowhere instead of failing again at exit."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no file descriptor behind sys.stdout (captured in a test): nothing is left to flush
        pass
    return 128 + 13  # SIGPIPE

"""``ckptio nemo pack DIR OUT.nemo`` / ``ckptio nemo unpack FILE DIR``: .nemo archives from the shell."""

from __future__ import annotations

import argparse
from pathlib import Path

from ._fmt import human_bytes
from .._progress import progress


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``ckptio nemo pack|unpack``."""
    p = sub.add_parser("nemo", help="pack or unpack a .nemo archive",
                       description="Pack a folder into a .nemo archive or unpack one, safely.")
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    pk = actions.add_parser("pack", help="tar a folder (model_config.yaml + weights + artifacts) into a .nemo")
    pk.add_argument("folder", help="an unpacked .nemo: model_config.yaml and model_weights.ckpt or model_weights/")
    pk.add_argument("out", help="the .nemo file to write (replaced atomically)")
    up = actions.add_parser("unpack", help="extract a .nemo into a new folder (refuses hostile archives)")
    up.add_argument("archive", help="the .nemo file (tar, optionally gzip)")
    up.add_argument("folder", help="a folder that does not exist yet")
    for sp in (pk, up):
        sp.add_argument("--no-progress", action="store_true", help="no progress (a bar on a terminal, lines otherwise)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Pack a folder into a ``.nemo`` archive or unpack one."""
    from ..formats.nemo import format as nemo

    if args.action == "pack":
        total = sum(p.stat().st_size for p in Path(args.folder).rglob("*") if p.is_file() and not p.is_symlink())
        bar = progress(total, "packing", enabled=not args.no_progress)
        try:
            out = nemo.pack(args.folder, args.out, progress=bar.update)
        finally:
            bar.close()
        print(f"packed {args.folder} into {out} ({human_bytes(Path(out).stat().st_size)})")
    else:
        bar = progress(Path(args.archive).stat().st_size, "unpacking", enabled=not args.no_progress)
        try:
            dest = nemo.unpack(args.archive, args.folder, progress=bar.update)
        finally:
            bar.close()
        files = [p for p in dest.rglob("*") if p.is_file()]
        print(f"unpacked {args.archive} into {dest} ({len(files)} files)")
    return 0

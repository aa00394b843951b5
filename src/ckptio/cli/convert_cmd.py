"""``ckptio convert SRC DST --to FORMAT``: model weights between checkpoint formats and namings."""

from __future__ import annotations

import argparse
import sys
import time

from ..convert import formats
from ..convert import naming as naming_mod
from ._fmt import human_bytes


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("convert", help="convert model weights between formats (and namings)",
                       description="Convert the model weights of a checkpoint into another format. The source "
                                   "format is detected: " + ", ".join(formats.FORMATS) + ".")
    p.add_argument("source", nargs="?", help="a step directory, HF/safetensors/DCP folder, .safetensors, .pt/.bin, "
                                             ".nemo or Lightning .ckpt")
    p.add_argument("dest", nargs="?", help="the new file or folder to write")
    p.add_argument("--to", choices=formats.FORMATS, help="target format")
    p.add_argument("--dtype", default=None, help="cast floating-point tensors, e.g. bfloat16")
    p.add_argument("--naming", default=None, help="apply a naming converter, e.g. llama-to-megatron")
    p.add_argument("--max-shard-size", default="5GB", help="largest file of an hf target (default 5GB)")
    p.add_argument("--list-namings", action="store_true", help="list the registered naming converters and exit")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.list_namings:
        for c in naming_mod.describe():
            print(f"{c['name']:<22} {c['rules']:>2} rules  needs {', '.join(c['needs']) or '-'}  {c['doc']}")
        return 0
    if not (args.source and args.dest and args.to):
        print("ckptio convert: error: SOURCE, DEST and --to are required", file=sys.stderr)
        return 2
    bars = []
    seen: dict[str, object] = {}

    def progress(kind: str, total: int):
        seen.update(kind=kind, total=total)
        if args.no_progress:
            return None
        from tqdm import tqdm

        bars.append(tqdm(total=total, unit="B", unit_scale=True, desc=f"{kind} -> {args.to}", file=sys.stderr))
        return bars[0].update

    start = time.perf_counter()
    try:
        out = formats.convert(args.source, args.dest, args.to, dtype=args.dtype, max_shard_size=args.max_shard_size,
                              naming=args.naming, progress=progress)
    finally:
        for bar in bars:
            bar.close()
    print(f"converted {args.source} ({seen['kind']}) to {out} ({args.to}{', ' + args.naming if args.naming else ''}"
          f"{', ' + args.dtype if args.dtype else ''}): {human_bytes(seen['total'])} in "
          f"{time.perf_counter() - start:.1f} s")
    return 0

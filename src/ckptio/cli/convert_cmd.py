"""``ckptio convert SRC DST --to FORMAT``: model weights between checkpoint formats and namings."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from ._fmt import human_bytes, print_json
from .._progress import progress


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``ckptio convert``."""
    p = sub.add_parser("convert", help="convert model weights between formats (and namings)",
                       description="Convert the model weights of a checkpoint into another format. The source "
                                   "format is detected from its layout; --list-formats lists the formats.")
    p.add_argument("source", nargs="?", help="a step directory, HF/safetensors/DCP folder, .safetensors, .pt/.bin, "
                                             ".nemo, Lightning .ckpt, Megatron or DeepSpeed checkpoint folder")
    p.add_argument("dest", nargs="?", help="the new file or folder to write")
    p.add_argument("--to", metavar="FORMAT", help=f"target format: {', '.join(TARGETS)} (--list-formats says what each is)")
    p.add_argument("--dtype", default=None, help="cast floating-point tensors: bfloat16 (bf16), float16 (fp16), float32 (fp32); "
                                               "a block FP8 release is dequantized in float32, then cast")
    p.add_argument("--config", metavar="CONFIG", default=None,
                   help="the model's config.json for the output (the source's own, if any, by default): a config.json, "
                        "a model folder holding one, or a model's name in the local Hugging Face cache (read offline)")
    p.add_argument("--naming", default=None, help="apply a naming converter, e.g. llama-to-megatron")
    p.add_argument("--max-shard-size", default="5GB", help="largest file of an hf target (default 5GB)")
    p.add_argument("--tp", type=int, default=None, help="megatron target: tensor-parallel size to split for (default 1)")
    p.add_argument("--pp", type=int, default=None, help="megatron target: pipeline stages to split into (default 1)")
    p.add_argument("--vpp", type=int, default=None,
                   help="megatron target: virtual pipeline stages (model chunks per pipeline stage; default none)")
    p.add_argument("--ep", type=int, default=None,
                   help="megatron target, legacy layout: expert-parallel ranks to split a mixture of experts' experts "
                        "over (a rank folder each; default 1)")
    p.add_argument("--megatron-optimizer", choices=["plain", "distributed"], default=None,
                   help="megatron target from a checkpoint with Adam's state: the optimizer megatron-core will load "
                        "it into (plain: FP32Optimizer, the default; distributed: DistributedOptimizer, "
                        "fully_reshardable format)")
    p.add_argument("--vocab-divisible-by", type=int, default=None, metavar="N",
                   help="megatron target: pad the vocabulary to a multiple of N x TP rows, as the run's "
                        "--make-vocab-size-divisible-by (default 128)")
    p.add_argument("--like", metavar="RUN_DIR", default=None,
                   help="megatron target: take TP, PP and the vocabulary padding from an existing Megatron run's "
                        "saved arguments (its model sizes must match)")
    p.add_argument("--megatron-layout", choices=("dist", "legacy"), default="dist",
                   help="megatron target: Megatron-Core torch_dist (default) or Megatron-LM legacy mp_rank_* files")
    p.add_argument("--list-namings", action="store_true", help="list the registered naming converters and exit")
    p.add_argument("--list-formats", action="store_true", help="list the registered formats and exit")
    p.add_argument("--no-progress", action="store_true", help="no progress (a bar on a terminal, lines otherwise)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(run=run)


TARGETS = ("step_dir", "nemo", "deepspeed-universal", "megatron", "dcp", "safetensors", "hf", "lightning", "torch")
"""The formats ckptio writes, for ``--to``'s help: the registry's writable ones (``tests/test_cli.py`` holds them
equal), written out so that ``--help`` does not import every format, torch included."""


def _megatron_flags(args: argparse.Namespace) -> list[str]:
    """The options given that apply to ``--to megatron`` only."""
    return [flag for flag, value in (("--tp", args.tp), ("--pp", args.pp), ("--vpp", args.vpp), ("--ep", args.ep),
                                     ("--megatron-optimizer", args.megatron_optimizer), ("--like", args.like),
                                     ("--vocab-divisible-by", args.vocab_divisible_by)) if value is not None]


def run(args: argparse.Namespace) -> int:
    """Convert a checkpoint's model weights to another format (or list the formats)."""
    from ..convert import formats
    from ..formats import naming as naming_mod
    from ..formats import registry

    if args.list_formats:
        for name in registry.names():
            fmt = registry.get(name)
            can = "/".join(w for w, ok in (("read", fmt.readable), ("write", fmt.writable)) if ok)
            print(f"{name:<12} {can:<11} {fmt.summary}")
        return 0
    if args.list_namings:
        for c in naming_mod.describe():
            print(f"{c['name']:<22} {c['rules']:>2} rules  needs {', '.join(c['needs']) or '-'}  {c['doc']}")
        return 0
    if not (args.source and args.dest and args.to):
        print("ckptio convert: error: SOURCE, DEST and --to are required", file=sys.stderr)
        return 2
    if args.to not in formats.FORMATS:
        print(f"ckptio convert: error: --to {args.to!r}: not a format ckptio writes; use one of "
              f"{', '.join(formats.FORMATS)}", file=sys.stderr)
        return 2
    megatron_only = _megatron_flags(args)
    if megatron_only and args.to != "megatron":
        print(f"ckptio convert: error: {', '.join(megatron_only)} only apply to --to megatron", file=sys.stderr)
        return 2
    bars = []
    seen: dict[str, Any] = {}

    def on_open(kind: str, total: int):
        seen.update(kind=kind, total=total)
        bars.append(progress(total, f"{kind} -> {args.to}", enabled=not args.no_progress))
        return bars[0].update

    start = time.perf_counter()
    try:
        out = formats.convert(args.source, args.dest, args.to, dtype=args.dtype, max_shard_size=args.max_shard_size,
                              naming=args.naming, progress=on_open,
                              options={"tp": args.tp, "pp": args.pp, "vpp": args.vpp, "ep": args.ep,
                                       "optimizer": args.megatron_optimizer, "layout": args.megatron_layout,
                                       "divisible_by": args.vocab_divisible_by, "like": args.like},
                              config=args.config)
    finally:
        for bar in bars:
            bar.close()
    seconds = time.perf_counter() - start
    warnings = _missing_config(args, out)
    for warning in warnings:
        print(f"ckptio convert: warning: {warning}", file=sys.stderr)
    if args.json:
        print_json({"source": str(args.source), "source_format": seen["kind"], "out": str(out), "format": args.to,
                    "naming": args.naming, "dtype": args.dtype, "bytes": seen["total"], "seconds": round(seconds, 3),
                    "config": args.config, "warnings": warnings})
        return 0
    print(f"converted {args.source} ({seen['kind']}) to {out} ({args.to}{', ' + args.naming if args.naming else ''}"
          f"{', ' + args.dtype if args.dtype else ''}): {human_bytes(seen['total'])} in {seconds:.1f} s")
    return 0


def _missing_config(args: argparse.Namespace, out: Any) -> list[str]:
    """A Hugging Face bundle written without a ``config.json``: what it lacks and what to pass (a folder here;
    one in a bucket is not looked into)."""
    from pathlib import Path

    from ..convert.model_config import MISSING_CONFIG
    from ..formats import registry
    from ..storage import url_scheme

    if not registry.get(args.to).needs_config or url_scheme(str(out)) is not None:
        return []
    if (Path(out) / "config.json").is_file():
        return []
    return [MISSING_CONFIG.format(out=out, source=args.source)]

"""``ckptio consolidate CHECKPOINT``: export a saved model as a Hugging Face bundle, offline."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
import uuid
from pathlib import Path

from ..errors import CheckpointError, CheckpointNotFoundError
from ..formats import hf_bundle
from ..manifest import MANIFEST_NAME, read_manifest
from ..storage import fsync_dir, fsync_tree
from ._fmt import human_bytes


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "consolidate", help="write a Hugging Face bundle from sharded safetensors or DCP model files",
        description="Stream a saved model (sharded safetensors or DCP) into model-K-of-N.safetensors files with "
                    "an index, plus config and tokenizer files, loadable by transformers.from_pretrained. "
                    "Memory stays bounded by the largest tensor.")
    p.add_argument("checkpoint", help="a step directory, or a model folder (safetensors shards or DCP)")
    p.add_argument("--out", help="output folder (default: <step dir>/model/consolidated)")
    p.add_argument("--max-shard-size", default=hf_bundle.DEFAULT_MAX_SHARD_SIZE,
                   help="largest output file, e.g. 5GB (default), 500MB, 2GiB")
    p.add_argument("--dtype", default=None, help="cast floating-point tensors, e.g. bfloat16")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=run)


def _model_folder(path: Path) -> Path:
    if (path / MANIFEST_NAME).is_file():
        manifest = read_manifest(path)
        entry = manifest.states.get("model")
        if entry is None:
            raise CheckpointError(f"{path} holds no model state")
        if entry.format == "peft":
            raise CheckpointError(f"{path} is a PEFT checkpoint: its model folder already is a PEFT adapter folder")
        return path / entry.path
    if not path.is_dir():
        raise CheckpointNotFoundError(f"{path}: no such directory")
    return path


def run(args: argparse.Namespace) -> int:
    src = _model_folder(Path(args.checkpoint))
    out = Path(args.out) if args.out else src / "consolidated"
    if out.exists() and any(out.iterdir()) and not args.overwrite:
        raise CheckpointError(f"{out} exists and is not empty; pass --overwrite to replace it")
    source, plan = hf_bundle.prepare(src, max_shard_size=args.max_shard_size, dtype=args.dtype)
    if not (src / "config.json").is_file():
        print(f"ckptio consolidate: warning: {src} has no config.json; transformers needs one beside the weights",
              file=sys.stderr)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    start = time.perf_counter()
    bar = None
    if not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=plan.total_size, unit="B", unit_scale=True, desc="consolidating", file=sys.stderr)
    try:
        hf_bundle.write_bundle(source, plan, tmp, progress=bar.update if bar else None)
        fsync_tree(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.rename(tmp, out)
        fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if bar is not None:
            bar.close()
    print(f"wrote {len(plan.infos)} tensors, {human_bytes(plan.total_size)} in {len(plan.files)} file(s) to {out} "
          f"in {time.perf_counter() - start:.1f} s")
    print(f"load it with: AutoModelForCausalLM.from_pretrained({str(out)!r})")
    return 0

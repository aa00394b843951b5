"""``ckptio consolidate CHECKPOINT``: export a saved model as a Hugging Face bundle, offline."""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from pathlib import Path

from ..errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError
from ..engine.layout import TMP_PREFIX
from ..engine.manifest import MANIFEST_NAME, check_files, read_manifest
from ..storage import LocalFolderWriter
from ..storage.checksum import file_checksum
from ..storage.confined import Folder
from ..storage.lock import DirectoryLock
from ..storage.posix import copy_on_write
from ._fmt import human_bytes, print_json
from .._progress import progress

DEFAULT_MAX_SHARD_SIZE = "5GB"


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``ckptio consolidate``."""
    p = sub.add_parser(
        "consolidate", help="write a Hugging Face bundle from sharded safetensors or DCP model files",
        description="Stream a saved model (sharded safetensors or DCP) into model-K-of-N.safetensors files with "
                    "an index, plus config and tokenizer files, loadable by transformers.from_pretrained. "
                    "Memory stays bounded by the largest tensor.")
    p.add_argument("checkpoint", help="a step directory, or a model folder (safetensors shards or DCP)")
    p.add_argument("--out", help="output folder (default: <step dir>/model/consolidated)")
    p.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD_SIZE,
                   help="largest output file, e.g. 5GB (default), 500MB, 2GiB")
    p.add_argument("--dtype", default=None, help="cast floating-point tensors, e.g. bfloat16")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    p.add_argument("--no-progress", action="store_true", help="no progress (a bar on a terminal, lines otherwise)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--force", action="store_true",
                   help="write into a checkpoint whose folder lock is held by a process that is gone")
    p.set_defaults(run=run)


def _model_folder(path: Path) -> tuple[Path, Path | None]:
    """(model folder, step directory or ``None``) of what the user named."""
    from ..formats import registry

    if (path / MANIFEST_NAME).is_file():
        manifest = read_manifest(path)
        entry = manifest.states.get("model")
        if entry is None:
            raise CheckpointError(f"{path} holds no model state")
        if not registry.get(entry.format).full_model:
            raise CheckpointError(f"{path} holds a {entry.format} model folder, not a whole model to consolidate "
                                  "(a PEFT adapter folder already is what peft loads)")
        Folder(path).sub(entry.path)  # a real folder inside the step directory, not a link
        return path / entry.path, path
    if not path.is_dir():
        raise CheckpointNotFoundError(f"{path}: no such directory")
    return path, None


def run(args: argparse.Namespace) -> int:
    """Write a Hugging Face bundle from a step's sharded model files."""
    from ..formats.safetensors import hf_bundle

    from ..storage import resolve_pointer, url_scheme

    if url_scheme(args.checkpoint) is not None:
        args.checkpoint = resolve_pointer(args.checkpoint)  # .../LATEST in a bucket: the step it names
        return _run_remote(args)
    src, step_dir = _model_folder(Path(args.checkpoint))
    out = Path(args.out) if args.out else src / "consolidated"
    if out.exists() and any(out.iterdir()) and not args.overwrite:
        raise CheckpointError(f"{out} exists and is not empty; pass --overwrite to replace it")
    source, plan = hf_bundle.prepare(src, max_shard_size=args.max_shard_size, dtype=args.dtype)
    if not (src / "config.json").is_file():
        print(f"ckptio consolidate: warning: {src} has no config.json; transformers needs one beside the weights",
              file=sys.stderr)
    start = time.perf_counter()
    bar = progress(plan.total_size, "consolidating", enabled=not args.no_progress)
    try:
        inside = step_dir is not None and out.resolve().is_relative_to(step_dir.resolve())
        if inside:
            _into_checkpoint(step_dir, out, source, plan, bar, force=args.force)  # type: ignore[arg-type]
        else:
            _into_folder(out, source, plan, bar)
    finally:
        bar.close()
    seconds = time.perf_counter() - start
    if args.json:
        print_json({"out": str(out), "tensors": len(plan.infos), "bytes": plan.total_size, "files": len(plan.files),
                    "seconds": round(seconds, 3), "into_checkpoint": inside})
        return 0
    print(f"wrote {len(plan.infos)} tensors, {human_bytes(plan.total_size)} in {len(plan.files)} file(s) to {out} "
          f"in {seconds:.1f} s")
    print(f"load it with: AutoModelForCausalLM.from_pretrained({str(out)!r})")
    return 0


def _run_remote(args: argparse.Namespace) -> int:
    """A step directory in a bucket: the bundle into the checkpoint, or into a local ``--out`` folder."""
    from ..formats.safetensors import hf_bundle
    from .consolidate_remote import consolidate_in_bucket, model_folder

    _, step, model_rel = model_folder(args.checkpoint)
    if args.out and "://" in args.out:
        raise CheckpointError("--out must be a local folder; without it the bundle is added to the checkpoint")
    out = Path(args.out) if args.out else None
    if out is not None and out.exists() and any(out.iterdir()) and not args.overwrite:
        raise CheckpointError(f"{out} exists and is not empty; pass --overwrite to replace it")
    source, plan = hf_bundle.prepare(step.sub(model_rel), max_shard_size=args.max_shard_size, dtype=args.dtype)
    start = time.perf_counter()
    bar = progress(plan.total_size, "consolidating", enabled=not args.no_progress)
    try:
        if out is None:
            where = consolidate_in_bucket(args.checkpoint, source, plan, bar, force=args.force)
        else:
            _into_folder(out, source, plan, bar)
            where = str(out)
    finally:
        bar.close()
        source.close()
    seconds = time.perf_counter() - start
    if args.json:
        print_json({"out": where, "tensors": len(plan.infos), "bytes": plan.total_size, "files": len(plan.files),
                    "seconds": round(seconds, 3), "into_checkpoint": out is None})
        return 0
    print(f"wrote {len(plan.infos)} tensors, {human_bytes(plan.total_size)} in {len(plan.files)} file(s) to {where} "
          f"in {seconds:.1f} s")
    return 0


def _into_folder(out: Path, source, plan, bar) -> None:
    from ..formats.safetensors import hf_bundle

    out.parent.mkdir(parents=True, exist_ok=True)
    writer = LocalFolderWriter.create(out)
    try:
        hf_bundle.write_bundle(source, plan, writer, "", progress=bar.update)
        writer.commit()  # replaces an existing folder (--overwrite) in one atomic exchange
    except BaseException:
        writer.abort()
        raise


def _into_checkpoint(step_dir: Path, out: Path, source, plan, bar, *, force: bool) -> None:
    """Add the bundle to a committed checkpoint as a new version of it: never half-written, manifest in step.

    Under the folder's lock, a copy of the step directory is made beside it (hard links: no bytes are
    copied), the bundle is written into the copy and checksummed, a new manifest listing it is written,
    and the copy replaces the original in one atomic exchange. A crash leaves the old checkpoint or the
    new one; the original files are never written to.
    """
    from ..formats.safetensors import hf_bundle

    root = step_dir.parent
    lock = DirectoryLock(root)
    lock.acquire(force=force)
    if lock.forced_over:
        print(f"warning: going ahead although the lock names {lock.forced_over} (--force; that holder is gone)",
              file=sys.stderr)
    stage = root / f"{TMP_PREFIX}{step_dir.name}-consolidate-{uuid.uuid4().hex[:8]}"
    writer = LocalFolderWriter(step_dir, stage)
    try:
        manifest = read_manifest(step_dir)
        problems = check_files(step_dir, manifest)
        if problems:
            raise CheckpointCorruptError(f"{step_dir} is damaged, not rewriting it: " + "; ".join(problems[:3]))
        rel_out = out.relative_to(step_dir).as_posix()

        gone = [f.strip("/") + "/" for f in manifest.pruned_paths.values()]  # what an interrupted pruning left

        def skip(rel: str) -> bool:
            return rel == MANIFEST_NAME or rel == rel_out or rel.startswith(rel_out + "/") or \
                rel.startswith(".trash-") or any((rel + "/").startswith(f) for f in gone)

        copy_on_write(step_dir, stage, skip=skip)
        written = hf_bundle.write_bundle(source, plan, writer, rel_out, progress=bar.update)
        files = writer.files()
        sums = {k: v for k, v in manifest.checksums.items() if k in files and not skip(k)}
        sums.update(written)
        for rel in files:
            if rel not in sums:
                sums[rel] = file_checksum(stage / rel)
        manifest.files, manifest.checksums = files, sums
        writer.commit((MANIFEST_NAME, manifest.to_json().encode()))
    except BaseException:
        writer.abort()
        raise
    finally:
        lock.release()

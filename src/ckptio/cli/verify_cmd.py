"""``ckptio verify PATH``: check every file of a checkpoint (or of every checkpoint in a folder)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..errors import CheckpointError, CheckpointNotFoundError
from ..engine.layout import scan
from ..formats import registry
from ..engine.manifest import MANIFEST_NAME, check_files, read_manifest
from ..storage import open_storage
from ..storage.confined import as_folder
from .._progress import progress


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``ckptio verify``."""
    p = sub.add_parser("verify", help="check sizes and checksums of every file; exit 1 if anything is wrong",
                       description="Verify a step directory, or every step directory of a checkpoint folder, "
                                   "against the sizes and checksums recorded in its manifest. A damaged file that "
                                   "several steps share is named in each step that uses it. In a bucket, a step "
                                   "retention removed whose objects later steps still use is HELD, not damage.")
    p.add_argument("path", help="a step directory or a checkpoint folder")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress (a bar on a terminal, lines otherwise)")
    p.set_defaults(run=run)


def _verify_one(step_dir: Path, show_progress: bool) -> list[str]:
    """Every byte against the manifest, then the structure of each state's format (paths, coverage)."""
    try:
        manifest = read_manifest(step_dir)
    except CheckpointError as exc:
        return [str(exc)]
    bar = progress(manifest.total_bytes, f"verifying {step_dir.name}", enabled=show_progress)
    try:
        problems = check_files(step_dir, manifest, checksums=True, progress=bar.update)
    finally:
        bar.close()
    for name, entry in sorted(manifest.states.items()):
        if entry.kind == "object":
            continue
        try:
            fmt = registry.get(entry.format)
            if fmt.has_index:
                fmt.index(as_folder(step_dir).sub(entry.path))
        except CheckpointError as exc:
            problems.append(f"state {name!r}: {exc}")
    return problems


def run(args: argparse.Namespace) -> int:
    """Check a step directory (or every one in a folder) against its manifest; exit 1 on any problem."""
    storage = open_storage(args.path)  # a local folder or s3://bucket/prefix
    path = storage.root
    try:
        is_step = storage.folder().kind(MANIFEST_NAME) == "file"
    except CheckpointNotFoundError:
        raise CheckpointNotFoundError(f"{path}: no such directory") from None
    held: dict[str, str | None] = {}
    if is_step:
        targets = [path]
    else:
        entries = scan(storage)
        targets = [e.path for e in entries if not e.held_for]
        held = {str(e.path): e.problem for e in entries if e.held_for}  # files other steps use: checked with them
        if not targets:
            raise CheckpointNotFoundError(f"{path} holds no checkpoints")
    report = {str(t): _verify_one(t, not args.no_progress and not args.json) for t in targets}
    if args.json:
        print(json.dumps({"ok": not any(report.values()), "checkpoints": report, "held": held}, indent=2))
    else:
        for target, why in held.items():
            print(f"HELD {target}: {why}")
        for target, problems in report.items():
            if problems:
                print(f"BAD  {target}")
                for line in problems:
                    print(f"     {line}")
            else:
                print(f"OK   {target}")
        bad = sum(1 for p in report.values() if p)
        print(f"{len(report) - bad} good, {bad} bad", file=sys.stderr if bad else sys.stdout)
    return 1 if any(report.values()) else 0

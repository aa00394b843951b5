"""Describe checkpoints without loading their tensors: what ``ckptio inspect`` and ``list`` print."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import CheckpointError, CheckpointNotFoundError
from ..formats import registry
from ..formats.common import TensorSummary, summarize_index  # noqa: F401  (re-exported for callers)
from .layout import BEST, LATEST, pointer_target, scan
from .manifest import held_by
from ..storage import open_storage


def inspect_path(path: str | Path) -> dict[str, Any]:
    """A JSON-ready description of any checkpoint ckptio reads (a step directory, a folder or file of any
    registered format), without loading its tensors."""
    from ..storage import url_scheme

    if url_scheme(str(path)) is not None:  # a step directory in a bucket: described from its manifest
        from .manifest import MANIFEST_NAME
        from ..storage.confined import as_folder

        if as_folder(str(path)).kind(MANIFEST_NAME) is None:
            raise CheckpointNotFoundError(f"{path}: not a ckptio step directory (no {MANIFEST_NAME}); inspect reads "
                                          f"step directories in a bucket — 'ckptio list' shows them")
        return registry.get("step_dir").describe(str(path))  # type: ignore[arg-type]
    path = Path(path)
    return registry.detect(path).describe(path)


def list_checkpoints(checkpoint_dir: str | Path) -> dict[str, Any]:
    """Every directory of a checkpoint folder (local or ``s3://``) with its state, newest committed step last."""
    storage = open_storage(checkpoint_dir)
    root = storage.root
    try:
        storage.folder().listdir()
    except CheckpointNotFoundError:
        raise CheckpointNotFoundError(f"{root}: no such checkpoint folder") from None
    problems: list[str] = []

    def pointer(name: str) -> str | None:
        try:
            target = pointer_target(storage, name)
        except CheckpointError as exc:  # reported, and the listing goes on
            problems.append(str(exc))
            return None
        return None if target is None else target.name

    latest = pointer(LATEST)
    best = pointer(BEST)
    entries = scan(storage)
    newest = max((e for e in entries if e.committed), key=lambda e: e.step or 0, default=None)
    referenced = held_by(e.manifest.shared for e in entries if e.manifest)  # a bucket's files other steps refer to
    rows = []
    for e in entries:
        m = e.manifest
        owned, shared = m.ownership(storage.folder(e.name), referenced.get(e.name, set())) if m else (0, 0)
        rows.append({
            "owned_bytes": owned,
            "shared_bytes": shared,
            "name": e.name,
            "step": m.step if m else None,
            "epoch": m.epoch if m else None,
            "metrics": m.metrics if m else {},
            "bytes": m.total_bytes if m else _du(storage, e.name),
            "committed": e.committed,
            "pruned": sorted(m.pruned) if m else [],  # states removed after the save (keep_optimizer_latest)
            "problem": e.problem,
            "latest": e.name == latest,
            "best": e.name == best,
            # never removed by retention: the newest committed checkpoint and the best one
            "protected": e.committed and (e.name == best or (newest is not None and e.name == newest.name)),
        })
    return {"checkpoint_dir": str(root), "latest": latest, "best": best, "checkpoints": rows, "problems": problems}


def _du(storage: Any, name: str) -> int:
    try:
        return sum(e.size for _, e in storage.folder(name).walk_files() if e.kind == "file")
    except CheckpointError:
        return 0

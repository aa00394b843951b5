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
    run = _as_run(path)
    return run if run is not None else registry.detect(path).describe(path)


def _as_run(path: Path) -> dict[str, Any] | None:
    """A checkpoint folder holding checkpoints of another tool (a DeepSpeed run, perhaps with ckptio's saves beside
    them), described as a restore sees it: the checkpoint an automatic resume takes (the newest usable ckptio one,
    else the newest of the run it continues), described, with ``resume``: its name, why, and what else is there.
    ``None`` for anything else (one checkpoint, a folder of ckptio's alone, a folder no resume takes anything
    from)."""
    from ..adopt.foreign import foreign_run
    from ..adopt.survey import foreign_checkpoints
    from .layout import restore_candidates
    from .manifest import MANIFEST_NAME

    if not path.is_dir() or path.is_symlink() or (path / MANIFEST_NAME).exists():
        return None
    committed = [e for e in scan(path) if e.committed]
    foreign = foreign_checkpoints(path, skip={e.name for e in committed})
    if not foreign:  # ckptio's own folder: 'ckptio list' shows its steps (the error says so)
        return None
    if committed:
        take = restore_candidates(path, None)[0]  # the restore's own choice
        info, takes, why = registry.detect(take).describe(take), take.name, "the newest usable ckptio checkpoint"
    else:
        run, _ = foreign_run(path)
        if run is None:
            return None
        info = registry.detect(run).describe(run)
        takes = next((f.name for f in foreign if f.resumed), info.get("checkpoint", run.name))
        why = "no ckptio checkpoint here: the newest checkpoint of the run"
    others = [{"name": e.name, "label": "NeMo AutoModel step" if e.adopted else "ckptio checkpoint", "step": e.step}
              for e in committed if e.name != takes]
    others += [{"name": f.name, "label": f.label, "step": f.step} for f in foreign if f.name != takes]
    info["resume"] = {"takes": takes, "why": why, "others": others}
    return info


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
    _add_foreign(root, rows, any(e.committed for e in entries))
    return {"checkpoint_dir": str(root), "latest": latest, "best": best, "checkpoints": rows, "problems": problems}


def _add_foreign(root: Any, rows: list[dict[str, Any]], own: bool) -> None:
    """Each checkpoint of another tool in ``root`` that a restore reads (a DeepSpeed ``global_stepN/``, an HF Trainer
    ``checkpoint-N/``, a Megatron ``iter_N/``, a Lightning ``.ckpt``), described in its row (``foreign``), as the
    restore's own detection sees it (:mod:`ckptio.adopt.survey`); the automatic resume takes none of them when the
    folder holds a ckptio checkpoint (``own``)."""
    from ..adopt.survey import foreign_checkpoints

    by_name = {r["name"]: r for r in rows}
    for found in foreign_checkpoints(root, skip={r["name"] for r in rows if r["committed"]}):
        found.resumed = found.resumed and not own
        row = by_name.get(found.name)
        if row is None:  # a file (a Lightning .ckpt): scan lists folders only
            row = {"owned_bytes": 0, "shared_bytes": 0, "name": found.name, "epoch": None, "metrics": {},
                   "bytes": (root / found.name).stat().st_size, "committed": False, "pruned": [], "latest": False,
                   "best": False, "protected": False}
            rows.append(row)
        row.update(step=found.step, problem=None if found.problem is None else found.status,
                   foreign=found.as_dict())


def _du(storage: Any, name: str) -> int:
    try:
        return sum(e.size for _, e in storage.folder(name).walk_files() if e.kind == "file")
    except CheckpointError:
        return 0

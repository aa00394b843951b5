"""Optimizer state where it is used: ``keep_optimizer_latest=N`` keeps it in the newest ``N`` checkpoints only.

Only the newest checkpoint is ever resumed from; the older ones retention keeps (the best ``top_k``, milestones)
serve their weights. Past the newest ``N``, a checkpoint's optimizer state (and any state stored inside its
folder) is removed:

1. its manifest is replaced whole (written aside and renamed over it; one PUT in a bucket) by one without those
   states and files, which names them under ``pruned`` with the reason and keeps, under ``pruned_groups``, each
   parameter group's hyper-parameters (``lr``, ``initial_lr``, betas...: what a scheduler restored with the step
   needs to continue from);
2. then their files are removed.

A kill between the two leaves files no manifest refers to, which the next process's first pass (a save's
retention, or ``ckptio prune``) removes; never a manifest that refers to a removed file. The checkpoint still loads weights-only, is
consolidated to a Hugging Face bundle and verifies; a full resume from it is refused naming what was pruned and
how to load the rest (:func:`pruned_message`): asked for explicitly, ``optim`` then restores the hyper-parameters
with the moments starting from zero (steps pruned by earlier versions, without ``pruned_groups``, cannot).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import TYPE_CHECKING, Any, Iterable

from .. import _faults
from .manifest import MANIFEST_NAME, Manifest

if TYPE_CHECKING:
    from ..storage.base import Storage
    from .layout import CheckpointEntry

__all__ = ["prune_optimizers", "prunable", "pruned_message", "AFTER_MANIFEST"]

log = logging.getLogger("ckptio")

AFTER_MANIFEST = "retention.optimizer_after_manifest"
"""The fault point between the manifest's replacement and the removal of the pruned files."""


def _under(rel: str, folder: str) -> bool:
    return rel == folder or rel.startswith(folder.rstrip("/") + "/")


def prunable(manifest: Manifest) -> list[str]:
    """The states removed from ``manifest``: each optimizer state, and every state stored inside an optimizer's
    folder (NeMo AutoModel keeps the LR scheduler there). Empty when a model state lies inside one (nothing is
    removed then) or a state's folder is the step directory itself."""
    folders = [s.path for s in manifest.states.values() if s.kind == "optimizer"]
    if any(f.strip("/") in ("", ".") for f in folders):
        return []
    names = [name for name, s in manifest.states.items() if any(_under(s.path, f) for f in folders)]
    if any(manifest.states[n].kind == "model" for n in names):
        return []
    return names


def pruned_message(step_dir: object, manifest: Manifest, key: str) -> str:
    """Why ``key`` cannot be restored from ``step_dir`` (its state was pruned), and what to do instead."""
    kept = sorted(manifest.states)
    if key in manifest.pruned_groups:
        then = ("the optimizer's hyper-parameters (each group's lr...) are restored, its moments start from zero")
        kept = sorted(kept + [key])
    else:
        then = "the optimizer is left as it is"
    return (f"{step_dir}: its {key!r} state was removed ({manifest.pruned[key]}): only the newest checkpoints keep "
            f"the optimizer state. Resume from a newer checkpoint, or load what it still holds with "
            f"restore({str(step_dir)!r}, states={kept!r}) ({then})")


def prune_optimizers(storage: "Storage", entries: Iterable["CheckpointEntry"], newest: int, *,
                     keep: frozenset[str] = frozenset()) -> list[str]:
    """Rank 0, after a commit: remove the optimizer state of every committed checkpoint but the ``newest`` by step
    and those named in ``keep`` (the one just written, ``LATEST``'s), and, at the first pass of this process over
    ``storage``, what an interrupted pass left. Returns the names of the checkpoints pruned now."""
    committed = sorted((e for e in entries if e.committed and not e.adopted and e.manifest is not None),
                       key=lambda e: (e.step or 0, e.name))
    spared = {e.name for e in committed[-newest:]} | set(keep) if newest > 0 else set(keep)
    sweep = str(storage.root) not in _swept
    _swept.add(str(storage.root))
    pruned: list[str] = []
    for entry in committed:
        manifest = entry.manifest
        assert manifest is not None
        if entry.name in spared:
            continue
        names = prunable(manifest)
        if names:
            _prune(storage, entry.name, manifest, names, f"keep_optimizer_latest={newest}, at step "
                                                          f"{committed[-1].step}")
            pruned.append(entry.name)
        if sweep:
            for folder in _leftovers(manifest):
                storage.remove_part(entry.name, folder)  # what a pass killed after its manifest left
    return pruned


_swept: set[str] = set()
"""The folders whose leftovers this process has collected: once is enough (a kill leaves them in another process's
pass), and in a bucket each look is a request per kept checkpoint."""


def _leftovers(manifest: Manifest) -> list[str]:
    """The folders of ``manifest``'s pruned states that hold nothing it still refers to (a folder overlapping a kept
    state or file is never removed, whatever the manifest says)."""
    kept = [s.path for s in manifest.states.values()] + list(manifest.files)
    return sorted({f for f in manifest.pruned_paths.values() if f.strip("/") not in ("", ".")
                   and not any(_under(k, f) or _under(f, k) for k in kept)})


def _prune(storage: "Storage", name: str, manifest: Manifest, names: list[str], why: str) -> None:
    folders = sorted({manifest.states[n].path for n in names})
    gone = [rel for rel in manifest.files if any(_under(rel, f) for f in folders)]
    groups = {n: kept for n in names if manifest.states[n].kind == "optimizer"
              for kept in [_groups(storage, name, manifest, n)] if kept}
    slim = dataclasses.replace(
        manifest, states={k: v for k, v in manifest.states.items() if k not in names},
        files={k: v for k, v in manifest.files.items() if k not in gone},
        checksums={k: v for k, v in manifest.checksums.items() if k not in gone},
        pruned={**manifest.pruned, **{n: why for n in names}},
        pruned_paths={**manifest.pruned_paths, **{n: manifest.states[n].path for n in names}},
        pruned_groups={**manifest.pruned_groups, **groups})
    storage.write_small(f"{name}/{MANIFEST_NAME}", slim.to_json().encode())
    _faults.point(AFTER_MANIFEST)
    for folder in folders:
        storage.remove_part(name, folder)
    log.info("Removed the optimizer state of checkpoint %s (%s; %d file(s), %.1f MB): it keeps its weights",
             name, why, len(gone), sum(manifest.files[r] for r in gone) / 1e6)


_GROUPS = "optim.param_groups."


def _groups(storage: "Storage", name: str, manifest: Manifest, key: str) -> list[dict[str, Any]]:
    """The parameter groups of the optimizer state ``key`` of step ``name``, as :attr:`Manifest.pruned_groups` keeps
    them (empty, with a warning, when they cannot be read: the step is then pruned as earlier versions did)."""
    from ..errors import CheckpointError
    from ..formats import registry

    entry = manifest.states[key]
    try:
        values = registry.get(entry.format).state_values(storage.folder(name).sub(entry.path))
    except (CheckpointError, OSError) as exc:
        log.warning("%s: the hyper-parameters of its %r state could not be read (%s); it is pruned without them, "
                    "so a resume from it restarts the optimizer's schedule", name, key, exc)
        return []
    by_param: dict[str, dict[str, Any]] = {}
    for k, v in values.items():
        fqn, _, hp = k[len(_GROUPS):].rpartition(".") if k.startswith(_GROUPS) else ("", "", "")
        value = _plain(v)
        if fqn and value is not _SKIP:
            by_param.setdefault(fqn, {})[hp] = value
    groups: dict[str, dict[str, Any]] = {}
    for fqn, hyper in by_param.items():  # parameters with the same hyper-parameters share a group
        groups.setdefault(json.dumps(hyper, sort_keys=True), {"params": [], "hyper": hyper})["params"].append(fqn)
    return list(groups.values())


_SKIP = object()


def _plain(value: Any) -> Any:
    """``value`` as JSON keeps it: a number, string, bool or ``None``, a list of them (a tuple such as ``betas``), a
    one-element tensor as its number; :data:`_SKIP` for anything else (left to the optimizer's own default)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        items = [_plain(v) for v in value]
        return _SKIP if any(i is _SKIP for i in items) else items
    item = getattr(value, "item", None)
    if callable(item) and getattr(value, "numel", lambda: 0)() == 1:
        return _plain(item())
    return _SKIP

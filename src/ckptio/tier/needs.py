"""Which files of a snapshot one rank reads to restore: what its node must hold before the restore starts.

A memory snapshot is spread over the nodes' memory, so a restore first brings to each node the files its ranks
will read, and no others: a rank reads the side files (manifest, chunk indexes, ``values.json``), the small
states that are its own (or shared), and, of the model's and the optimizer's shard files, those holding a piece
of the part of a tensor it holds: the chunk index says which, for the live layout, whatever the layout that
saved them (so a restore onto another number of ranks moves what the new layout needs, not everything).

Two passes, because the second needs the chunk indexes the first brings: :func:`side_files` (known from the
manifest alone) and :func:`shard_files`. Where a folder has no chunk index, or a key is unknown to the live
objects, every shard file of that folder is needed: more is moved, nothing is missed. A file that was not
brought and is read all the same fails its checksum (the restore reads with ``verify: full``), never loads.
"""

from __future__ import annotations

from typing import Any

from ..formats.safetensors import chunk_index
from ..formats import registry
from ..engine.manifest import Manifest
from ..engine.plan import local_view
from ..storage.confined import Folder
from ..storage.parse import parsing

__all__ = ["side_files", "shard_files", "shard_folders"]

_OPTIM = "optim."


def shard_folders(manifest: Manifest) -> dict[str, list[str]]:
    """The model's and the optimizer's shard files, by state name (relative to the snapshot)."""
    out: dict[str, list[str]] = {}
    for name, entry in manifest.states.items():
        if entry.kind in ("model", "optimizer"):
            prefix = f"{entry.path}/"
            out[name] = [rel for rel in manifest.files if rel.startswith(prefix) and rel.endswith(".safetensors")
                         and "/" not in rel[len(prefix):]]
    return out


def side_files(manifest: Manifest, rank: int, world: int) -> set[str]:
    """Every file of the snapshot rank ``rank`` of ``world`` reads that is not a shard file."""
    shards = {rel for files in shard_folders(manifest).values() for rel in files}
    per_rank: set[str] = set()
    mine: set[str] = set()
    for entry in manifest.states.values():
        if not entry.per_rank:
            continue
        files = [entry.file_of(r) for r in range(manifest.world_size)]
        per_rank.update(files)
        if entry.identical:
            mine.add(files[min(rank, manifest.world_size - 1)])
        elif rank < manifest.world_size:
            mine.add(files[rank])
    return {rel for rel in manifest.files if rel not in shards and rel not in per_rank} | (mine & set(manifest.files))


def shard_files(view: Folder, manifest: Manifest, tracked: Any) -> set[str]:
    """The shard files holding a piece of what this rank holds, read from the chunk indexes under ``view``."""
    out: set[str] = set()
    for name, files in shard_folders(manifest).items():
        entry = manifest.states[name]
        folder = view.sub(entry.path)
        with parsing(folder.display(chunk_index.INDEX_NAME), "chunk index"):
            index = chunk_index.read(folder) if entry.format == "safetensors" and files else None
        targets = _targets(name, entry, folder, tracked) if index is not None else None
        if index is None or targets is None:
            out.update(files)
            continue
        prefix = f"{entry.path}/"
        for key, (info, table) in index.tensors.items():
            target = targets.get(key)
            shape = getattr(target, "shape", None)
            if shape is None or tuple(shape) != info.shape:
                # unknown here, or a tensor of another shape, which the restore's own check refuses (as it does
                # from the durable tier): every piece, so that the check sees what it would see there
                out.update(prefix + piece.file for piece in table)
                continue
            mesh = getattr(target, "device_mesh", None)
            if mesh is not None and mesh.get_coordinate() is None:
                continue  # this rank is not on the tensor's mesh
            view_ = local_view(target)
            if view_.local.numel() == 0:
                continue
            out.update(prefix + piece.file for piece in table.overlapping(view_.offsets, tuple(view_.local.shape)))
    return out


def _targets(name: str, entry: Any, folder: Folder, tracked: Any) -> dict[str, Any] | None:
    """What this rank would load each stored key into (shapes and placements only), or ``None``: unknown."""
    if name == "model":
        return tracked.model_state.state_dict() if tracked.model_state is not None else {}
    if tracked.optim_state is None:
        return {}
    with parsing(folder.path, "optimizer index"):
        index = registry.get(entry.format).state_index(folder)
    saved = {k[len(_OPTIM):]: v for k, v in index.items() if k.startswith(_OPTIM)}
    template = tracked.optim_state.template(saved)
    if template is None:
        return None
    return {_OPTIM + k: v for k, v in template.items()}

"""Objects shared between steps in a bucket: a step's manifest may refer to an object of an earlier step instead of
holding a copy (``shared``: relative path -> ``<step>/<path>``; see :mod:`ckptio.engine.sharing`).

One rule keeps every reference valid: **an object is deleted only when no committed manifest refers to it.**
Every deletion in a bucket goes through :func:`referenced` first: removing a step (retention, ``prune``) deletes its
manifest, then its objects less the referenced ones, which stay under the step's prefix with the in-progress mark
(so that :meth:`~ckptio.storage.objstore.ObjectStorage.sweep` knows them for ckptio's own and collects each once nothing
refers to it any more). A crash anywhere leaves such garbage at worst, never a reference to a deleted object.

A new step written under the name of one whose objects are still referred to (a run resumed from an older step
saves that name again) first hands each such object to a step that refers to it (:func:`hand_over`): a server-side
copy to that step's own key, then every referring manifest rewritten to name it, one conditional write each. Until
the rewrite the old object is still there; after it nobody refers to the old one, which is deleted with the rest.
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any

from ...errors import CheckpointError, CheckpointNotFoundError
from ...engine.manifest import held_by
from ..confined import UnsafePathError, check_relative
from ..parse import json_object
from ._store import MANIFEST, ObjectStoreError

if TYPE_CHECKING:
    from . import ObjectStorage

MAX_MANIFEST = 64 << 20


def shared_of(data: bytes, name: str) -> dict[str, str]:
    """The valid entries of a manifest's ``shared`` (``rel -> step/rel`` of another step), read leniently: an entry
    that is not a plain path into another step is left out (the manifest's own reader refuses it by name)."""
    return {rel: target for rel, (target, _) in shared_sizes(data, name).items()}


def shared_sizes(data: bytes, name: str) -> dict[str, tuple[str, int | None]]:
    """:func:`shared_of` with each file's size as the manifest's ``files`` records it (``None``: not recorded);
    the manifest's bytes parsed once, bounded, by the gate's JSON reader."""
    try:
        manifest = json_object(data, PurePosixPath(name) / MANIFEST, "manifest ")
    except CheckpointError:
        return {}
    shared, files = manifest.get("shared"), manifest.get("files")
    files = files if isinstance(files, dict) else {}
    out: dict[str, tuple[str, int | None]] = {}
    for rel, target in shared.items() if isinstance(shared, dict) else ():
        try:
            check_relative(rel, name)
            parts = check_relative(target, name)
        except UnsafePathError:
            continue
        if len(parts) >= 2 and parts[0] != name and not parts[0].startswith("."):
            size = files.get(rel)
            out[rel] = (target, size if type(size) is int and size >= 0 else None)
    return out


def references(storage: "ObjectStorage", skip: str | None = None) -> dict[str, dict[str, str]]:
    """Committed step -> its ``shared`` entries, for every committed step of the folder but ``skip``. A manifest that
    cannot be read is an error (a reference missed could be deleted), except one that is gone meanwhile."""
    out: dict[str, dict[str, str]] = {}
    for entry in storage.folder().listdir():
        if entry.kind != "dir" or entry.name.startswith(".") or entry.name == skip:
            continue
        try:
            data = _manifest(storage, entry.name)
        except CheckpointNotFoundError:
            continue
        shared = shared_of(data, entry.name)
        if shared:
            out[entry.name] = shared
    return out


def _manifest(storage: "ObjectStorage", name: str) -> bytes:
    """The bytes of step ``name``'s manifest: as a scan's session holds them (read or handed over by the storage's
    memo of unchanged manifests: :mod:`.scanning`), else read."""
    key = storage._key(f"{name}/{MANIFEST}")
    session: Any = storage._session
    known = getattr(session, "known", None)  # a ScanSession's
    listed = known(key) if known is not None else None
    if listed is not None and listed.size <= MAX_MANIFEST:
        with session.cache.lock:
            held = session.cache.find(key, 0, listed.size)
            if held is not None:
                return bytes(held)
    data, _ = storage.store.get(key, MAX_MANIFEST + 1)
    if listed is not None and len(data) == listed.size:
        with session.cache.lock:
            session.cache.add(key, 0, bytearray(data))  # kept by the memo with the listed version
    return data


def referenced(storage: "ObjectStorage", name: str, skip: str | None = None) -> set[str]:
    """The paths (relative to the step) of step ``name``'s objects some committed step other than ``skip`` refers to."""
    return held_by(references(storage, skip).values()).get(name, set())


def hand_over(storage: "ObjectStorage", name: str) -> None:
    """Before ``name`` is written anew: each of its objects a committed step refers to goes to that step (copied to
    its own key, the referring manifests rewritten), so that nothing refers to ``name`` any more."""
    from ...engine.manifest import Manifest

    refs = references(storage, skip=name)
    held = sorted({t for shared in refs.values() for t in shared.values() if t.partition("/")[0] == name})
    for target in held:
        rel = target.partition("/")[2]
        users = sorted(step for step, shared in refs.items() if target in shared.values())
        heir = users[0]
        store = storage.store
        store.copy(storage._key(target), storage._key(f"{heir}/{rel}"))
        for step in users:
            where = storage.root / step / MANIFEST
            key = storage._key(f"{step}/{MANIFEST}")
            data, _ = store.get(key, MAX_MANIFEST + 1)
            manifest = Manifest.from_json(data, where)  # type: ignore[arg-type]
            manifest.shared = {r: (f"{heir}/{rel}" if t == target else t) for r, t in manifest.shared.items()
                               if not (step == heir and t == target)}
            from ... import _faults

            _faults.point("s3.hand_over.copied")
            store.put(key, manifest.to_json().encode())
    if held:
        storage._wrote()  # a session's listing and manifests are of before the rewrites
        left = referenced(storage, name, skip=name)
        if left:  # another writer changed the folder meanwhile: nothing is deleted
            raise CheckpointError(f"{storage.root / name}: its objects {sorted(left)[:3]} are still referred to; "
                                  "not written over")


def check_source(storage: "ObjectStorage", source: str, size: int) -> bool:
    """Whether ``source`` (``step/path``) is an object of ``size`` bytes in the folder (what a reference may name)."""
    try:
        head = storage.store.head(storage._key(source))
    except (ObjectStoreError, UnsafePathError):
        return False
    return head is not None and head.size == size

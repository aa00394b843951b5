"""Folders of an object store written under a name that may already be taken (Lightning's ``last.ckpt``), with
no moment at which neither the old nor the new folder can be had.

A local folder is replaced by an atomic rename; an object store has none. So a folder whose name is taken is
written complete under a hidden name (``.NAME.tmp-xxxxxxxx``, committed by its manifest) and then *swapped in*:

1. the old folder's manifest is deleted (it is no longer complete, but its objects keep the name listed, so a
   framework that looks for ``NAME`` still sees it: it is not marked in progress, which would hide it);
2. every object of the hidden folder is copied server-side over it, objects the new one lacks are deleted;
3. the manifest is copied last and the hidden folder deleted (manifest first).

A crash inside step 1-3 leaves ``NAME`` incomplete beside a complete hidden copy: :func:`complete_copy` names
that copy, which a reader then reads in place of ``NAME`` (read-only: readers never change the store), and
:func:`recover`, which the next writer runs, finishes the swap. A crash before the hidden folder is committed
leaves ``NAME`` as it was and a hidden leftover that :func:`recover` removes.
"""

from __future__ import annotations

import logging
import re
import secrets
from typing import TYPE_CHECKING, Any, Callable

from ._store import MANIFEST, PENDING, ObjectPath

if TYPE_CHECKING:
    from . import ObjectStorage
    from .writer import ObjectFolderWriter

__all__ = ["write_folder", "committed", "complete_copy", "recover"]

log = logging.getLogger("ckptio")
_HIDDEN = re.compile(r"^\.(.+)\.tmp-[0-9a-f]{8}$")


def write_folder(storage: "ObjectStorage", name: str, write: Callable[["ObjectFolderWriter"], None]) -> None:
    """Write the folder ``name`` of ``storage`` with ``write(writer)``, which writes its files and commits it
    with a manifest; a folder already under that name is replaced as this module describes."""
    taken = storage.folder().kind(name) is not None
    target = f".{name}.tmp-{secrets.token_hex(4)}" if taken else name
    writer = storage.begin_step(target)
    try:
        write(writer)
    except BaseException:
        writer.abort()
        raise
    if taken:
        _swap_in(storage, target, name)


def _swap_in(storage: "ObjectStorage", hidden: str, name: str) -> None:
    from ... import _faults

    store = storage.store
    src, dst = storage._key(hidden), storage._key(name)
    new, old = storage._objects(src), storage._objects(dst)
    where = storage.root / name
    # no in-progress mark here: the old folder must stay listed (and must not be swept) while it has no manifest;
    # the complete copy beside it is what tells a reader, and recover(), what to do with it
    store.delete(f"{dst}/{MANIFEST}")
    _faults.point("s3.swap.uncommitted")
    for rel in sorted(rel for rel in new if rel not in (MANIFEST, PENDING)):
        store.copy(f"{src}/{rel}", f"{dst}/{rel}")
    _faults.point("s3.swap.copied")
    stale = [f"{dst}/{rel}" for rel in old if rel not in new and rel not in (MANIFEST, PENDING)]
    if stale:
        store.delete_many(stale, where)
    store.copy(f"{src}/{MANIFEST}", f"{dst}/{MANIFEST}")
    storage._delete_prefix(src, manifest_first=True)


def _hidden_copies(storage: "ObjectStorage") -> dict[str, list[tuple[float, str]]]:
    """target name -> [(manifest time or -1 when the copy is not committed, hidden name)], newest first."""
    out: dict[str, list[tuple[float, str]]] = {}
    for entry in storage.folder().listdir():
        m = _HIDDEN.match(entry.name)
        if entry.kind != "dir" or not m:
            continue
        objects = storage._objects(storage._key(entry.name))
        stamp = objects[MANIFEST].mtime if MANIFEST in objects else -1.0
        out.setdefault(m.group(1), []).append((stamp, entry.name))
    for copies in out.values():
        copies.sort(reverse=True)
    return out


def committed(storage: "ObjectStorage", name: str) -> bool:
    """Whether the folder ``name`` has its manifest."""
    folder = storage.folder()
    return folder.kind(name) == "dir" and folder.sub(name).kind(MANIFEST) == "file"


def complete_copy(storage: "ObjectStorage", name: str) -> str | None:
    """The hidden folder holding the complete new ``name`` when a swap of ``name`` was cut short (``name`` has no
    manifest and the copy has one), else ``None``."""
    if committed(storage, name):
        return None
    copies = _hidden_copies(storage).get(name, [])
    return copies[0][1] if copies and copies[0][0] >= 0 else None


def recover(storage: "ObjectStorage") -> list[ObjectPath]:
    """Finish the swaps that were cut short and remove what killed writes left (hidden copies that were not
    committed or are no longer needed, folders ckptio began and never committed). Returns what was removed."""
    removed: list[Any] = []
    for name, copies in _hidden_copies(storage).items():
        if not committed(storage, name) and copies[0][0] >= 0:
            log.info("ckptio: finishing the replacement of %s that was cut short", storage.root / name)
            _swap_in(storage, copies[0][1], name)
            copies = copies[1:]
        for _, hidden in copies:
            storage._delete_prefix(storage._key(hidden), manifest_first=True)
            removed.append(storage.root / hidden)
    return removed + storage.sweep()

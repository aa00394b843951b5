"""A checkpoint folder in object storage, whatever the cloud (see :mod:`ckptio.storage.objstore`)."""

from __future__ import annotations

import contextlib
import time
from typing import Any, Iterator

from ...engine.manifest import held_by
from ..confined import check_relative
from . import refs
from ._store import MANIFEST, MAX_POINTER_BYTES, PENDING, Bucket, Obj, ObjectPath
from .lease import ObjectLease
from .reader import ObjectFolder, Session
from .scanning import ManifestMemo, ScanSession
from .writer import ObjectFolderWriter


SHARED_OBJECT = 1 << 20
"""A step's objects at most this large are read by rank 0 alone for a restore on several ranks, and sent to the
others (:meth:`ObjectStorage.share_step`): its manifest, DCP's ``.metadata``, the chunk indexes, the small states."""
SHARED_BYTES = 32 << 20
"""At most this many bytes of them in all (the smallest first)."""


class ObjectStorage:
    """A checkpoint folder in an object store. See :class:`ckptio.storage.base.Storage` and this package."""

    refers = True
    """A step's manifest may refer to objects of another step (``shared``); see :mod:`ckptio.storage.objstore.refs`."""
    same_on_every_rank = True
    """Every rank sees the same folder (a bucket, not a node's own disk): what each rank would ask of it, rank 0 may
    ask alone and tell the others."""

    def __init__(self, store: Bucket, prefix: str) -> None:
        self.store, self.bucket, self.prefix = store, store.name, prefix
        self.root: ObjectPath = store.path(prefix)
        self._session: Session | None = None
        self._memo = ManifestMemo()  # the manifests its scans read (see .scanning)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.root)!r})"

    def _key(self, rel: str) -> str:
        parts = check_relative(rel, self.root)
        return "/".join((self.prefix, *parts)) if self.prefix else "/".join(parts)

    def folder(self, rel: str = "", *, verifier: Any = None) -> ObjectFolder:
        session = self._session
        top = ObjectFolder(session if session is not None else self.store, self.prefix,  # type: ignore[arg-type]
                           verifier=verifier)
        if session is not None:
            top._cache = session.cache
        top.holds_steps = True  # a step below it resolves its manifest's references
        return top.sub(rel) if rel else top

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        """While this lasts (one restore), the folders :meth:`folder` opens share their listings and fetched windows
        (:class:`~.reader.Session`): the folder and a step are listed, and each byte fetched, once. A write through
        this storage drops the listings; nested sessions are one."""
        if self._session is not None:
            yield
            return
        self._session = Session(self.store)
        try:
            yield
        finally:
            self._session = None

    @contextlib.contextmanager
    def scanning(self) -> Iterator[None]:
        """While this lasts (retention after a commit: every step looked at, some removed), one recursive listing of
        the folder answers its listings and its steps', asked for again after each write through this storage, and
        the manifests read by an earlier scan are not fetched again while unchanged (:mod:`.scanning`). Inside a
        :meth:`session` already: that session, as it is."""
        if self._session is not None:
            yield
            return
        self._session = ScanSession(self.store, f"{self.prefix}/" if self.prefix else "", self._memo)
        try:
            yield
        finally:
            session, self._session = self._session, None
            session.forget()  # the manifests it read kept for the next scan

    def share_step(self, name: str) -> None:
        """Collective: within a :meth:`session` on several ranks, rank 0 lists the folder and the step ``name`` and
        reads the step's small objects (:data:`SHARED_OBJECT`, :data:`SHARED_BYTES`) whole, and every rank's session
        takes them (:meth:`~.reader.Session.take`): each rank asked the bucket the same 5-6 small requests, each
        costing its client more CPU than a MB of data. What a rank reads of them still goes through its folders'
        handles and verifier (the read gate: each byte checked against the manifest's checksums as it is read); a
        failure on rank 0 is raised on every rank (:func:`~ckptio._dist.decide_on_rank0`). Nothing without a session
        or on one rank."""
        from ... import _dist

        session = self._session
        if session is None or _dist.world_size() <= 1:
            return
        top, below = (f"{self.prefix}/" if self.prefix else ""), f"{self._key(name)}/"

        def gather() -> tuple[dict[tuple[str, bool], tuple[list[Obj], list[str]]], dict[str, bytes]]:
            listed = {(top, True): session.listing(top, delimiter=True),
                      (below, False): session.listing(below, delimiter=False)}
            objects: dict[str, bytes] = {}
            total = 0
            for obj in sorted(listed[(below, False)][0], key=lambda o: o.size):
                if obj.size > SHARED_OBJECT or total + obj.size > SHARED_BYTES:
                    break
                if obj.size:
                    with session.cache.lock:
                        held = session.cache.find(obj.key, 0, obj.size)  # read already (the manifest, choosing it)
                        data = bytearray(held) if held is not None else None
                    if data is None:
                        data = bytearray(obj.size)
                        if session.store.read_into(obj.key, 0, memoryview(data)) != obj.size:
                            continue  # each rank's own read of it says it is truncated
                    objects[obj.key] = bytes(data)
                    total += obj.size
            return listed, objects

        listed, objects = _dist.decide_on_rank0(f"reading the listing and small objects of {self.root / name}",
                                                gather)
        session.take(listed, objects)

    def _wrote(self) -> None:
        if self._session is not None:
            self._session.forget()

    def _objects(self, prefix: str, session: Session | None = None) -> dict[str, Obj]:
        """rel -> the listing entry of every object below ``prefix``, recursively (as ``session`` shows it, if given;
        else asked of the bucket)."""
        objects, _ = (session or self.store).listing(prefix + "/", delimiter=False)
        return {obj.key[len(prefix) + 1:]: obj for obj in objects}

    def _delete_prefix(self, prefix: str, *, manifest_first: bool, objects: "dict[str, Any] | None" = None,
                       keep: "set[str] | frozenset[str]" = frozenset()) -> None:
        """Remove every object below ``prefix`` (``objects``: its listing, when the caller has it already) but those
        of ``keep`` (paths below it other steps refer to: they stay, with the in-progress mark, for the sweep)."""
        store = self.store
        keys = sorted(k for k in (self._objects(prefix) if objects is None else objects) if k not in keep)
        if manifest_first and MANIFEST in keys:
            # marked in progress before it is uncommitted, unmarked last: a removal cut short leaves a folder
            # sweep() recognises as ckptio's own, never one that looks like another tool's
            store.put(f"{prefix}/{PENDING}", b"")
            store.delete(f"{prefix}/{MANIFEST}")
            from ... import _faults

            _faults.point("delete.after_hide")
            keys = [k for k in keys if k not in (MANIFEST, PENDING)] + ([] if keep else [PENDING])
        elif keep:
            keys = [k for k in keys if k != PENDING]
        if keys:
            store.delete_many([f"{prefix}/{k}" for k in keys], store.path(prefix))

    def begin_step(self, name: str) -> ObjectFolderWriter:
        # whatever sits under this name (an interrupted save, an older step of the same name) goes first,
        # manifest first, so no object of it can end up in the new step's listing; what other steps refer to is
        # handed over to them before
        prefix = self._key(name)
        seen = self._listed_folder()
        self._wrote()
        # listed once (handing objects over copies them out, leaving these as they are); not at all when this
        # session's listing of the folder (the sweep's, under the lease, nothing written since) shows no such step
        objects = {} if seen is not None and f"{prefix}/" not in seen else self._objects(prefix)
        if objects:
            refs.hand_over(self, name)
            self._delete_prefix(prefix, manifest_first=True, objects=objects)
        writer = ObjectFolderWriter(self, name)
        writer.mark_pending()
        return writer

    def _listed_folder(self) -> set[str] | None:
        """The folder's sub-prefixes as this storage's session listed them, if it did (a write since drops the
        listing); ``None``: not listed (never a request)."""
        session = self._session
        found = session.listed(f"{self.prefix}/" if self.prefix else "", delimiter=True) if session else None
        return set(found[1]) if found is not None else None

    def attach_step(self, token: str, name: str) -> ObjectFolderWriter:
        return ObjectFolderWriter(self, name)

    def remove_step(self, name: str) -> None:
        """Remove the step, less the objects other committed steps refer to; then collect what it referred to that
        nothing refers to any more (objects of steps removed before, kept for it)."""
        # what refers to what, and the step's objects, as a scan's session shows them (no request then); the session
        # forgets them before the first write
        every = refs.references(self)
        own = every.pop(name, {})
        held = held_by(every.values())
        objects = self._objects(self._key(name), self._session)
        self._wrote()
        self._delete_prefix(self._key(name), manifest_first=True, keep=held.get(name, set()), objects=objects)
        for owner in sorted({target.partition("/")[0] for target in own.values()}):
            objects = self._objects(self._key(owner))
            keep = held.get(owner, set())
            if MANIFEST not in objects and PENDING in objects and not (keep and set(objects) - {PENDING} <= keep):
                from ... import _faults

                _faults.point("sweep.before_remove")
                self._delete_prefix(self._key(owner), manifest_first=False, objects=objects, keep=keep)

    def remove_part(self, name: str, rel: str) -> None:
        """Remove the objects below ``rel`` of the step ``name``, and the object ``rel`` itself if there is one."""
        self._wrote()
        parts = check_relative(rel, self.root / name)
        key = self._key(name + "/" + "/".join(parts))
        referenced = refs.referenced(self, name)
        held = {r[len(rel) + 1:] for r in referenced if r.startswith(rel + "/")}
        self._delete_prefix(key, manifest_first=False, keep=held)
        if rel not in referenced:
            self.store.delete(key)

    def sweep(self, older_than_s: float = 0.0) -> list[ObjectPath]:  # type: ignore[override]
        """Remove steps ckptio began and never committed (in-progress mark, no manifest) whose newest object is at
        least ``older_than_s`` old, and drop unfinished uploads under the folder started that long ago. A folder
        without the mark (another tool's, such as a NeMo AutoModel step) is never removed."""
        self._wrote()
        now = time.time()
        removed: list[ObjectPath] = []
        held: dict[str, set[str]] | None = None  # step -> its objects committed steps refer to (read once, if needed)
        for entry in self.folder().listdir():
            if entry.kind != "dir" or entry.name.startswith("."):
                continue
            prefix = self._key(entry.name)
            objects = self._objects(prefix, self._session)  # a scan's one listing of the folder serves every step
            newest = max((o.mtime for o in objects.values()), default=0.0)
            if MANIFEST not in objects and PENDING in objects and now - newest >= older_than_s:
                if held is None:
                    held = held_by(refs.references(self).values())
                keep = held.get(entry.name, set())
                if keep and set(objects) - {PENDING} <= keep:
                    continue  # only objects other steps still refer to: nothing to collect yet
                from ... import _faults

                _faults.point("sweep.before_remove")
                self._delete_prefix(prefix, manifest_first=False, objects=objects, keep=keep)
                removed.append(self.root / entry.name)  # type: ignore[arg-type]
        if removed:
            self._wrote()  # a session's listings showed what is gone
        base = f"{self.prefix}/" if self.prefix else ""
        return removed + self.store.sweep_uploads(base, older_than_s, now)

    def write_pointer(self, name: str, target: str) -> None:
        self._wrote()
        self.store.put(self._key(name), (target + "\n").encode())

    def write_small(self, name: str, data: bytes) -> None:
        """Replace the small object ``name`` at the root whole (one write: readers see the old or the new bytes)."""
        self._wrote()
        self.store.put(self._key(name), data)

    def read_pointer(self, name: str) -> str | None:
        from ..posix import check_pointer_target

        folder = self.folder()
        if folder.kind(name) != "file":
            return None
        target = folder.read_text(name, max_size=MAX_POINTER_BYTES).strip()
        return check_pointer_target(target, self.root / name, self.root)

    def lock(self) -> ObjectLease:
        return ObjectLease(self)

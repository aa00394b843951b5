"""Looking at every step of a bucket's folder in a few requests (retention after each commit; before a save with
frozen tensors, what ``LATEST`` offers to share).

Retention decides from every committed step's manifest and checks that each step's files are all there, of their
recorded sizes. Asked of the bucket step by step, that was a listing and a read of the manifest per step, every save,
and as many reads again to learn which objects other steps refer to before one is removed: with ``keep_latest=2``,
25 of a GCS save's 38 requests on rank 0, and with ``keep_every_n_steps`` a count that grew with every step kept
(52 a save with 11 steps, each a round trip to the cloud on the training's critical path). What ``LATEST`` offers
to share (:func:`~ckptio.engine.sharing.previous_of`) counts the committed steps that use each file: the same again.

A :class:`ScanSession` lists the whole folder once, recursively, and answers every listing below it from that
answer; the listing is asked for again only after a write through the storage (its :meth:`Session.forget`). A
manifest read before, by this process, is not fetched again while the listing shows the same version of it (GCS's
generation, S3's and Azure's ETag: a manifest rewritten in place, as :func:`~.refs.hand_over` does, is a new
version) and the same size: :class:`ManifestMemo` keeps their bytes (at most :data:`MEMO_BYTES`), and each session
starts with them in its window cache, so every read still goes through the folders' handles and the read gate as a
fetched one would. Without a version in the listing nothing is kept.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import OrderedDict
from typing import Any

from ._store import MANIFEST, Bucket, Obj
from .reader import Session

MEMO_BYTES = 64 << 20
"""Most bytes of manifests a storage keeps between its scans (least recently seen dropped first)."""
WHOLE_LIMIT = 250_000
"""Most objects a folder's whole listing is held for (~250 bytes each). A larger folder is listed step by step
from then on, as before: the memory of holding it would outgrow what it saves (a listing of it costs as many pages
either way; what is saved is a request per step)."""


class ManifestMemo:
    """The manifests a storage read, by key: the version and size the listing showed, and their bytes."""

    def __init__(self, limit: int = MEMO_BYTES) -> None:
        import threading

        self.limit = limit
        self._held: "OrderedDict[str, tuple[Any, int, bytes]]" = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()  # a write on another thread (the run's record) forgets the session: harvests
        self.whole = True
        """Whether the folder's whole listing is held (``False`` once it held more than :data:`WHOLE_LIMIT`)."""

    def seed(self, session: "ScanSession", manifests: list[Obj]) -> None:
        """Hand ``session`` the bytes of every one of the folder's ``manifests`` (as its listing shows them) kept here
        in that version (others are forgotten: gone, or rewritten since)."""
        seen = {obj.key for obj in manifests}
        with self._lock:
            for key in [k for k in self._held if k not in seen]:
                self._drop(key)
            for obj in manifests:
                held = self._held.get(obj.key)
                if held is None:
                    continue
                if obj.token is None or held[:2] != (obj.token, obj.size):
                    self._drop(obj.key)
                    continue
                with session.cache.lock:
                    session.cache.add(obj.key, 0, bytearray(held[2]))

    def harvest(self, session: "ScanSession", manifests: list[Obj]) -> None:
        """Keep the bytes of each of the folder's ``manifests`` (with its version) that ``session`` read whole."""
        for obj in manifests:
            if obj.token is None or obj.size > self.limit:
                continue
            with session.cache.lock:
                found = session.cache.find(obj.key, 0, obj.size)
                data = bytes(found) if found is not None else None
            if data is None:
                continue
            with self._lock:
                self._drop(obj.key)
                self._held[obj.key] = (obj.token, obj.size, data)
                self._bytes += len(data)
        with self._lock:
            while self._bytes > self.limit and self._held:
                self._drop(next(iter(self._held)))

    def _drop(self, key: str) -> None:
        held = self._held.pop(key, None)
        if held is not None:
            self._bytes -= len(held[2])


def _is_manifest(whole: str, key: str) -> bool:
    """Whether ``key`` is a step's manifest: ``<whole><step>/manifest.json``."""
    rest = key[len(whole):] if key.startswith(whole) else ""
    step, sep, name = rest.partition("/")
    return bool(step and sep) and name == MANIFEST


class ScanSession(Session):
    """A :class:`~.reader.Session` whose listings below ``whole`` (the folder's prefix, ending in ``/``; ``""``: the
    bucket) come from one recursive listing of it, made when first needed and again after each :meth:`forget`;
    ``memo`` hands it the manifests read before and keeps those it reads (see the module)."""

    def __init__(self, store: Bucket, whole: str, memo: ManifestMemo) -> None:
        super().__init__(store)
        self.whole, self.memo = whole, memo
        self._keys: list[str] | None = None
        self._objects: list[Obj] = []
        self._manifests: list[Obj] = []  # the steps' manifests among them, picked out once

    def listing(self, prefix: str, *, delimiter: bool) -> tuple[list[Obj], list[str]]:
        primed = self._primed() if prefix.startswith(self.whole) and self.memo.whole else None
        if primed is None:
            return super().listing(prefix, delimiter=delimiter)
        keys, objects = primed
        objs: list[Obj] = []
        prefixes: set[str] = set()
        i = bisect_left(keys, prefix)
        while i < len(keys) and keys[i].startswith(prefix):
            obj = objects[i]
            head, sep, _ = obj.key[len(prefix):].partition("/")
            if delimiter and sep:
                prefixes.add(f"{prefix}{head}/")
            else:
                objs.append(obj)
            i += 1
        return objs, sorted(prefixes)

    def listed(self, prefix: str, *, delimiter: bool) -> tuple[list[Obj], list[str]] | None:
        if prefix.startswith(self.whole) and self._keys is not None:
            return self.listing(prefix, delimiter=delimiter)
        return super().listed(prefix, delimiter=delimiter)

    def known(self, key: str) -> Obj | None:
        """The object ``key`` as the folder's listing shows it (``None``: not listed, or no listing held)."""
        with self._lock:
            keys, objects = self._keys, self._objects
        if keys is None:
            return None
        i = bisect_left(keys, key)
        return objects[i] if i < len(keys) and keys[i] == key else None

    def _primed(self) -> tuple[list[str], list[Obj]] | None:
        with self._lock:
            if self._keys is not None:
                return self._keys, self._objects
        objects = sorted(self.store.listing(self.whole, delimiter=False)[0], key=lambda o: o.key)
        if len(objects) > WHOLE_LIMIT:
            self.memo.whole = False
            return None
        manifests = [o for o in objects if _is_manifest(self.whole, o.key)]
        self.memo.seed(self, manifests)
        with self._lock:
            self._keys, self._objects, self._manifests = [o.key for o in objects], objects, manifests
            return self._keys, self._objects

    def forget(self) -> None:
        with self._lock:
            keys, manifests = self._keys, self._manifests
            self._keys, self._objects, self._manifests = None, [], []
        if keys is not None:
            self.memo.harvest(self, manifests)
        super().forget()

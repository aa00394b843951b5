"""Reading a folder in object storage: listings, sizes and ranged reads, like the local confined Folder."""

from __future__ import annotations

import mmap
from typing import Any, Union

from ...errors import CheckpointCorruptError, CheckpointNotFoundError
from ..confined import Entry, FolderReads, ReadHandle, UnsafePathError, check_relative
from ._store import Bucket, Obj, ObjectPath

WINDOW = 256 << 20
"""Smallest ranged ``GET``: a shorter read fetches this much from its offset, kept in the folder's
:class:`WindowCache`, and the reads that follow inside it (the next tensors, the same file opened again
to load after its header was scanned) are served from memory. One request per tensor piece made a
restore from a bucket ×8 slower than a raw download of the same files (``benchmarks/objstore_cost.py``)."""
WINDOW_GAP = 16 << 20
"""A window goes on over a gap of up to this many bytes between ranges its handle was told it will read: one
request less costs more than that on the loopback server (~50 ms a request at ~0.5 GB/s; FSDP's optimizer step
counters, a few bytes each between other ranks' shards, were one request each)."""
DIRECT = 1 << 20
"""A read of at least this many bytes whose window would hold just it (the end of an advised range) is fetched
straight into the reader's buffer: no window allocated, filled and copied out again."""
BACK = 1 << 20
"""A window begins this many bytes before its read at most: at the start of the advised range the read lies in, or
of an object this small when nothing was advised."""
CACHE_BYTES = 512 << 20
"""Most bytes of windows a folder tree keeps (least recently used dropped first)."""
MAPPED = 32 << 20
"""A window larger than this is memory mapped with its pages made present at once (:func:`_buffer`); a smaller one
is a ``bytearray`` (glibc's ``malloc`` serves it from memory it freed before, already mapped, once a window that
size was freed: its threshold for a new mapping grows to at most 32 MiB)."""


Buffer = Union[bytearray, mmap.mmap]


def _buffer(n: int) -> Buffer:
    """Memory for a window of ``n`` bytes. A ``bytearray`` larger than :data:`MAPPED` is a new mapping of memory every
    time, zeroed, each 4 KiB page faulted in as it is touched (~30 ms of CPU for a 42 MB window here, a rank's 64 MB
    share of a 4-rank restore costing ~150 ms in all); an anonymous mapping with ``MAP_POPULATE`` (Linux) gets its
    pages, zeroed by the kernel, in the one call (~15 ms). A window the download did not fill is never kept
    (:meth:`ObjectReadHandle._get` raises first), so no byte of it is served unfilled."""
    if n > MAPPED:
        try:
            return mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0))
        except (OSError, ValueError, TypeError, AttributeError):  # no anonymous mapping (Windows): a bytearray
            pass
    return bytearray(n)


class WindowCache:
    """Recently fetched windows of objects, shared by the handles of one folder tree (thread-safe)."""

    def __init__(self, limit: int = CACHE_BYTES) -> None:
        import threading
        from collections import OrderedDict

        self.limit = limit
        self._windows: "OrderedDict[tuple[str, int], Buffer]" = OrderedDict()
        self._bytes = 0
        self.lock = threading.Lock()

    def find(self, key: str, offset: int, n: int) -> memoryview | None:
        for (k, start), buf in reversed(self._windows.items()):
            if k == key and start <= offset and offset + n <= start + len(buf):
                self._windows.move_to_end((k, start))
                return memoryview(buf)[offset - start:offset - start + n]
        return None

    def held(self, key: str, offset: int, n: int) -> memoryview | None:
        """The first bytes (fewer than ``n``) of a read at ``offset`` that a window holds, when one holds its start
        but not all of it; ``None`` otherwise."""
        for (k, start), buf in reversed(self._windows.items()):
            if k == key and start <= offset < start + len(buf) < offset + n:
                return memoryview(buf)[offset - start:]
        return None

    def add(self, key: str, offset: int, buf: Buffer) -> None:
        self._windows[(key, offset)] = buf
        self._bytes += len(buf)
        while self._bytes > self.limit and len(self._windows) > 1:
            _, old = self._windows.popitem(last=False)
            self._bytes -= len(old)


class Session:
    """The bucket as the folders of one read session see it (:meth:`~.storage.ObjectStorage.session`: one restore):
    every listing is asked for once and kept, and one :class:`WindowCache` is shared. A restore opens the checkpoint
    folder and its step several times (choosing the step, reading its manifest, planning, loading, recording what it
    resumed from); each folder listed both again and read the manifest again, 10 listings and 4 manifest reads on
    every rank, which cost a rank of a 4-rank restore of 256 MB more CPU than the bytes of its share of the data.
    Every other request goes to the bucket."""

    def __init__(self, store: Bucket) -> None:
        import threading

        self.store = store
        self.cache = WindowCache()
        self._listed: dict[tuple[str, bool], tuple[list[Obj], list[str]]] = {}
        self._lock = threading.Lock()

    def listing(self, prefix: str, *, delimiter: bool) -> tuple[list[Obj], list[str]]:
        with self._lock:
            found = self._listed.get((prefix, delimiter))
        if found is None:
            found = self.store.listing(prefix, delimiter=delimiter)
            with self._lock:
                self._listed[(prefix, delimiter)] = found
        return list(found[0]), list(found[1])

    def listed(self, prefix: str, *, delimiter: bool) -> tuple[list[Obj], list[str]] | None:
        """What :meth:`listing` kept of ``prefix``, ``None`` if it was not listed (never a request)."""
        with self._lock:
            return self._listed.get((prefix, delimiter))

    def take(self, listed: "dict[tuple[str, bool], tuple[list[Obj], list[str]]]", objects: dict[str, bytes]) -> None:
        """Keep listings and whole objects another rank asked the bucket for (:meth:`~.storage.ObjectStorage.
        share_step`) as if this one had: the objects' bytes are then read through the folders' handles (and their
        verifier) from the cache, with no request."""
        with self._lock:
            self._listed.update(listed)
        with self.cache.lock:
            for key, data in objects.items():
                self.cache.add(key, 0, bytearray(data))

    def forget(self) -> None:
        """Drop what was listed and fetched (the folder was written to)."""
        with self._lock:
            self._listed.clear()
            self.cache = WindowCache()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


class ObjectReadHandle(ReadHandle):
    """An object of known size read with ranged requests (positional, thread-safe). A read shorter
    than :data:`WINDOW` is served from ``cache`` (fetching a window first when none holds it); a longer one
    goes straight into its buffer."""

    def __init__(self, store: Bucket, key: str, path: ObjectPath, size: int, cache: WindowCache | None = None) -> None:
        super().__init__(-1, path, size)  # type: ignore[arg-type]
        self.store, self.key = store, key
        self.cache = cache if cache is not None else WindowCache(WINDOW)

    def close(self) -> None:
        pass

    def _pread(self, view: memoryview, offset: int) -> None:
        n = view.nbytes
        if n == 0:
            return
        with self.cache.lock:
            held = self.cache.held(self.key, offset, n)
        if held is not None:  # a window (a header's) holds the start of this read: the rest is fetched from its end
            view[:held.nbytes] = held
            view, offset, n = view[held.nbytes:], offset + held.nbytes, n - held.nbytes
        if n >= WINDOW:
            self._get(view, offset)
            return
        with self.cache.lock:
            found = self.cache.find(self.key, offset, n)
            if found is None:
                start = offset if held is not None else self._window_start(offset)
                end = self._window_end(offset, n)
                if start == offset and end == offset + n and n >= DIRECT:
                    found = view  # the window would be just this read: fetched into its buffer, not kept
            if found is None:
                buf = _buffer(end - start)
                self._get(memoryview(buf), start)
                self.cache.add(self.key, start, buf)
                found = memoryview(buf)[offset - start:offset - start + n]
            if found is not view:
                view[:] = found
                return
        self._get(view, offset)

    def _window_start(self, offset: int) -> int:
        """Where the window fetched for a short read at ``offset`` begins: at the read, or up to :data:`BACK` bytes
        before it at the start of the advised range it lies in (a zip reader reads a small file's end first, then
        the whole file: one request, not two); without advice, at 0 in an object of at most that many bytes."""
        if self._advice is None:
            return 0 if self.size <= BACK else offset
        for start, stop in self._advice:
            if start <= offset < stop:
                return start if offset - start <= BACK else offset
        return offset

    def _window_end(self, offset: int, n: int) -> int:
        """Where the window fetched for a short read at ``offset`` ends: :data:`WINDOW` on, but not past the advised
        range it lies in (:meth:`~ckptio.storage.confined.ReadHandle.advise`), and just the read outside them, unless
        an advised range begins at most :data:`BACK` bytes after it (a file's header, read before the data it
        describes: one request for both, not three)."""
        end = min(self.size, offset + WINDOW)
        if self._advice is None:
            return end
        reach = None
        for start, stop in self._advice:
            if reach is None and (start <= offset < stop or offset + n <= start < end and start - offset - n <= BACK):
                reach = stop
            elif reach is not None and start - reach <= WINDOW_GAP and start < end:
                reach = stop  # a short gap costs less to fetch than another request
            elif reach is not None:
                break
        return offset + n if reach is None else max(offset + n, min(end, reach))

    def _get(self, view: memoryview, offset: int) -> None:
        n = view.nbytes
        done = self.store.read_into(self.key, offset, view)
        if done != n:
            raise CheckpointCorruptError(f"{self.path}: truncated (a read of {n} bytes at {offset} returned {done}; "
                                         f"expected {self.size} bytes in all)")


class ObjectFolder(FolderReads):
    """Read access to the objects under one prefix, with the methods of the local confined ``Folder``."""

    def __init__(self, store: Bucket, prefix: str, *, verifier: Any = None,
                 listings: "dict[str, tuple[dict[str, int], set[str], set[str]]] | None" = None) -> None:
        self.store, self.bucket, self.prefix = store, store.name, prefix.strip("/")
        self.path = store.path(self.prefix)
        self.links = False
        self.verifier = verifier
        self._listings = {} if listings is None else listings  # rel -> (files, dirs, others), cached
        self._cache = WindowCache()  # shared with sub-folders: a file scanned, then loaded, is fetched once
        self.holds_steps = False
        """A checkpoint folder: a folder below it is a step, whose manifest may refer to other steps' objects."""
        self._step_of: str | None = None  # the checkpoint folder's prefix, when this may be a step
        self._aliases: dict[str, tuple[str, int]] | None = None  # rel -> (key, size) of files held by other steps
        self._below: list[tuple[str, int]] | None = None
        """Every object below this folder (rel, size), when one recursive listing of its step gave them: its folders
        are listed from it, not one request each (a restore opened each of a step's folders, each listed once)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.path)!r})"

    def display(self, rel: str = "") -> ObjectPath:
        return self.path / rel if rel else self.path  # type: ignore[return-value]

    def plain(self) -> "ObjectFolder":
        """The same folder without a verifier."""
        plain = ObjectFolder(self.store, self.prefix, listings=self._listings)
        plain._cache, plain._aliases, plain._below = self._cache, self._shared(), self._below
        return plain

    def _shared(self) -> dict[str, tuple[str, int]]:
        """The files of this step that live in another step's object (its manifest's ``shared``): rel -> (key,
        size); empty for a folder that is not a step."""
        if self._aliases is None:
            self._aliases = {}
            if self._step_of is not None:
                from ._store import MANIFEST
                from .refs import MAX_MANIFEST, shared_sizes

                size = self._listing_of("")[0].get(MANIFEST, 0)
                if 0 < size <= MAX_MANIFEST:  # read into the folder's cache: the manifest's reader takes it from there
                    data = ObjectReadHandle(self.store, self._key(MANIFEST), self.display(MANIFEST), size,
                                        self._cache).read(0, size)
                    base = f"{self._step_of}/" if self._step_of else ""
                    shared = shared_sizes(data, self.prefix.rsplit("/", 1)[-1])
                    self._aliases = {rel: (base + target, n) for rel, (target, n) in shared.items() if n is not None}
                    if self._aliases:
                        self._listings.pop("", None)  # listed again, with them
        return self._aliases

    def _key(self, rel: str) -> str:
        if self._aliases and rel in self._aliases:
            return self._aliases[rel][0]
        parts = check_relative(rel, self.path) if rel not in ("", ".") else ()
        return "/".join((self.prefix, *parts)) if self.prefix else "/".join(parts)

    def sub(self, rel: str) -> "ObjectFolder":
        if rel in ("", "."):
            return self
        first, _, rest = rel.partition("/")
        if self.holds_steps and rest:
            return self.sub(first).sub(rest)
        if self.kind(rel) != "dir":
            raise CheckpointNotFoundError(f"{self.path / rel}: no such folder")
        sub = ObjectFolder(self.store, self._key(rel), verifier=self.verifier)
        sub._cache = self._cache
        if self._below is not None:
            sub._below = [(k[len(rel) + 1:], n) for k, n in self._below if k.startswith(rel + "/")]
        if self.holds_steps:
            sub._step_of = self.prefix
        else:
            sub._aliases = {k[len(rel) + 1:]: v for k, v in self._shared().items() if k.startswith(rel + "/")}
        return sub

    def _listing(self, rel: str) -> tuple[dict[str, int], set[str], set[str]]:
        """(files -> size, sub-prefixes, unusable names) directly below ``rel``."""
        if rel in self._listings:
            return self._listings[rel]
        if self._step_of is not None and self._aliases is None:
            self._shared()  # the step's references are part of its listing
            if rel in self._listings:
                return self._listings[rel]
        return self._listing_of(rel)

    def _listing_of(self, rel: str) -> tuple[dict[str, int], set[str], set[str]]:
        base = self._key(rel)
        prefix = f"{base}/" if base else ""
        files: dict[str, int] = {}
        dirs: set[str] = set()
        others: set[str] = set()
        if self._below is None and self._step_of is not None:  # a step: all of it in one listing
            below = f"{self.prefix}/" if self.prefix else ""
            self._below = [(o.key[len(below):], o.size) for o in self.store.listing(below, delimiter=False)[0]]
        objects, prefixes = self._from_below(rel) if self._below is not None else \
            self.store.listing(prefix, delimiter=True)
        for common in prefixes:
            name = common[len(prefix):].rstrip("/")
            (dirs if _plain(name) else others).add(name)
        for obj in objects:
            name = obj.key[len(prefix):]
            if name == "":
                continue  # a "folder marker" object some tools write
            (files.__setitem__(name, obj.size) if _plain(name) else others.add(name))
        for alias, (_, size) in (self._aliases or {}).items():  # files held by another step, listed where this has them
            if rel and not alias.startswith(rel + "/"):
                continue
            head, _, tail = (alias[len(rel) + 1:] if rel else alias).partition("/")
            if tail:
                dirs.add(head)
            else:
                files[head] = size
        self._listings[rel] = (files, dirs, others)
        return files, dirs, others

    def _from_below(self, rel: str) -> tuple[list[Obj], list[str]]:
        """What a listing of ``rel`` with a delimiter answers, made from :attr:`_below`."""
        assert self._below is not None
        base = f"{self.prefix}/" if self.prefix else ""
        want = f"{rel}/" if rel else ""
        objects, prefixes = [], set()
        for key, size in self._below:
            if key.startswith(want):
                head, sep, _ = key[len(want):].partition("/")
                if sep:
                    prefixes.add(f"{base}{want}{head}/")
                else:
                    objects.append(Obj(f"{base}{key}", size, 0.0))
        return objects, sorted(prefixes)

    def kind(self, rel: str) -> str | None:
        parts = check_relative(rel, self.path)
        files, dirs, others = self._listing("/".join(parts[:-1]))
        name = parts[-1]
        if name in files:
            return "file"
        if name in dirs:
            return "dir"
        return "other" if name in others else None

    def size(self, rel: str) -> int:
        parts = check_relative(rel, self.path)
        files, _, _ = self._listing("/".join(parts[:-1]))
        if parts[-1] not in files:
            kind = self.kind(rel)
            if kind is None:
                raise CheckpointNotFoundError(f"{self.path / rel}: missing")
            raise UnsafePathError(f"{self.path / rel}: is a {'folder' if kind == 'dir' else 'key that is not a plain name'}, "
                                  "not a file")
        return files[parts[-1]]

    def listdir(self, rel: str = "") -> list[Entry]:
        if rel not in ("", ".") and self.kind(rel) != "dir":
            raise CheckpointNotFoundError(f"{self.path / rel}: no such folder")
        files, dirs, others = self._listing("" if rel in ("", ".") else rel)
        out = [Entry(n, "file", s) for n, s in files.items()] + [Entry(n, "dir", 0) for n in dirs] + \
              [Entry(n, "other", 0) for n in others if n not in files and n not in dirs]
        return sorted(out, key=lambda e: e.name)

    def open(self, rel: str, *, size: int | None = None) -> ReadHandle:
        actual = self.size(rel)
        if size is not None and actual != size:
            raise CheckpointCorruptError(f"{self.path / rel}: size {actual} bytes, expected {size}")
        handle = ObjectReadHandle(self.store, self._key(rel), self.display(rel), actual, self._cache)
        if self.verifier is not None:
            self.verifier._attach(self, rel, handle)
        return handle

def _plain(name: str) -> bool:
    try:
        check_relative(name, "")
    except UnsafePathError:
        return False
    return True



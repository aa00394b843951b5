"""Saving DCP folders through ``torch.distributed.checkpoint``, with every file checksummed as it is written.

:func:`save` runs DCP's save steps with DCP's own planner and ``FileSystemWriter`` (so plain DCP reads what it
writes), coordinated by ckptio's cheaper rounds (:mod:`ckptio.formats.dcp.rounds`), on a file system whose streams
go through a :class:`FolderWriter`. Each rank writes one data file (``__R_0.distcp``, as other tools lay DCP folders
out); with ``thread_count`` > 1 that file is written as that many regions at once, one per writer thread
(:class:`_OneFilePerRank`). A failure on one of those threads, which DCP does not report, is caught at the stream
and raised by :func:`save` on every rank, and no thread is left writing into a folder that is about to be removed.
Also here: the mapping of DCP's ``CheckpointException`` to ckptio's errors, used by loading
(:mod:`ckptio.formats.dcp.format`).

Call sequence: :func:`save` is a collective when a process group is initialised.
"""

from __future__ import annotations

import io
import os
import threading
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem

from ... import _dist
from ...errors import CheckpointCorruptError, CheckpointError

if TYPE_CHECKING:
    from ...storage.base import FolderWriter

__all__ = ["save"]

class _WriterFileSystem(FileSystem):
    """DCP's file system for writing, with every file going through a :class:`FolderWriter` (and so
    checksummed as it is written). DCP addresses files by path under ``base``, the writer's local path of
    the DCP folder; they are mapped back to names relative to the writer's folder."""

    def __init__(self, writer: "FolderWriter", rel: str, base: Path) -> None:
        super().__init__()
        self.writer, self.rel, self.base = writer, rel, base
        self.digests: dict[str, str] = {}
        self.errors: list[OSError] = []
        self.failed: list[tuple[str, Exception]] = []
        """Files a writer thread of DCP's gave up on, with why (see :meth:`create_stream`)."""
        self._caller = threading.get_ident()
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._writing = 0  # files (or regions of one) being written
        self._closed = False  # set by quiesce(): no new file
        self._regioned: dict[str, Any] = {}  # files written as regions by several threads (plan_regions)
        self.whole = bool(getattr(writer, "writes_whole", False))
        """The writer's files are made whole as their streams close, in a new folder (a bucket's step): DCP's
        temporary ``.metadata.tmp`` goes straight under its final name (a rename there is a copy and a delete), and
        what exists is what this save wrote (no lookup: DCP asks on every rank)."""
        self._opened: set[str] = set()  # names DCP opened (as it named them)

    def _rel(self, path: str | os.PathLike) -> str:
        inner = Path(str(path).partition(_REGION)[0]).relative_to(self.base).as_posix()
        return f"{self.rel}/{inner}" if self.rel else inner

    def plan_regions(self, path: str, lengths: list[int]) -> list[str]:
        """Open the new file ``path`` as consecutive regions of ``lengths`` bytes; the names that address them."""
        from ...storage.regions import RegionedFile

        self._regioned[self._rel(path)] = RegionedFile(self.writer.open(self._rel(path)), lengths)
        return [f"{path}{_REGION}{i}" for i in range(len(lengths))]

    def _open(self, path: str | os.PathLike, name: str) -> Any:
        where, _, region = str(path).partition(_REGION)
        if region:
            return self._regioned[name].region(int(region))
        if self.whole:
            with self._lock:
                self._opened.add(name)
            return self.writer.open(_final(name))
        return self.writer.open(name)

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        if "w" not in mode:
            raise CheckpointError(f"{path}: the DCP writer does not read")
        name = self._rel(path)
        kept = _final(name) if self.whole else name  # the name the file is written (and its digest kept) under
        with self._cond:
            live = not self._closed
            self._writing += live
        try:
            stream: Any = self._open(path, name) if live else _Refused(name)
            try:
                yield stream
            except Exception as exc:
                stream.__exit__(type(exc), exc, exc.__traceback__)  # discarded, not durable
                with self._lock:
                    self.failed.append((name, exc))
                if threading.get_ident() == self._caller:  # DCP's own path: every rank raises it together
                    if stream.error is not None and stream.error is not exc:
                        # torch's zip writer turns a failed write into "unexpected pos": send the cause
                        raise stream.error from exc
                    raise
                # One of DCP's extra writer threads: an error there would end the thread with a traceback
                # on stderr and DCP would carry on with the files it got. It is kept and raised by save().
                return
            finally:
                if stream.error is not None:
                    with self._lock:
                        self.errors.append(stream.error)
            digest = stream.close()  # a region of a file: the file's digest once its last region closed
            if digest is not None:
                with self._lock:
                    self.digests[kept] = digest
        finally:
            if live:
                with self._cond:
                    self._writing -= 1
                    self._cond.notify_all()

    def quiesce(self) -> None:
        """Refuse new files and wait for those being written to close.

        When the calling thread fails, DCP raises without joining its extra writer threads; the folder
        is removed next, so none of them may still be creating or writing a file in it.
        """
        with self._cond:
            self._closed = True
            self._cond.wait_for(lambda: self._writing == 0)
        for file in self._regioned.values():  # a region no writer thread got to: the file is never finished
            file.abandon()

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        old, new = self._rel(path), self._rel(new_path)
        if self.whole and _final(old) == new and old in self._opened:
            return  # written under its final name already
        self.writer.rename(old, new)
        with self._lock:
            if old in self.digests:
                self.digests[new] = self.digests.pop(old)

    def mkdir(self, path: str | os.PathLike) -> None:
        inner = Path(path).relative_to(self.base).as_posix()
        self.writer.local_path("/".join(p for p in (self.rel, "" if inner == "." else inner) if p))

    def exists(self, path: str | os.PathLike) -> bool:
        if self.whole:
            with self._lock:
                return self._rel(path) in self._opened
        return self.writer.exists(self._rel(path))


_TMP = ".metadata.tmp"
"""The temporary name DCP writes its metadata under before renaming it (``__R.metadata.tmp`` per rank)."""


def _final(name: str) -> str:
    """The name DCP renames the file ``name`` to once written (its metadata's temporary), else ``name``."""
    return name[:-len(".tmp")] if name.endswith(_TMP) else name


_REGION = "#region-"
"""Marks the path of one region of a file written by several threads (see :meth:`_WriterFileSystem.plan_regions`)."""


class _OneFilePerRank(FileSystemWriter):
    """DCP's ``FileSystemWriter`` with one data file per rank (``__R_0.distcp``) however many threads write it.

    With ``thread_count`` > 1 the rank's items are split into that many groups of about equal size; each
    group's length is found by a dry run of its serialisation (``torch.save`` into a byte counter: headers
    and pickles only, the tensor bytes are not touched) and becomes one region of the file, written by one
    of DCP's writer threads through :class:`~ckptio.storage.regions.Region`. DCP itself records every item's
    offset as its stream reports it, so the metadata is the one a single-threaded write would give."""

    fs: "_WriterFileSystem"

    def finish(self, metadata: Any, results: list[list[Any]]) -> None:
        """DCP's ``.metadata``, then ckptio's chunk index of the same folder (read by restores instead of unpickling
        the metadata: :mod:`ckptio.formats.safetensors.chunk_index`)."""
        super().finish(metadata, results)
        if not self.use_collectives and self.rank is not None:
            return  # DCP wrote a per-rank metadata file: no one index describes the folder
        from ..safetensors.chunk_index import INDEX_NAME, encode_dcp

        data = encode_dcp(metadata, len(results))
        if data is None:
            return  # an item was never written: save() raises for it (see run); the restore would refuse it too
        with self.fs.create_stream(self.fs.concat_path(self.path, INDEX_NAME), "wb") as stream:
            stream.write(data)

    def write_data(self, plan: Any, planner: Any) -> Any:
        """This rank's items into ``__R_0.distcp`` (see :mod:`ckptio.formats.dcp.writer`): one stream, or with
        ``thread_count`` > 1 that many regions of about equal bytes written at once, each by a thread of ours."""
        from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX

        from .writer import archive_length, write_items

        name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
        path = str(self.fs.concat_path(self.path, name))
        values = _ResolvedOnce(planner)
        # a writer whose files are uploaded from memory as written (GCS, Azure) takes them front to back only
        threads = self.thread_count if getattr(self.fs.writer, "regions", True) else 1
        groups = [g for g in _balanced(plan.items, threads) if g] if threads > 1 else []
        results: list[Any] = []
        if len(groups) < 2:
            with self.fs.create_stream(path, "wb") as stream:
                results = write_items(stream, plan.items, values.resolve, name)
        else:
            regions = self.fs.plan_regions(path, [sum(archive_length(values.resolve(i, keep=True)) for i in g)
                                                  for g in groups])
            done: list[list[Any]] = [[] for _ in groups]
            failed: list[BaseException] = []

            def write(k: int) -> None:
                try:
                    with _no_zip_crc32(), self.fs.create_stream(regions[k], "wb") as stream:
                        done[k] = write_items(stream, groups[k], values.resolve, name)
                except BaseException as exc:  # on the calling thread: raised below, after every thread ended
                    failed.append(exc)

            workers = [threading.Thread(target=write, args=(k,), name=f"ckptio-dcp-{k}") for k in range(1, len(groups))]
            for t in workers:
                t.start()
            write(0)
            for t in workers:
                t.join()
            if failed:
                raise failed[0]
            if self.fs.failed:  # a region's write failed on one of the other threads (kept by create_stream)
                _, exc = self.fs.failed[0]
                raise (self.fs.errors[0] if self.fs.errors else exc)
            results = [r for part in done for r in part]
        from torch.futures import Future

        fut: Future = Future()
        fut.set_result(results)
        return fut


def _balanced(items: list[Any], n: int) -> list[list[Any]]:
    """``items`` in ``n`` groups of about equal bytes: those written at the head of the file
    (:func:`~.writer.at_head`) in the first group, whose region begins the file, then the others, the largest first,
    each to the lightest group."""
    from .writer import at_head, item_bytes

    groups: list[list[Any]] = [[i for i in items if at_head(i)]] + [[] for _ in range(n - 1)]
    sizes = [sum(item_bytes(i) for i in groups[0])] + [0] * (n - 1)
    for item in sorted((i for i in items if not at_head(i)), key=item_bytes, reverse=True):
        k = sizes.index(min(sizes))
        groups[k].append(item)
        sizes[k] += item_bytes(item)
    return groups


class _ResolvedOnce:
    """The planner's ``resolve_data``, except that a pickled value (``BYTE_IO``) resolved to measure it is handed out
    again as the same bytes (a second pickling could differ)."""

    def __init__(self, planner: Any) -> None:
        from torch.distributed.checkpoint import DefaultSavePlanner

        self.planner = planner
        self._values: dict[Any, Any] = {}
        self._lock = threading.Lock()
        # DCP's own resolve_data: a pickled value is torch.save of the state dict's value (writer.pickled, same bytes)
        kind = type(planner)
        self._default = isinstance(planner, DefaultSavePlanner) and \
            kind.resolve_data is DefaultSavePlanner.resolve_data and \
            kind.lookup_object is DefaultSavePlanner.lookup_object and \
            kind.transform_object is DefaultSavePlanner.transform_object

    def resolve(self, item: Any, keep: bool = False) -> Any:
        from torch.distributed.checkpoint.planner import WriteItemType

        from .writer import pickled

        with self._lock:
            value = self._values.pop(item.index, None)
        if value is None:
            value = (pickled(self.planner.lookup_object(item.index))
                     if self._default and item.type == WriteItemType.BYTE_IO else self.planner.resolve_data(item))
        if keep and isinstance(value, io.BytesIO):
            with self._lock:
                self._values[item.index] = value
        return value


def save(state_dict: dict[str, Any], writer: "FolderWriter | str | Path", rel: str = "", *,
         thread_count: int = 1) -> dict[str, str]:
    """Collective: write ``state_dict`` (local shards on each rank) as the DCP folder ``rel`` of ``writer``
    (a :class:`FolderWriter`, or a local folder written in place).

    Each rank writes one file, ``__R_0.distcp``; with ``thread_count`` > 1 its items are split by size into
    that many regions of the file, written concurrently by DCP's writer threads. A failure on any of those
    threads is raised here, on every rank.

    Returns the files this rank wrote (relative to the writer's folder) with checksums computed as the
    bytes went out.
    """
    if isinstance(writer, (str, Path)):
        from ...storage import LocalFolderWriter

        writer = LocalFolderWriter.in_place(writer)
    base = writer.local_path(rel)
    # a writer whose streams are durable once closed (a bucket's objects) has nothing to fsync: DCP would call
    # os.sync() for a stream with no file descriptor, flushing every file system of the machine
    storage = _OneFilePerRank(str(base), sync_files=not getattr(writer, "writes_whole", False),
                              thread_count=thread_count)
    fs = _WriterFileSystem(writer, rel, base)
    storage.fs = fs
    where = base if rel else writer.local_path()
    key = f"ckptio:{rel}:{_dist.group_key()}:{_dist.world_size()}"

    def written() -> None:  # after this rank's write: a failure only one of the writer threads saw (DCP does not)
        unfinished = [name for name, file in fs._regioned.items() if file.digest is None]
        if fs.failed:
            name, exc = fs.failed[0]
            cause = fs.errors[0] if fs.errors else exc
            raise CheckpointError(f"writing {Path(name).name} failed: {cause}") from exc
        if unfinished:
            raise CheckpointError(f"{unfinished[0]} was not written whole")

    from .rounds import save_steps

    try:  # a failure on the calling thread comes back with its cause (see create_stream)
        with _no_zip_crc32():
            save_steps(state_dict, storage, _planner(key), key=key, where=str(where), written=written)
    except BaseException:
        fs.quiesce()  # before the caller removes the folder
        raise
    return dict(fs.digests)


def _planner(key: str) -> Any:
    """DCP's default planner with its plan cache on (``None`` on 1 rank, and where torch has no such cache).

    Every save on more than one rank sends each rank's plan (an entry per tensor chunk) to the coordinator and the
    global plan back: for an AdamW state of 1,400 items that was ~0.2 s of pickling on 2 ranks, every save. With
    the cache, a rank whose plan equals its plan of the last save (the normal case: the same model and optimizer)
    sends an empty one and the coordinator reuses the global plan; a plan that changed is sent whole (torch
    compares them item by item). The cache is process-wide and keyed by name: one key per DCP folder name and
    process group, so a model and an optimizer, or a background save on its own group, never share an entry."""
    if not _dist.is_dist():
        return None
    from torch.distributed.checkpoint import DefaultSavePlanner

    try:
        planner = DefaultSavePlanner(enable_plan_caching=True)
    except TypeError:  # a torch without the plan cache
        return None
    planner._cached_plans_key = key
    return planner


class _Refused(io.RawIOBase):
    """What a writer thread of DCP's gets for a file once the save has failed: writing it raises."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name, self.error = name, None

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        raise CheckpointError(f"{self.name}: not written, the save had already failed")

    def fileno(self) -> int:
        raise CheckpointError(f"{self.name}: not written, the save had already failed")


@contextmanager
def _plain_errors(what: str, folder: str | Path) -> Iterator[None]:
    """Turn DCP's ``CheckpointException`` (a ``BaseException``!) into a ckptio error naming the folder.

    Every rank receives the same exception from DCP, so every rank raises the same error here.
    """
    try:
        yield
    except CheckpointException as exc:
        failures = {rank: pair[0] if isinstance(pair, tuple) else pair for rank, pair in exc.failures.items()}
        own = failures.get(_dist.rank())
        if isinstance(own, BaseException) and not isinstance(own, Exception):
            raise own from None  # Ctrl-C (KeyboardInterrupt), SystemExit: the user's, not a failure of the folder
        first = failures[min(failures)]
        detail = f"{type(first).__name__}: {first}" if not isinstance(first, CheckpointError) else str(first)
        # a failure inside DCP while loading is a problem with the folder's data (e.g. a chunk whose bytes do
        # not hold the shape its metadata gives): report it as corruption, so that auto-resume falls back
        cls = type(first) if isinstance(first, CheckpointError) else (
            CheckpointCorruptError if what == "loading" else CheckpointError)
        raise cls(f"{what} DCP folder {folder} failed on rank(s) {sorted(failures)}: {detail}") from exc


@contextmanager
def _no_zip_crc32() -> Iterator[None]:
    """DCP writes each tensor as a ``torch.save`` archive, whose zip writer computes a CRC-32 of every record: on the
    reference machine that made a DCP save 3-4x slower than the disk. ``torch.load`` never checks those CRCs
    (ckptio's own CRC-32C of every file, in the manifest, is what guards the bytes), so they are left out while a
    DCP save runs. torch keeps the setting per thread: this turns it off for the calling thread only, and each
    writer thread of :mod:`ckptio.formats.dcp.writer` turns it off for itself (before, the threads DCP
    started for a multi-threaded save still computed it, for about half of each data file)."""
    from torch import serialization

    before = serialization.get_crc32_options()
    serialization.set_crc32_options(False)
    try:
        yield
    finally:
        serialization.set_crc32_options(before)


@contextmanager
def _quiet_single_process() -> Iterator[None]:
    """DCP warns on every single-process call that it assumes a single process; that is our intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield

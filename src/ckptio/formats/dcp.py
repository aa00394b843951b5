"""PyTorch Distributed Checkpoint (DCP) folders: ``__R_K.distcp`` files per rank plus ``.metadata``.

Saving and loading go through ``torch.distributed.checkpoint`` itself, so plain DCP reads what we
write and resharding on load is DCP's. Two things are made safe on the way in:

* ``.metadata`` is a pickle. It is read with an unpickler that admits only DCP's own metadata
  classes, so a hostile file cannot run code.
* Non-tensor values (optimizer hyper-parameters, scheduler state) are loaded with
  ``torch.load(weights_only=True)`` instead of DCP's default unrestricted ``torch.load``.

Call sequence: :func:`save` and :func:`load` are collectives when a process group is initialised
(every rank calls them with its own local state dict); :func:`read_index` is local.
"""

from __future__ import annotations

import io
import os
import threading
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    Metadata,
    TensorStorageMetadata,
)

from .. import _dist
from ..errors import CheckpointCorruptError, CheckpointError
from ..storage.confined import Folder, UnsafePathError, as_folder
from .common import TensorInfo, check_compatible, dtype_name, flatten, torch_dtype
from .dcp_metadata import METADATA_FILE, read_metadata
from .registry import Format, Opened, ShardContext, WriteOptions, register

if TYPE_CHECKING:
    from ..storage.base import FolderWriter
    from .registry import TensorSource

class _ConfinedFileSystem(FileSystem):
    """DCP's filesystem for reading, with every data file opened through the confined :class:`Folder`."""

    def __init__(self, root: Folder, base: Path) -> None:
        super().__init__()
        self.root, self.base = root, base

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        if "r" not in mode or "+" in mode:
            raise CheckpointError(f"{path}: the DCP reader does not write")
        try:
            rel = Path(path).relative_to(self.base).as_posix()
        except ValueError:
            raise UnsafePathError(f"{path}: outside the DCP folder {self.root.path}") from None
        with self.root.open(rel) as handle:
            yield handle.stream()  # type: ignore[misc]


class SafeFileSystemReader(FileSystemReader):
    """DCP's filesystem reader with the restricted metadata unpickler and confined data files."""

    def __init__(self, folder: "str | Path | Folder") -> None:
        self.root = as_folder(folder)
        # DCP joins file names to a base path of its own; a folder in object storage gets a made-up local
        # one, mapped back to the folder by the confined file system (every byte is read through it)
        base = self.root.path if isinstance(self.root.path, Path) else Path("/ckptio-remote-dcp-folder")
        super().__init__(str(base))
        self.fs = _ConfinedFileSystem(self.root, base)

    def read_data(self, plan: Any, planner: Any) -> Any:
        """DCP's read, with each file's items taken in file order: one forward pass per file, so a
        verifying load hashes the bytes as they stream by instead of reading them a second time. (The
        usual load does not come here: :mod:`.dcp_direct` reads it; this serves the rest, see :func:`load`.)"""
        import dataclasses

        storage = self.storage_data
        items = sorted(plan.items, key=lambda it: (storage[it.storage_index].relative_path,
                                                   storage[it.storage_index].offset))
        return super().read_data(dataclasses.replace(plan, items=items), planner)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        filename = METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}"
        metadata = read_metadata(self.root, filename)
        storage_meta = getattr(metadata, "storage_meta", None)
        if storage_meta is not None:
            storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but non-tensor values are loaded with ``weights_only=True``; ``progress``
    is told the bytes of each tensor chunk once it has been read into place."""

    def __init__(self, *args: Any, progress: Callable[[int], None] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.progress = progress

    def commit_tensor(self, read_item: Any, tensor: torch.Tensor) -> None:
        super().commit_tensor(read_item, tensor)
        if self.progress is not None:
            self.progress(tensor.numel() * tensor.element_size())

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as exc:
            raise CheckpointCorruptError(
                f"DCP value {read_item.dest_index.fqn!r} is not a plain value that can be loaded safely: {exc}"
            ) from exc
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._nested_dict import set_element  # noqa: PLC0415

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


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
        self._open = 0  # files being written
        self._closed = False  # set by quiesce(): no new file

    def _rel(self, path: str | os.PathLike) -> str:
        inner = Path(path).relative_to(self.base).as_posix()
        return f"{self.rel}/{inner}" if self.rel else inner

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        if "w" not in mode:
            raise CheckpointError(f"{path}: the DCP writer does not read")
        name = self._rel(path)
        with self._cond:
            live = not self._closed
            self._open += live
        try:
            stream: Any = self.writer.open(name) if live else _Refused(name)
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
            digest = stream.close()
            with self._lock:
                self.digests[name] = digest
        finally:
            if live:
                with self._cond:
                    self._open -= 1
                    self._cond.notify_all()

    def quiesce(self) -> None:
        """Refuse new files and wait for those being written to close.

        When the calling thread fails, DCP raises without joining its extra writer threads; the folder
        is removed next, so none of them may still be creating or writing a file in it.
        """
        with self._cond:
            self._closed = True
            self._cond.wait_for(lambda: self._open == 0)

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        old, new = self._rel(path), self._rel(new_path)
        self.writer.rename(old, new)
        with self._lock:
            if old in self.digests:
                self.digests[new] = self.digests.pop(old)

    def mkdir(self, path: str | os.PathLike) -> None:
        inner = Path(path).relative_to(self.base).as_posix()
        self.writer.local_path("/".join(p for p in (self.rel, "" if inner == "." else inner) if p))

    def exists(self, path: str | os.PathLike) -> bool:
        return self.writer.exists(self._rel(path))


def save(state_dict: dict[str, Any], writer: "FolderWriter | str | Path", rel: str = "", *,
         thread_count: int = 1) -> dict[str, str]:
    """Collective: write ``state_dict`` (local shards on each rank) as the DCP folder ``rel`` of ``writer``
    (a :class:`FolderWriter`, or a local folder written in place).

    With ``thread_count`` > 1 each rank's items are split by size over that many files
    (``__R_0.distcp``, ``__R_1.distcp``, …), written concurrently by DCP's writer threads; plain DCP reads
    them like any folder. A failure on any of those threads is raised here, on every rank.

    Returns the files this rank wrote (relative to the writer's folder) with checksums computed as the
    bytes went out.
    """
    if isinstance(writer, (str, Path)):
        from ..storage import LocalFolderWriter

        writer = LocalFolderWriter.in_place(writer)
    base = writer.local_path(rel)
    storage = FileSystemWriter(str(base), sync_files=True, thread_count=thread_count)
    fs = _WriterFileSystem(writer, rel, base)
    storage.fs = fs
    where = base if rel else writer.local_path()

    def run() -> dict[str, str]:
        try:
            try:
                with _quiet_single_process(), _plain_errors("saving", where), _no_zip_crc32():
                    dcp.save(state_dict, storage_writer=storage, no_dist=not _dist.is_dist(),
                             process_group=_dist.current_group())
            except BaseException:
                fs.quiesce()  # before the caller removes the folder
                raise
        except CheckpointError as exc:
            if fs.errors:  # torch's zip writer reports a failed write as a position mismatch; say what it was
                raise CheckpointError(f"saving DCP folder {where} failed{_which(fs)}: {fs.errors[0]}") from exc
            raise
        if fs.failed:  # on one of DCP's extra writer threads, which DCP does not report
            cause = fs.errors[0] if fs.errors else fs.failed[0][1]
            raise CheckpointError(f"saving DCP folder {where} failed{_which(fs)}: {cause}") from fs.failed[0][1]
        return dict(fs.digests)

    # a failure only a writer thread saw surfaces after DCP's own collectives: every rank raises together
    return _dist.run_collectively(f"saving DCP folder {where}", run) if thread_count > 1 else run()


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


def _which(fs: _WriterFileSystem) -> str:
    return f" writing {Path(fs.failed[0][0]).name}" if fs.failed else ""


def load(state_dict: dict[str, Any], folder: "str | Path | Folder", *, no_dist: bool = False,
         progress: Callable[[int], None] | None = None) -> None:
    """Collective: fill ``state_dict`` in place from a DCP folder, resharding as DCP does.

    ``no_dist=True`` makes it a local read on this rank alone, whatever the process group. ``progress``:
    called with the bytes of each chunk read into place.
    """
    from . import dcp_direct

    reader = SafeFileSystemReader(folder)
    local = no_dist or not _dist.is_dist()
    # each rank plans its own reads from the metadata when DCP's load would do exactly that (dcp_direct);
    # the choice is made together, so that DCP's collective load runs on every rank or on none
    planned = dcp_direct.plan(state_dict, reader.root) if local else \
        _dist.run_collectively(f"planning the load of {reader.root.path}", lambda: dcp_direct.plan(state_dict, reader.root))
    direct = planned is not None if local else all(_dist.all_gather_object(planned is not None))
    if direct:
        assert planned is not None
        if local:
            dcp_direct.execute(planned, progress)
        else:
            _dist.run_collectively(f"loading DCP folder {reader.root.path}", lambda: dcp_direct.execute(planned, progress))
        return
    with _quiet_single_process(), _plain_errors("loading", reader.root.path):
        dcp.load(state_dict, storage_reader=reader, planner=SafeLoadPlanner(progress=progress),
                 process_group=_dist.current_group(),
                 no_dist=no_dist or not _dist.is_dist())


@contextmanager
def _plain_errors(what: str, folder: str | Path) -> Iterator[None]:
    """Turn DCP's ``CheckpointException`` (a ``BaseException``!) into a ckptio error naming the folder.

    Every rank receives the same exception from DCP, so every rank raises the same error here.
    """
    try:
        yield
    except CheckpointException as exc:
        failures = {rank: pair[0] if isinstance(pair, tuple) else pair for rank, pair in exc.failures.items()}
        first = failures[min(failures)]
        detail = f"{type(first).__name__}: {first}" if not isinstance(first, CheckpointError) else str(first)
        # a failure inside DCP while loading is a problem with the folder's data (e.g. a chunk whose bytes do
        # not hold the shape its metadata gives): report it as corruption, so that auto-resume falls back
        cls = type(first) if isinstance(first, CheckpointError) else (
            CheckpointCorruptError if what == "loading" else CheckpointError)
        raise cls(f"{what} DCP folder {folder} failed on rank(s) {sorted(failures)}: {detail}") from exc


_crc_lock = threading.Lock()
_crc_users: list[Any] = [0, True]  # saves in progress, the setting to restore after the last


@contextmanager
def _no_zip_crc32() -> Iterator[None]:
    """DCP writes each tensor with ``torch.save``, whose zip writer computes a CRC-32 of every record: on the
    reference machine that made a DCP save 3-4x slower than the disk. ``torch.load`` never checks those
    CRCs (ckptio's own CRC-32C of every file, in the manifest, is what guards the bytes), so they are left
    out while a DCP save runs. The setting is process-wide: a ``torch.save`` on another thread meanwhile
    also writes records without a CRC (they still load; only zip tools that test CRCs would notice)."""
    from torch import serialization

    with _crc_lock:
        if _crc_users[0] == 0:
            _crc_users[1] = serialization.get_crc32_options()
            serialization.set_crc32_options(False)
        _crc_users[0] += 1
    try:
        yield
    finally:
        with _crc_lock:
            _crc_users[0] -= 1
            if _crc_users[0] == 0:
                serialization.set_crc32_options(_crc_users[1])


@contextmanager
def _quiet_single_process() -> Iterator[None]:
    """DCP warns on every single-process call that it assumes a single process; that is our intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def read_index(folder: "str | Path | Folder") -> dict[str, TensorInfo | None]:
    """Every key of a DCP folder: tensor keys map to their global shape and dtype, others to ``None``."""
    metadata = read_metadata(folder)
    index: dict[str, TensorInfo | None] = {}
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            index[key] = TensorInfo(tuple(md.size), dtype_name(md.properties.dtype))
        else:
            index[key] = None
    return index


def load_all(folder: "str | Path | Folder") -> dict[str, Any]:
    """Every value of a DCP folder, in the nesting it was saved with, without a template from the caller.

    The template is built from the folder's own metadata (tensor shapes and dtypes, and the flattening
    map DCP records); tensor values are read whole, non-tensor values with ``weights_only=True``.
    """
    metadata = read_metadata(folder)
    mapping = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    template: dict[str, Any] = {}
    for key, md in metadata.state_dict_metadata.items():
        path = mapping.get(key, (key,))
        if not isinstance(path, (tuple, list)) or not path or not all(isinstance(p, (str, int)) for p in path):
            raise CheckpointCorruptError(f"{folder}: malformed DCP flattening entry for {key!r}")
        node: Any = template
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise CheckpointCorruptError(f"{folder}: DCP key {key!r} nests inside a value")
        if isinstance(md, TensorStorageMetadata):
            node[path[-1]] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        else:
            node[path[-1]] = None
    load(template, folder, no_dist=True)
    return template


class DCPSource:
    """A DCP folder read tensor by tensor; each read is a single-process DCP load of one key."""

    def __init__(self, folder: "Path | Folder") -> None:
        self.root = as_folder(folder)
        self.folder = self.root.path
        self._index = {k: v for k, v in read_index(self.root).items() if v is not None}

    def index(self) -> dict[str, TensorInfo]:
        return dict(self._index)

    def close(self) -> None:
        """Nothing is held open between reads."""

    def read(self, key: str) -> torch.Tensor:
        if key not in self._index:
            raise CheckpointCorruptError(f"{self.folder}: no tensor {key!r} in its DCP metadata")
        info = self._index[key]
        out = {key: torch.empty(info.shape, dtype=torch_dtype(info.dtype))}
        load(out, self.root, no_dist=True)
        return out[key]


class DCPFormat(Format):
    """PyTorch Distributed Checkpoint folders (``.metadata`` plus ``__R_0.distcp`` per rank)."""

    name = "dcp"
    summary = "PyTorch DCP folder"
    priority = 30
    full_model = True

    def detect(self, path: Path) -> bool:
        return path.is_dir() and (path / METADATA_FILE).is_file()

    def open(self, path: Path) -> Opened:
        return Opened(self.name, DCPSource(path), path)

    def write(self, opened: Opened, source: "TensorSource", out: Path, options: WriteOptions) -> None:
        from ..storage import LocalFolderWriter
        from .hf_bundle import copy_extras

        tensors = {}
        for key in source.index():
            t = source.read(key)
            tensors[key] = t.contiguous()
            if options.progress:
                options.progress(t.numel() * t.element_size())
        writer = LocalFolderWriter.create(out)
        try:
            save(tensors, writer, "")
            if opened.extras is not None:
                copy_extras(opened.extras, writer, "")
            writer.commit()
        except BaseException:
            writer.abort()
            raise

    def index(self, folder: Folder) -> dict[str, TensorInfo | None]:
        return read_index(folder)

    def save_shards(self, state_dict: dict, writer: "FolderWriter", rel: str, ctx: ShardContext) -> dict[str, str]:
        return save(state_dict, writer, rel, thread_count=ctx.threads)

    def load_shards(self, target: dict, folder: Folder, *, strict: bool, ctx: ShardContext) -> None:
        index = _dist.run_collectively("reading the DCP index", lambda: read_index(folder))
        check_compatible(index, target, str(folder.path), strict=strict)
        load(target, folder, progress=ctx.progress)

    def save_state(self, state: dict, writer: "FolderWriter", rel: str, ctx: ShardContext) -> dict[str, str]:
        return save(state, writer, rel, thread_count=ctx.threads)

    def state_index(self, folder: Folder) -> dict[str, TensorInfo | None]:
        return read_index(folder)

    def load_state(self, target: dict, folder: Folder, ctx: ShardContext) -> None:
        load(target, folder, progress=ctx.progress)

    def read_state(self, folder: Folder) -> dict:
        return flatten(load_all(folder))


register(DCPFormat())

"""PyTorch Distributed Checkpoint (DCP) folders: ``__R_0.distcp`` per rank plus ``.metadata``.

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
import pickle
import threading
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem, _StorageInfo
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from .. import _dist
from ..storage.checksum import ChecksummingStream
from ..errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError
from ..storage.confined import Folder, UnsafePathError, check_relative
from .common import TensorInfo, check_exact_cover, dtype_name

METADATA_FILE = ".metadata"

_ALLOWED_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in DCP metadata")


MAX_METADATA_BYTES = 1 << 30


def read_metadata(folder: "str | Path | Folder", filename: str = METADATA_FILE) -> Metadata:
    """DCP's ``.metadata`` of ``folder``, unpickled with an allow-list of DCP's own classes, then checked.

    Checked before it is used: its structure (every field of the right type), the chunks of every
    tensor (inside its shape, covering it exactly once), and every data file it names (a plain
    relative path to a regular file inside ``folder``, holding the bytes the entries need).
    """
    root = folder if isinstance(folder, Folder) else Folder(folder)
    path = root.display(filename)
    if root.kind(filename) is None:
        raise CheckpointNotFoundError(f"{root.path} is not a DCP checkpoint: {filename} is missing")
    data = root.read_bytes(filename, max_size=MAX_METADATA_BYTES)
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as exc:  # any failure to decode is a corrupt or hostile file
        raise CheckpointCorruptError(f"{path}: unreadable DCP metadata ({type(exc).__name__}: {exc})") from exc
    if not isinstance(metadata, Metadata):
        raise CheckpointCorruptError(f"{path}: DCP metadata holds a {type(metadata).__name__}, not Metadata")
    _validate(metadata, path)
    _check_files(metadata, root, path)
    return metadata


def _check_files(md: Metadata, root: Folder, path: Path) -> None:
    """Every file the metadata names is a regular file inside ``root`` that holds the bytes it needs."""
    needed: dict[str, int] = {}
    for info in (md.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for rel, end in sorted(needed.items()):
        size = root.size(rel)  # refuses links, FIFOs, devices and paths leaving the folder, naming them
        if size < end:
            raise CheckpointCorruptError(f"{root.display(rel)}: {size} bytes, but {path} places data up to byte {end} "
                                         "(truncated or from another save)")


def _ints(value: object) -> bool:
    return isinstance(value, (tuple, list, torch.Size)) and all(type(d) is int and d >= 0 for d in value)


def _validate(md: Metadata, path: Path) -> None:
    """The unpickler admits only DCP's classes, but their fields can still be anything: check the shape."""
    def bad(what: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(f"{path}: malformed DCP metadata ({what})")

    entries = getattr(md, "state_dict_metadata", None)
    if not isinstance(entries, dict):
        raise bad("no state_dict_metadata mapping")
    for key, entry in entries.items():
        if not isinstance(key, str):
            raise bad(f"key {key!r} is not a string")
        if isinstance(entry, BytesStorageMetadata):
            continue
        if not isinstance(entry, TensorStorageMetadata):
            raise bad(f"{key!r} has a {type(entry).__name__} entry")
        size, props, chunks = (getattr(entry, a, None) for a in ("size", "properties", "chunks"))
        if not _ints(size):
            raise bad(f"{key!r} has an invalid size {size!r}")
        if not isinstance(getattr(props, "dtype", None), torch.dtype):
            raise bad(f"{key!r} has no valid dtype")
        if not isinstance(chunks, list) or not all(
            isinstance(c, ChunkStorageMetadata) and _ints(getattr(c, "offsets", None)) and _ints(getattr(c, "sizes", None))
            for c in chunks
        ):
            raise bad(f"{key!r} has malformed chunks")
        check_exact_cover(key, tuple(size), [(tuple(c.offsets), tuple(c.sizes), f"chunk {i}")
                                              for i, c in enumerate(chunks)], path)
    storage = getattr(md, "storage_data", None)
    if storage is None:
        storage = md.storage_data = {}
    if not isinstance(storage, dict):
        raise bad("storage_data is not a mapping")
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(getattr(index, "fqn", None), str):
            raise bad(f"storage key {index!r:.80} is not a MetadataIndex")
        if not isinstance(info, _StorageInfo):
            raise bad(f"storage entry of {index.fqn!r} is a {type(info).__name__}")
        rel, offset, length = (getattr(info, a, None) for a in ("relative_path", "offset", "length"))
        check_relative(rel, path)
        if type(offset) is not int or type(length) is not int or offset < 0 or length < 0:
            raise bad(f"storage entry of {index.fqn!r} has offset {offset!r:.40} and length {length!r:.40}")
        descriptors = getattr(info, "transform_descriptors", None)
        if descriptors is not None and (not isinstance(descriptors, (list, tuple))
                                        or not all(isinstance(d, str) for d in descriptors)):
            raise bad(f"storage entry of {index.fqn!r} has malformed transform descriptors")
    for key, entry in entries.items():  # every value DCP could be asked for has its bytes somewhere
        wanted = [MetadataIndex(key)] if isinstance(entry, BytesStorageMetadata) else \
            [MetadataIndex(key, c.offsets) for c in entry.chunks]
        for index in wanted:
            if index not in storage:
                raise bad(f"{key!r} has no storage entry for {'its value' if index.offset is None else f'chunk at {list(index.offset)}'}")


class _ConfinedFileSystem(FileSystem):
    """DCP's filesystem for reading, with every data file opened through the confined :class:`Folder`."""

    def __init__(self, root: Folder) -> None:
        super().__init__()
        self.root = root

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        if "r" not in mode or "+" in mode:
            raise CheckpointError(f"{path}: the DCP reader does not write")
        try:
            rel = Path(path).relative_to(self.root.path).as_posix()
        except ValueError:
            raise UnsafePathError(f"{path}: outside the DCP folder {self.root.path}") from None
        with self.root.open(rel) as handle:
            yield handle.stream()  # type: ignore[misc]


class SafeFileSystemReader(FileSystemReader):
    """DCP's filesystem reader with the restricted metadata unpickler and confined data files."""

    def __init__(self, folder: "str | Path | Folder") -> None:
        self.root = folder if isinstance(folder, Folder) else Folder(folder)
        super().__init__(str(self.root.path))
        self.fs = _ConfinedFileSystem(self.root)

    def read_data(self, plan: Any, planner: Any) -> Any:
        """DCP's read, with each file's items taken in file order: one forward pass per file, so a
        verifying load hashes the bytes as they stream by instead of reading them a second time."""
        import dataclasses

        storage = self.storage_data
        items = sorted(plan.items, key=lambda it: (storage[it.storage_index].relative_path,
                                                   storage[it.storage_index].offset))
        return super().read_data(dataclasses.replace(plan, items=items), planner)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        filename = METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}"
        metadata = read_metadata(self.root, filename)
        if getattr(metadata, "storage_meta", None) is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but non-tensor values are loaded with ``weights_only=True``."""

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


class _ChecksummingFileSystem(FileSystem):
    """DCP's local filesystem, with a running checksum of every file written through it."""

    def __init__(self) -> None:
        super().__init__()
        self.digests: dict[str, str] = {}
        self.errors: list[OSError] = []
        self._lock = threading.Lock()

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with super().create_stream(path, mode) as raw:
            stream = ChecksummingStream(raw)
            try:
                yield stream  # type: ignore[misc]
            finally:
                if stream.error is not None:
                    with self._lock:
                        self.errors.append(stream.error)
            with self._lock:
                self.digests[str(Path(path))] = stream.checksum.digest

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)
        with self._lock:
            if str(Path(path)) in self.digests:
                self.digests[str(Path(new_path))] = self.digests.pop(str(Path(path)))


def save(state_dict: dict[str, Any], folder: str | Path, *, thread_count: int = 1) -> dict[str, str]:
    """Collective: write ``state_dict`` (local shards on each rank) as a DCP folder, fsynced.

    Returns the files this rank wrote (names relative to ``folder``) with checksums computed as the
    bytes went out.
    """
    writer = FileSystemWriter(str(folder), sync_files=True, thread_count=thread_count)
    fs = _ChecksummingFileSystem()
    writer.fs = fs
    try:
        with _quiet_single_process(), _plain_errors("saving", folder):
            dcp.save(state_dict, storage_writer=writer, no_dist=not _dist.is_dist(),
                     process_group=_dist.current_group())
    except CheckpointError as exc:
        if fs.errors:  # torch's zip writer reports a failed write as a position mismatch; say what it was
            raise CheckpointError(f"saving DCP folder {folder} failed: {fs.errors[0]}") from exc
        raise
    root = Path(folder)
    return {str(Path(p).relative_to(root)): d for p, d in fs.digests.items() if Path(p).is_file()}


def load(state_dict: dict[str, Any], folder: "str | Path | Folder", *, no_dist: bool = False) -> None:
    """Collective: fill ``state_dict`` in place from a DCP folder, resharding as DCP does.

    ``no_dist=True`` makes it a local read on this rank alone, whatever the process group.
    """
    reader = SafeFileSystemReader(folder)
    with _quiet_single_process(), _plain_errors("loading", reader.root.path):
        dcp.load(state_dict, storage_reader=reader, planner=SafeLoadPlanner(),
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


def data_files(folder: str | Path) -> list[Path]:
    return sorted(Path(folder).glob("*.distcp"))

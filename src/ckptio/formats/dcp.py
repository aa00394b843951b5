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
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from .. import _dist
from ..storage.checksum import ChecksummingStream
from ..errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError
from .common import TensorInfo, dtype_name

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


def read_metadata(folder: str | Path, filename: str = METADATA_FILE) -> Metadata:
    """DCP's ``.metadata`` of ``folder``, unpickled with an allow-list of DCP's own classes."""
    path = Path(folder) / filename
    if not path.is_file():
        raise CheckpointNotFoundError(f"{folder} is not a DCP checkpoint: {filename} is missing")
    try:
        with open(path, "rb") as fh:
            metadata = _MetadataUnpickler(fh).load()
    except Exception as exc:  # any failure to decode is a corrupt or hostile file
        raise CheckpointCorruptError(f"{path}: unreadable DCP metadata ({type(exc).__name__}: {exc})") from exc
    if not isinstance(metadata, Metadata):
        raise CheckpointCorruptError(f"{path}: DCP metadata holds a {type(metadata).__name__}, not Metadata")
    _validate(metadata, path)
    return metadata


def _validate(md: Metadata, path: Path) -> None:
    """The unpickler admits only DCP's classes, but their fields can still be anything: check the shape."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, ChunkStorageMetadata

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
        if not isinstance(size, (tuple, list, torch.Size)) or not all(isinstance(d, int) and d >= 0 for d in size):
            raise bad(f"{key!r} has an invalid size {size!r}")
        if not isinstance(getattr(props, "dtype", None), torch.dtype):
            raise bad(f"{key!r} has no valid dtype")
        if not isinstance(chunks, list) or not all(
            isinstance(c, ChunkStorageMetadata) and isinstance(getattr(c, "offsets", None), (tuple, list, torch.Size))
            and isinstance(getattr(c, "sizes", None), (tuple, list, torch.Size)) for c in chunks
        ):
            raise bad(f"{key!r} has malformed chunks")
    storage = getattr(md, "storage_data", None)
    if storage is not None and not isinstance(storage, dict):
        raise bad("storage_data is not a mapping")


class SafeFileSystemReader(FileSystemReader):
    """DCP's filesystem reader with the restricted metadata unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        filename = METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}"
        metadata = read_metadata(self.path, filename)
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


def load(state_dict: dict[str, Any], folder: str | Path, *, no_dist: bool = False) -> None:
    """Collective: fill ``state_dict`` in place from a DCP folder, resharding as DCP does.

    ``no_dist=True`` makes it a local read on this rank alone, whatever the process group.
    """
    with _quiet_single_process(), _plain_errors("loading", folder):
        dcp.load(state_dict, storage_reader=SafeFileSystemReader(str(folder)), planner=SafeLoadPlanner(),
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
        cls = type(first) if isinstance(first, CheckpointError) else CheckpointError
        raise cls(f"{what} DCP folder {folder} failed on rank(s) {sorted(failures)}: {detail}") from exc


@contextmanager
def _quiet_single_process() -> Iterator[None]:
    """DCP warns on every single-process call that it assumes a single process; that is our intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def read_index(folder: str | Path) -> dict[str, TensorInfo | None]:
    """Every key of a DCP folder: tensor keys map to their global shape and dtype, others to ``None``."""
    metadata = read_metadata(folder)
    index: dict[str, TensorInfo | None] = {}
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            index[key] = TensorInfo(tuple(md.size), dtype_name(md.properties.dtype))
        else:
            index[key] = None
    return index


def load_all(folder: str | Path) -> dict[str, Any]:
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

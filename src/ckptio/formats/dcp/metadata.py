"""DCP's ``.metadata``, read safely: an allow-list unpickler, then every field checked before use.

``.metadata`` is a pickle. It is read (size-bounded, through the confined folder) with an unpickler that
admits only DCP's own metadata classes, so a hostile file cannot run code. What the classes hold can
still be anything, so the structure is then validated: types of every field, chunks that lie inside
their tensor and cover it exactly once, storage entries for every chunk, and data files that are plain
relative paths to regular files inside the folder holding the bytes the entries need.
"""

from __future__ import annotations

import io
import pickle
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from ...errors import CheckpointCorruptError, CheckpointNotFoundError
from ...storage.confined import Folder, as_folder, check_relative
from ...storage.parse import check_pickle, parsed_once
from ..safetensors.chunk_index import check_cover

__all__ = ["METADATA_FILE", "read_metadata", "boxes", "check_data_files"]

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
    # Megatron-Core keeps the ranks' save plans in the metadata (``all_local_plans``): plain dataclasses
    *(("torch.distributed.checkpoint.planner", name) for name in ("SavePlan", "WriteItem", "WriteItemType",
                                                                  "TensorWriteData")),
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
    root = as_folder(folder)
    path = root.display(filename)
    if root.kind(filename) is None:
        raise CheckpointNotFoundError(f"{root.path} is not a DCP checkpoint: {filename} is missing")
    cache = _parsed.get(root) if isinstance(folder, Folder) else None
    if cache is not None and filename in cache and cache[filename][0] == root.size(filename):
        return cache[filename][1]  # the same folder object during one load: index, plan and reads share it
    with root.open(filename) as handle:  # unpickled as it is read: a file of garbage fails on its first bytes
        if handle.size > MAX_METADATA_BYTES:
            raise CheckpointCorruptError(f"{path}: {handle.size} bytes, more than the {MAX_METADATA_BYTES} DCP metadata "
                                         "may have")
        size = handle.size
        if handle.read(0, min(size, 1)) != b"\x80":  # a pickle of protocol 2 or later: garbage fails here
            raise CheckpointCorruptError(f"{path}: unreadable DCP metadata (not a pickle)")
        data = handle.read(0, size)
    # parsed and validated once per read: these very bytes, seen before in it
    metadata = parsed_once("dcp-metadata", str(path), data, lambda d: _parse(d, path))
    _check_files(metadata, root, path)
    if isinstance(folder, Folder):
        _parsed.setdefault(root, {})[filename] = (size, metadata)
    return metadata


def _parse(data: bytes, path: Path) -> Metadata:
    """The validated :class:`Metadata` of a ``.metadata`` file's bytes."""
    check_pickle(data, path)  # walked by the gate before the unpickler sees it
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as exc:  # any failure to decode is a corrupt or hostile file
        raise CheckpointCorruptError(f"{path}: unreadable DCP metadata ({type(exc).__name__}: {exc})") from exc
    if not isinstance(metadata, Metadata):
        raise CheckpointCorruptError(f"{path}: DCP metadata holds a {type(metadata).__name__}, not Metadata")
    _validate(metadata, path)
    return metadata


_parsed: "weakref.WeakKeyDictionary[Folder, dict[str, tuple[int, Metadata]]]" = weakref.WeakKeyDictionary()
"""Metadata already read and checked through a :class:`Folder` object, by file name (with its size)."""


def _check_files(md: Metadata, root: Folder, path: Path) -> None:
    """Every file the metadata names is a regular file inside ``root`` that holds the bytes it needs."""
    check_data_files(root, ((info.relative_path, info.offset + info.length) for info in (md.storage_data or {}).values()),
                     path)


def check_data_files(root: Folder, ends: Any, where: object) -> None:
    """Each file of ``ends`` (``(name, end byte)`` pairs, a file may come many times) is a regular file inside
    ``root`` that reaches its largest end byte, or a :class:`CheckpointCorruptError` names it and ``where``."""
    needed: dict[str, int] = {}
    for rel, end in ends:
        needed[rel] = max(needed.get(rel, 0), end)
    for rel, end in sorted(needed.items()):
        size = root.size(rel)  # refuses links, FIFOs, devices and paths leaving the folder, naming them
        if size < end:
            raise CheckpointCorruptError(f"{root.display(rel)}: {size} bytes, but {where} places data up to byte {end} "
                                         "(truncated or from another save)")


_BOXES = "_ckptio_chunk_boxes"
"""Where a validated :class:`Metadata` keeps each tensor's chunk offsets and sizes as arrays (see :func:`boxes`)."""


def boxes(md: Metadata, key: str) -> tuple[np.ndarray, np.ndarray]:
    """The offsets and sizes of every chunk of tensor ``key`` as ``(chunks, dims)`` arrays, in the order of its
    ``chunks`` list: made once while :func:`read_metadata` validated them, so that each rank's plan selects its
    chunks with one vectorised test (:func:`ckptio.formats.safetensors.chunk_index.overlapping_rows`)."""
    return md.__dict__[_BOXES][key]


def _boxes(chunks: object, dims: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The chunks' offsets and sizes as int64 arrays, or ``None`` when they are not a list of chunk records holding
    ``dims`` non-negative integers each (a string, a float, a nested list, a negative or a huge number)."""
    if not isinstance(chunks, list) or not all(isinstance(c, ChunkStorageMetadata) for c in chunks):
        return None
    out = []
    for field in ("offsets", "sizes"):
        values = [getattr(c, field, None) for c in chunks]
        if not all(isinstance(v, (tuple, list, torch.Size)) and len(v) == dims
                   and all(type(x) is int and 0 <= x < 1 << 60 for x in v) for v in values):
            return None
        out.append(np.array(values, dtype=np.int64).reshape(len(values), dims))
    return out[0], out[1]


def _ints(value: object) -> bool:
    return isinstance(value, (tuple, list, torch.Size)) and all(type(d) is int and d >= 0 for d in value)


def _validate(md: Metadata, path: Path) -> None:
    """The unpickler admits only DCP's classes, but their fields can still be anything: check the shape."""
    def bad(what: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(f"{path}: malformed DCP metadata ({what})")

    entries = getattr(md, "state_dict_metadata", None)
    if not isinstance(entries, dict):
        raise bad("no state_dict_metadata mapping")
    tables: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    md.__dict__[_BOXES] = tables
    for key, entry in entries.items():
        if not isinstance(key, str):
            raise bad(f"key {key!r} is not a string")
        if isinstance(entry, BytesStorageMetadata):
            continue
        if not isinstance(entry, TensorStorageMetadata):
            raise bad(f"{key!r} has a {type(entry).__name__} entry")
        size: Any
        size, props, chunks = (getattr(entry, a, None) for a in ("size", "properties", "chunks"))
        if not _ints(size):
            raise bad(f"{key!r} has an invalid size {size!r}")
        if not isinstance(getattr(props, "dtype", None), torch.dtype):
            raise bad(f"{key!r} has no valid dtype")
        boxes = _boxes(chunks, len(size))
        if boxes is None:
            raise bad(f"{key!r} has malformed chunks")
        count = len(boxes[0])
        check_cover(key, tuple(size), *boxes, lambda: [f"chunk {i}" for i in range(count)], path)
        tables[key] = boxes
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

"""Loading a DCP folder without DCP's planning round: each rank plans its own reads from the metadata.

``torch.distributed.checkpoint.load`` gathers every rank's plan on rank 0, checks them, scatters them
back, and gathers once more after the reads. Those rounds pickle one read item per chunk and, on a
few ranks sharing cores, cost as much as the reads themselves. Nothing in a load needs them: the
metadata (read with ckptio's allow-list unpickler and validated: chunks cover each tensor exactly
once, every file is a regular file of the folder holding the bytes named) says where every chunk
is, and :func:`ckptio.engine.plan.overlap` says which part of which chunk lands in this rank's part of each
tensor — the same planning the safetensors loader does.

:func:`plan` covers the common case exactly as DCP would load it (same flattened keys, same strict
key and shape checks); anything else (a missing key, a shape that differs, storage transforms, a
``ShardedTensor``) returns ``None`` and the caller runs DCP's own load, so its errors and behaviour
stay DCP's. :func:`execute` then reads every chunk in file order, straight into the destination
(:mod:`.items`), and sets non-tensor values with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import io
import weakref
from collections import Counter
from dataclasses import dataclass
from itertools import groupby
from typing import Any, Callable

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from ...errors import CheckpointCorruptError
from ...engine.plan import local_view, overlap
from ...storage.confined import Folder
from .items import parse, plain_value, read_into
from ..safetensors import chunk_index
from ..safetensors.chunk_index import overlapping_rows
from ..common import TensorInfo, dtype_name
from .. import safe_pickle
from ..pt import check_bytes
from .metadata import boxes, check_data_files, read_metadata

__all__ = ["Plan", "Layout", "layout", "plan", "execute"]


@dataclass
class _Read:
    file: str
    offset: int
    length: int
    key: str
    src_lo: list[int]
    dst: torch.Tensor | None  # None: a non-tensor value, set at ``path``
    path: tuple = ()
    chunk: tuple = ()  # the stored chunk's shape
    owner: int = 0  # the identity of the state dict's value ``dst`` is a part of


@dataclass
class Plan:
    """What one rank reads of a DCP folder: the byte ranges and the state dict they fill."""
    folder: Folder
    reads: list[_Read]
    state_dict: dict


class Layout:
    """What a load needs of a DCP folder: every tensor's shape and dtype and where its chunks are, every value's
    record and DCP's flattening paths. Read from the folder's chunk index (:mod:`ckptio.formats.safetensors.chunk_index`, one small file)
    when ckptio wrote it, else from its ``.metadata`` (:func:`read_metadata`, validated)."""

    def __init__(self, folder: Folder) -> None:
        self.index = chunk_index.read(folder, "dcp")
        self.metadata = read_metadata(folder) if self.index is None else None
        if self.index is not None:
            self._check_files(folder)
            self.tensors = {k: info for k, (info, _) in self.index.tensors.items()}
            self.values = set(self.index.values)
            self.paths = dict(self.index.paths)
            self.order = self.index.order
            self.transforms = False
            return
        md: Any = self.metadata
        self.tensors = {k: TensorInfo(tuple(e.size), dtype_name(e.properties.dtype))
                        for k, e in md.state_dict_metadata.items() if not isinstance(e, BytesStorageMetadata)}
        self.values = {k for k, e in md.state_dict_metadata.items() if isinstance(e, BytesStorageMetadata)}
        self.paths = md.planner_data if isinstance(md.planner_data, dict) else {}
        self.order = list(md.state_dict_metadata)
        self.transforms = any(info.transform_descriptors for info in md.storage_data.values())

    def _check_files(self, folder: Folder) -> None:
        """Every data file the index names is a regular file of the folder holding the bytes it places there."""
        assert self.index is not None
        ends = [(table.names[i], end) for _, table in self.index.tensors.values()
                for i, end in zip(table.file.tolist(), table.spans[:, 1].tolist())]
        ends += [(name, end) for name, _, end in self.index.values.values()]
        check_data_files(folder, ends, folder.display(chunk_index.INDEX_NAME))

    def value(self, key: str) -> tuple[str, int, int]:
        """File, offset and length of a non-tensor value's record."""
        if self.index is not None:
            name, begin, end = self.index.values[key]
            return name, begin, end - begin
        assert self.metadata is not None
        info = self.metadata.storage_data[MetadataIndex(key)]
        return info.relative_path, info.offset, info.length

    def pieces(self, key: str, offsets: tuple[int, ...], shape: tuple[int, ...]) -> list[tuple[str, int, int, tuple, tuple]]:
        """The stored chunks of ``key`` that share an element with the part at ``offsets`` of size ``shape``, as
        (file, offset, length, chunk offsets, chunk sizes): one vectorised test, not a loop over every rank's chunks."""
        if self.index is not None:
            out = []
            for piece in self.index.tensors[key][1].overlapping(offsets, shape):
                assert piece.span is not None
                out.append((piece.file, piece.span[0], piece.span[1] - piece.span[0], piece.offsets, piece.shape))
            return out
        md: Any = self.metadata
        offs, sizes = boxes(md, key)
        chunks = md.state_dict_metadata[key].chunks
        infos = [(md.storage_data[MetadataIndex(key, chunks[i].offsets)], chunks[i])
                 for i in overlapping_rows(offs, sizes, offsets, shape)]
        return [(info.relative_path, info.offset, info.length, tuple(c.offsets), tuple(c.sizes)) for info, c in infos]


_layouts: "weakref.WeakKeyDictionary[Folder, Layout]" = weakref.WeakKeyDictionary()


def layout(folder: Folder) -> Layout:
    """The folder's :class:`Layout`, read once per :class:`Folder` object (the index check, the plan and the reads
    of one load share it)."""
    found = _layouts.get(folder)
    if found is None:
        found = _layouts[folder] = Layout(folder)
    return found


def plan(state_dict: dict, folder: Folder, skip: "frozenset[int]" = frozenset()) -> Plan | None:
    """This rank's reads to fill ``state_dict`` from ``folder``; ``None`` when DCP's own load should run. ``skip``:
    identities of tensors another rank reads for this one (checked against the metadata, not read)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.tensor import DTensor

    where = layout(folder)
    if where.transforms:
        return None
    try:
        flat, mappings = flatten_state_dict(state_dict)
    except ValueError:
        return None
    reads: list[_Read] = []
    for key, obj in flat.items():
        if key in where.values:
            if isinstance(obj, torch.Tensor):
                return None
            reads.append(_Read(*where.value(key), key, [], None, tuple(mappings[key])))
            continue
        info = where.tensors.get(key)
        if info is None:
            return None
        if not isinstance(obj, torch.Tensor) or type(obj) not in (torch.Tensor, torch.nn.Parameter, DTensor) \
                or tuple(obj.shape) != info.shape:
            return None
        if isinstance(obj, DTensor) and obj.device_mesh.get_coordinate() is None:
            continue  # this rank is not on the tensor's mesh: nothing of it is here
        if id(obj) in skip:  # its shape was checked above; its bytes come from the rank that reads them
            continue
        view = local_view(obj)
        local = view.local.detach()
        if local.numel() == 0:
            continue
        for file, offset, length, chunk_offsets, chunk_sizes in where.pieces(key, view.offsets, tuple(local.shape)):
            box = overlap(view.offsets, tuple(local.shape), chunk_offsets, chunk_sizes)
            if box is None:
                continue
            reads.append(_Read(file, offset, length, key, list(box.src_lo), local[box.dst_index()], chunk=chunk_sizes,
                               owner=id(obj)))
    return Plan(folder, sorted(reads, key=lambda r: (r.file, r.offset)), state_dict)


def execute(p: Plan, progress: Callable[[int], None] | None = None,
            filled: Callable[[int], None] | None = None) -> None:
    """Do the reads of :func:`plan`, one forward pass over each file; ``filled`` is called with a tensor's identity
    once its last chunk is read."""
    from torch.distributed.checkpoint._nested_dict import set_element

    left = Counter(r.owner for r in p.reads if r.dst is not None) if filled is not None else Counter()

    for rel, group in groupby(p.reads, key=lambda r: r.file):  # sorted by file, then offset
        reads = list(group)
        with p.folder.open(rel) as handle:
            handle.advise([(r.offset, r.offset + r.length) for r in reads])
            memo: dict[bytes, Any] = {}
            for r in reads:
                if r.dst is None:
                    plain, value = plain_value(handle, r.offset, r.length, memo)
                    if not plain:
                        value = _value(handle.read(r.offset, r.length), handle.path, r.key)
                    set_element(p.state_dict, r.path, value)
                    continue
                stored = parse(handle, r.offset, r.length)
                if stored is None:
                    _read_with_torch(handle, r)
                else:
                    if stored.size != r.chunk:
                        raise CheckpointCorruptError(f"{handle.path}: chunk of {r.key!r} at byte {r.offset} holds a "
                                                     f"tensor of shape {list(stored.size)}, the metadata says {list(r.chunk)}")
                    read_into(handle, stored, r.src_lo, list(r.dst.shape), r.dst)
                if progress is not None:
                    progress(r.dst.numel() * r.dst.element_size())
                if filled is not None:
                    left[r.owner] -= 1
                    if not left[r.owner]:
                        filled(r.owner)


def _value(data: bytes, path: Any, key: str) -> Any:
    """A non-tensor value: ``torch.load(weights_only=True)``, or where that refuses a class, ckptio's restricted
    unpickler (numpy arrays: Megatron's ``rng_state`` holds numpy's RNG state). A framework's class is refused."""
    where = f"{path}: DCP value {key!r}"
    check_bytes(data, where)
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except Exception:
        pass
    try:
        value, placeholders = safe_pickle.loads(data, where)
    except CheckpointCorruptError as exc:
        raise CheckpointCorruptError(f"{path}: DCP value {key!r} is not a plain value that can be loaded safely: "
                                     f"{exc}") from exc
    if placeholders:
        raise CheckpointCorruptError(f"{where} holds objects of {', '.join(placeholders)}, which ckptio does not "
                                     "build")
    return value


def _read_with_torch(handle: Any, r: _Read) -> None:
    """An archive the direct reader does not take (compressed, say): ``torch.load(weights_only=True)``."""
    assert r.dst is not None
    data = handle.read(r.offset, r.length)
    check_bytes(data, f"{handle.path}: chunk of {r.key!r} at byte {r.offset}")
    try:
        whole = torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:
        raise CheckpointCorruptError(f"{handle.path}: chunk of {r.key!r} at byte {r.offset} cannot be read: "
                                     f"{exc}") from exc
    if not isinstance(whole, torch.Tensor) or tuple(whole.shape) != r.chunk:
        raise CheckpointCorruptError(f"{handle.path}: chunk of {r.key!r} at byte {r.offset} is not a tensor of "
                                     f"shape {list(r.chunk)}")
    box = whole[tuple(slice(a, a + n) for a, n in zip(r.src_lo, r.dst.shape))]
    with torch.no_grad():
        r.dst.copy_(box)

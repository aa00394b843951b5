"""Loading a DCP folder without DCP's planning round: each rank plans its own reads from the metadata.

``torch.distributed.checkpoint.load`` gathers every rank's plan on rank 0, checks them, scatters them
back, and gathers once more after the reads. Those rounds pickle one read item per chunk and, on a
few ranks sharing cores, cost as much as the reads themselves. Nothing in a load needs them: the
metadata (read with ckptio's allow-list unpickler and validated: chunks cover each tensor exactly
once, every file is a regular file of the folder holding the bytes named) says where every chunk
is, and :func:`ckptio.plan.overlap` says which part of which chunk lands in this rank's part of each
tensor — the same planning the safetensors loader does.

:func:`plan` covers the common case exactly as DCP would load it (same flattened keys, same strict
key and shape checks); anything else (a missing key, a shape that differs, storage transforms, a
``ShardedTensor``) returns ``None`` and the caller runs DCP's own load, so its errors and behaviour
stay DCP's. :func:`execute` then reads every chunk in file order, straight into the destination
(:mod:`.dcp_items`), and sets non-tensor values with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from itertools import groupby
from typing import Any, Callable

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from ..errors import CheckpointCorruptError
from ..plan import local_view, overlap
from ..storage.confined import Folder
from .dcp_items import parse, plain_value, read_into
from .dcp_metadata import read_metadata

__all__ = ["Plan", "plan", "execute"]


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


@dataclass
class Plan:
    """What one rank reads of a DCP folder: the byte ranges and the state dict they fill."""
    folder: Folder
    reads: list[_Read]
    state_dict: dict


def plan(state_dict: dict, folder: Folder) -> Plan | None:
    """This rank's reads to fill ``state_dict`` from ``folder``; ``None`` when DCP's own load should run."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.tensor import DTensor

    metadata = read_metadata(folder)
    entries, storage = metadata.state_dict_metadata, metadata.storage_data
    if any(info.transform_descriptors for info in storage.values()):
        return None
    try:
        flat, mappings = flatten_state_dict(state_dict)
    except ValueError:
        return None
    reads: list[_Read] = []
    for key, obj in flat.items():
        md = entries.get(key)
        if md is None:
            return None
        if isinstance(md, BytesStorageMetadata):
            if isinstance(obj, torch.Tensor):
                return None
            info = storage[MetadataIndex(key)]
            reads.append(_Read(info.relative_path, info.offset, info.length, key, [], None, tuple(mappings[key])))
            continue
        if not isinstance(obj, torch.Tensor) or type(obj) not in (torch.Tensor, torch.nn.Parameter, DTensor) \
                or tuple(obj.shape) != tuple(md.size):
            return None
        if isinstance(obj, DTensor) and obj.device_mesh.get_coordinate() is None:
            continue  # this rank is not on the tensor's mesh: nothing of it is here
        view = local_view(obj)
        local = view.local.detach()
        if local.numel() == 0:
            continue
        for chunk in md.chunks:
            box = overlap(view.offsets, tuple(local.shape), tuple(chunk.offsets), tuple(chunk.sizes))
            if box is None:
                continue
            info = storage[MetadataIndex(key, chunk.offsets)]
            reads.append(_Read(info.relative_path, info.offset, info.length, key, list(box.src_lo),
                               local[box.dst_index()], chunk=tuple(chunk.sizes)))
    return Plan(folder, sorted(reads, key=lambda r: (r.file, r.offset)), state_dict)


def execute(p: Plan, progress: Callable[[int], None] | None = None) -> None:
    """Do the reads of :func:`plan`, one forward pass over each file."""
    from torch.distributed.checkpoint._nested_dict import set_element

    for rel, reads in groupby(p.reads, key=lambda r: r.file):  # sorted by file, then offset
        with p.folder.open(rel) as handle:
            for r in reads:
                if r.dst is None:
                    plain, value = plain_value(handle, r.offset, r.length)
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


def _value(data: bytes, path: Any, key: str) -> Any:
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:
        raise CheckpointCorruptError(f"{path}: DCP value {key!r} is not a plain value that can be loaded safely: "
                                     f"{exc}") from exc


def _read_with_torch(handle: Any, r: _Read) -> None:
    """An archive the direct reader does not take (compressed, say): ``torch.load(weights_only=True)``."""
    assert r.dst is not None
    try:
        whole = torch.load(io.BytesIO(handle.read(r.offset, r.length)), weights_only=True)
    except Exception as exc:
        raise CheckpointCorruptError(f"{handle.path}: chunk of {r.key!r} at byte {r.offset} cannot be read: "
                                     f"{exc}") from exc
    if not isinstance(whole, torch.Tensor) or tuple(whole.shape) != r.chunk:
        raise CheckpointCorruptError(f"{handle.path}: chunk of {r.key!r} at byte {r.offset} is not a tensor of "
                                     f"shape {list(r.chunk)}")
    box = whole[tuple(slice(a, a + n) for a, n in zip(r.src_lo, r.dst.shape))]
    with torch.no_grad():
        r.dst.copy_(box)

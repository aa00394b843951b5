"""Plans: which rank writes which bytes of a tensor, and which stored bytes fill which rank's part.

Between deciding to save (:mod:`ckptio.manager`) and laying bytes out (:mod:`ckptio.formats`) sit two
questions that depend only on layouts, never on a format:

* **Save** — for each tensor of this rank's state dict: the local data, the tensor's global shape, the
  offsets of the local part inside it, and whether this rank is the one that writes it (a tensor
  replicated over some mesh dimensions is written once, by the replica at coordinate 0 there):
  :func:`local_view`.
* **Load** — for each stored chunk of a tensor and this rank's local part: the box where they overlap,
  as indices into the chunk and into the local tensor: :func:`overlap`. Stored chunks are first checked to
  cover the tensor exactly once (:func:`ckptio.formats.common.check_exact_cover`).

Everything here is local arithmetic on shapes and offsets: cheap, and linear in the number of chunks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["LocalView", "local_view", "Box", "overlap", "spans_whole_rows", "chunk_of", "chunk_owners"]


@dataclass(frozen=True)
class LocalView:
    """The part of a tensor this rank holds: its data, the global shape and where the part sits in it."""
    local: torch.Tensor
    """This rank's data (a DTensor's local shard, or the whole tensor)."""
    shape: tuple[int, ...]
    """The global shape."""
    offsets: tuple[int, ...]
    """Where ``local`` starts inside the global tensor."""
    owner: bool | None
    """Whether this rank writes it: ``None`` for a plain tensor (every rank holds all of it)."""


def local_view(value: Any) -> LocalView:
    """The part of ``value`` this rank holds and where it lies (a ``Partial`` DTensor is reduced first)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    if isinstance(value, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        if any(isinstance(p, Partial) for p in value.placements):
            value = value.redistribute(placements=[Replicate() if isinstance(p, Partial) else p for p in value.placements])
        local = value.to_local()
        _shape, offsets = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
        coord = value.device_mesh.get_coordinate() or []
        owner = all(c == 0 for c, p in zip(coord, value.placements) if isinstance(p, Replicate))
        return LocalView(local, tuple(value.shape), tuple(int(o) for o in offsets), owner)
    return LocalView(value, tuple(value.shape), (0,) * value.dim(), None)


def chunk_of(key: str, view: LocalView) -> tuple[str, tuple[int, ...]] | None:
    """The chunk ``view`` would write, named by key and offsets; ``None`` when it is not this rank's to write.

    A DTensor replicated over some dimension of its own mesh is offered only by the replica at coordinate
    0 there; a plain tensor (``owner is None``) and every other DTensor shard is offered by whoever holds
    it, and :func:`chunk_owners` then picks one writer among the ranks that offer the same chunk.
    """
    if view.owner is False:
        return None
    return key, view.offsets


def chunk_owners(chunks_by_rank: list[list[tuple[str, tuple[int, ...]]]]) -> dict[tuple[str, tuple[int, ...]], int]:
    """Which rank writes each chunk: the lowest rank that offers it (see :func:`chunk_of`).

    Under data parallelism every rank holds every plain tensor (rank 0 writes them all); under pipeline
    parallelism each rank holds its own stage's, and each is written by the one rank that has it — without
    this, a stage other than the first would never reach the disk. Under FSDP × TP on a 2-D mesh a
    parameter that tensor parallelism leaves whole is a DTensor on the data-parallel sub-mesh only: its
    mesh does not know the TP replicas, so every TP rank offers the same shard and only the lowest writes
    it (before, each replica wrote it and the files held it twice). Linear in the number of chunks.
    """
    owners: dict[tuple[str, tuple[int, ...]], int] = {}
    for rank, chunks in enumerate(chunks_by_rank):
        for key, offsets in chunks:
            owners.setdefault((key, tuple(offsets)), rank)
    return owners


@dataclass(frozen=True)
class Box:
    """The overlap of a stored chunk and a local part, as per-dimension index ranges into each."""

    src_lo: tuple[int, ...]
    src_hi: tuple[int, ...]
    dst_lo: tuple[int, ...]
    dst_hi: tuple[int, ...]

    def dst_index(self) -> tuple[slice, ...]:
        return tuple(slice(a, b) for a, b in zip(self.dst_lo, self.dst_hi))


def overlap(local_offsets: tuple[int, ...], local_shape: tuple[int, ...], chunk_offsets: tuple[int, ...],
            chunk_shape: tuple[int, ...]) -> Box | None:
    """Where a stored chunk and a local part of the same tensor overlap (``None``: they do not)."""
    lo = [max(a, b) for a, b in zip(local_offsets, chunk_offsets)]
    hi = [min(a + n, b + m) for a, n, b, m in zip(local_offsets, local_shape, chunk_offsets, chunk_shape)]
    if lo and any(h <= l for l, h in zip(lo, hi)):
        return None
    src_lo = tuple(l - c for l, c in zip(lo, chunk_offsets))
    src_hi = tuple(h - c for h, c in zip(hi, chunk_offsets))
    dst_lo = tuple(l - o for l, o in zip(lo, local_offsets))
    dst_hi = tuple(h - o for h, o in zip(hi, local_offsets))
    return Box(src_lo, src_hi, dst_lo, dst_hi)


def spans_whole_rows(box: Box, chunk_shape: tuple[int, ...], local_shape: tuple[int, ...]) -> bool:
    """Whether ``box`` covers every trailing dimension of both the chunk and the local part fully."""
    return all(a == 0 and b == n for a, b, n in zip(box.src_lo[1:], box.src_hi[1:], chunk_shape[1:])) and \
        all(a == 0 and b == n for a, b, n in zip(box.dst_lo[1:], box.dst_hi[1:], local_shape[1:]))

"""What each rank's ZeRO file says it holds, checked against the partition the reader takes from it.

The reader puts the ranks' partitions end to end in the order of their file names (``zero_pp_rank_R_…``), as
DeepSpeed does. Files swapped or renamed would then give every parameter other values, silently, since the sizes are
the same. Each stage 1-2 file records which elements of its group it holds: ``param_slice_mappings[g]`` names every
parameter of its partition with its ``fragment_address(numel, start)`` in it, and ``partition_count`` the number of
ranks. Both are compared with what rank R's partition of ``param_shapes`` holds (rank R holds elements ``R * size``
to ``(R + 1) * size`` of the group flattened); a file that disagrees is refused by name, with the rank whose
partition it does hold when there is one. (Files of DeepSpeed versions that did not record the mappings are read as
named.)

Stage 3's files record no more than their number of ranks: what tells rank R's file is its padding. Each parameter of
``numel`` elements is split in ``part = ceil(numel / N)`` per rank, rank R holding elements ``R * part`` on; where
that runs past ``numel``, the rest of rank R's part is padding. DeepSpeed keeps the gradients of padding at zero (its
gradient partitions are zeroed buffers into which only real elements are copied), so Adam's ``exp_avg`` and
``exp_avg_sq`` are exactly zero there; its fp32 copy of the padding is not (uninitialised memory) and neither are the
frozen parameters' fragments: those are not checked. :func:`check_padding` reads the moments at every padded place
of every rank's file and refuses a file holding anything else there. It catches a swap only where the padding says it:
a parameter whose numel is not a multiple of N, Adam's moments saved, a file moved under the name of a rank that pads
where the file's own rank does not, and moments not all exactly zero at those places (a gradient never non-zero).
"""

from __future__ import annotations

import math
from typing import Any

from ...errors import CheckpointCorruptError
from ..safe_pickle import Placeholder

__all__ = ["check_count", "check_padding", "check_slices"]


def check_count(osd: Any, where: object, world: int, group: int | None) -> None:
    """The number of ranks the file says it was a partition of (``partition_count``: one per group at stages 1-2, one
    number at stage 3), where it says one, is ``world``."""
    count = osd.get("partition_count") if isinstance(osd, dict) else None
    if isinstance(count, list) and group is not None:
        count = count[group] if group < len(count) else None
    if type(count) is int and count != world:
        raise CheckpointCorruptError(f"{where}: a partition of {count} ranks (partition_count); the checkpoint was "
                                     f"saved on {world} (dp_world_size)")


def _expected(group: dict[str, tuple[int, ...]], rank: int, size: int) -> dict[str, tuple[int, int]]:
    """(numel, start) of every parameter rank ``rank``'s partition of ``size`` elements holds part of."""
    out, offset, lo_rank, hi_rank = {}, 0, rank * size, (rank + 1) * size
    for name, shape in group.items():
        numel = math.prod(shape)
        lo, hi = max(offset, lo_rank), min(offset + numel, hi_rank)
        if lo < hi:
            out[name] = (hi - lo, lo - lo_rank)
        offset += numel
    return out


def _address(value: Any, where: object, name: str) -> tuple[int, int]:
    state = value.state if isinstance(value, Placeholder) and isinstance(value.state, dict) else None
    numel, start = (state.get("numel"), state.get("start")) if state is not None else (None, None)
    if type(numel) is not int or type(start) is not int:
        raise CheckpointCorruptError(f"{where}: param_slice_mappings[{name[:80]!r}] is not a fragment address "
                                     f"({str(value)[:80]})")
    return numel, start


def check_slices(osd: Any, where: object, rank: int, world: int, g: int, group: dict[str, tuple[int, ...]],
                 size: int) -> None:
    """Rank ``rank``'s file of a stage 1-2 checkpoint holds rank ``rank``'s partition of group ``g`` (``size``
    elements), as its ``partition_count`` and ``param_slice_mappings`` say; else an error naming the file."""
    check_count(osd, where, world, g)
    mappings = osd.get("param_slice_mappings") if isinstance(osd, dict) else None
    if mappings is None:
        return  # not recorded (an older DeepSpeed)
    if not isinstance(mappings, list) or g >= len(mappings) or not isinstance(mappings[g], dict):
        raise CheckpointCorruptError(f"{where}: param_slice_mappings holds no mapping of group {g}")
    said = {str(name): _address(v, where, str(name)) for name, v in mappings[g].items()}
    if said == _expected(group, rank, size):
        return
    holds = [r for r in range(world) if r != rank and said == _expected(group, r, size)]
    if holds:
        raise CheckpointCorruptError(f"{where}: holds the partition of rank {holds[0]} (its param_slice_mappings), not "
                                     f"rank {rank}'s that its name says: the ranks' files were swapped or renamed")
    first = next((n for n in said.keys() | _expected(group, rank, size).keys()
                  if said.get(n) != _expected(group, rank, size).get(n)), "?")
    raise CheckpointCorruptError(f"{where}: its param_slice_mappings say it holds {said.get(first)} (numel, start) of "
                                 f"{first[:80]!r} in group {g}; rank {rank}'s partition of param_shapes holds "
                                 f"{_expected(group, rank, size).get(first)}")


def check_padding(moments: dict[str, list[Any]], wheres: list[object], params: list[tuple[str, int, int]],
                  world: int) -> None:
    """Stage 3: in every rank's file, Adam's ``moments`` (per kind, one flat vector per rank) are zero where its rank's
    partition of a parameter is padding; ``params`` gives each parameter's name, numel and offset in every rank's flat
    vector. Else an error naming the file: it holds another rank's partition."""
    for r, where in enumerate(wheres):
        for name, numel, offset in params:
            part = math.ceil(numel / world)
            real = min(part, max(0, numel - r * part))
            if real == part:
                continue
            for m, flats in moments.items():
                if flats[r].read(offset + real, part - real).any():
                    raise CheckpointCorruptError(
                        f"{where}: its {m} of {name[:80]!r} is not zero at elements {real}..{part} of its partition, "
                        f"which rank {r}'s partition holds as padding ({numel} elements on {world} ranks, {part} each; "
                        f"DeepSpeed keeps Adam's state of padding zero): not rank {r}'s partition, the ranks' files "
                        "were swapped or renamed")

"""A legacy Megatron checkpoint's rank files made one model: each parameter's tensor-parallel shards merged
(:func:`merge_tp`), one model chunk of a pipeline stage at a time (:func:`_merge_chunk`), with where each weight was
read (:func:`_held_in`: its rank file, for a refusal of its shape to name)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

from ...errors import CheckpointCorruptError, CheckpointError
from .layout import GLOBAL_SPLIT, LAYER_SPLIT, _LAYER, _RENAME
from . import moe


def _kind(key: str, where: object) -> tuple[str, Any, int | None]:
    """(name with layer index placeholder, split, layer index) of a canonical weight key; refuses others."""
    m = _LAYER.match(key)
    if m:
        suffix = _RENAME.get(m.group(2), m.group(2))
        if suffix in LAYER_SPLIT:
            return suffix, LAYER_SPLIT[suffix], int(m.group(1))
        expert = moe.kind(suffix)  # a mixture of experts' router and experts
        if expert is not None:
            return expert[0], expert[1], int(m.group(1))
    elif key in GLOBAL_SPLIT:
        return key, GLOBAL_SPLIT[key], None
    raise CheckpointError(f"{where}: {key!r} is not a parameter of a Llama-style Megatron GPT model (ckptio maps "
                          "RMSNorm + SwiGLU + RoPE models without linear biases, or with biases on the query/key/value "
                          "projection only (Qwen2), or with query/key norms (Qwen3); see docs/converters.md)")


def merge_tp(parts: list[torch.Tensor], split: Any, key: str, where: object) -> torch.Tensor:
    """One parameter whole from its tensor-parallel shards (in TP rank order)."""
    if split is None:
        return parts[0]
    if len({tuple(p.shape) for p in parts}) != 1:
        raise CheckpointCorruptError(f"{where}: the TP shards of {key!r} differ in shape: {[list(p.shape) for p in parts]}")
    if parts[0].dim() <= (0 if split == "glu" else split):
        raise CheckpointCorruptError(f"{where}: {key!r} has {parts[0].dim()} dimension(s); its tensor-parallel shards "
                                     f"are split along dimension {0 if split == 'glu' else split}")
    if split == "glu":
        if parts[0].shape[0] % 2:
            raise CheckpointCorruptError(f"{where}: {key!r} has an odd number of rows; it cannot hold [gate; up]")
        halves = [p.chunk(2, dim=0) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(parts, dim=split)


def _held_in(folder: Path, rel: str, experts: dict[str, str], chunk: int | None) -> Callable[[str], str]:
    """Where each key of TP rank 0's model chunk ``chunk`` (``None``: a rank file's one ``model``) was read: the rank
    file ``rel``, or with expert parallelism an expert's in ``experts`` (the file of the EP rank holding it,
    :func:`.moe.rank_models`)."""
    within = "" if chunk is None else f"'s model{chunk}"
    return lambda key: f"read from {folder.name}/{experts.get(key, rel)}{within}"


def _merge_chunk(shards: list[tuple[Any, dict[str, dict[str, torch.Tensor]]]], held: Callable[[str], str]
                 ) -> tuple[Any, dict[str, dict[tuple[str, int | None], torch.Tensor]], list[int],
                            dict[tuple[str, int | None], str]]:
    """One model chunk of a pipeline stage merged over its TP ranks' ``shards``: where it was read, each part's
    tensors keyed by (name with the layer left out, chunk-local layer or ``None``), the chunk's layer numbers, and
    where each weight was read (``held``: by the key of TP rank 0's, :func:`_held_in`)."""
    where, first = shards[0]
    keys = list(first[""])
    for other, parts in shards[1:]:
        if set(parts[""]) != set(keys):
            raise CheckpointCorruptError(f"{other}: holds other parameters than {where}: "
                                         f"{sorted(set(parts['']) ^ set(keys))[:3]}")
    out: dict[str, dict[tuple[str, int | None], torch.Tensor]] = {part: {} for part in first}
    layers: set[int] = set()
    origins: dict[tuple[str, int | None], str] = {}
    for key in keys:
        name, split, layer = _kind(key, where)
        if layer is not None:
            layers.add(layer)
        origins[(name, layer)] = held(key) + (f", merged with its tensor-parallel shards in the other TP ranks' files "
                                              f"(TP={len(shards)})" if split is not None and len(shards) > 1 else "")
        for part in first:
            out[part][(name, layer)] = merge_tp([p[part][key] for _, p in shards], split, key, where)
    return where, out, sorted(layers), origins

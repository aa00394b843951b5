"""A checkpoint's experts seen as transformers 5 holds them in memory: fused into 3-D tensors.

transformers 5 saves a Mixtral as its checkpoints have always been (``block_sparse_moe.experts.{j}.w1/w2/w3``, the
router ``block_sparse_moe.gate``) but builds it with every layer's experts in two parameters,
``mlp.experts.gate_up_proj`` [E, 2 ffn, hidden] (each expert's ``[w1 (gate); w3 (up)]``) and
``mlp.experts.down_proj`` [E, hidden, ffn] (its ``w2``), and the router as ``mlp.gate``. A restore from such a
checkpoint into the live model (:mod:`ckptio.adopt.foreign`), of the weights and of Adam's moments alike, reads
through :func:`as_live`, which stacks each layer's experts when read, so that every element keeps its value.
A Qwen2-MoE is saved the same way under its own names (``mlp.experts.{j}.gate_proj/up_proj/down_proj``, the router
already ``mlp.gate``) and fused into the same two parameters.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from ..errors import CheckpointCorruptError
from .common import TensorInfo

__all__ = ["as_live", "as_saved"]

_FUSED = re.compile(r"^(.*)\.mlp\.(experts\.gate_up_proj|experts\.down_proj|gate\.weight)$")
# live part -> the per-expert tensors of the saved layout it stacks (concatenated along dim 0 when several)
_MIXTRAL = {"experts.gate_up_proj": ("block_sparse_moe.experts.{j}.w1.weight", "block_sparse_moe.experts.{j}.w3.weight"),
            "experts.down_proj": ("block_sparse_moe.experts.{j}.w2.weight",)}
_QWEN2_MOE = {"experts.gate_up_proj": ("mlp.experts.{j}.gate_proj.weight", "mlp.experts.{j}.up_proj.weight"),
              "experts.down_proj": ("mlp.experts.{j}.down_proj.weight",)}


class _LiveExperts:
    """``source`` with each layer's saved experts and router under the fused live names (the rest as it is)."""

    def __init__(self, source: Any, plan: dict[str, tuple[list[list[str]] | str]]) -> None:
        self.source, self.folder, self._plan = source, getattr(source, "folder", None), plan
        index = source.index()
        used = {k for parts in plan.values() for k in ([parts] if isinstance(parts, str) else
                                                        [n for names in parts for n in names])}
        self._index = {k: v for k, v in index.items() if k not in used}
        for live, parts in plan.items():
            if isinstance(parts, str):
                self._index[live] = index[parts]
                continue
            first = [index[n] for n in parts[0]]
            shape = (len(parts), sum(i.shape[0] for i in first), *first[0].shape[1:])
            bad = [n for names in parts for n, ref in zip(names, first) if index[n].shape != ref.shape
                   or index[n].dtype != ref.dtype]
            if bad:
                raise CheckpointCorruptError(f"{self.folder}: the experts of {live!r} differ in shape or dtype "
                                             f"({bad[0]})")
            self._index[live] = TensorInfo(shape, first[0].dtype)

    def index(self) -> dict[str, TensorInfo]:
        return dict(self._index)

    def read(self, key: str) -> torch.Tensor:
        parts = self._plan.get(key)
        if parts is None:
            return self.source.read(key)
        if isinstance(parts, str):
            return self.source.read(parts)
        return torch.stack([torch.cat([self.source.read(n) for n in names]) for names in parts])

    def close(self) -> None:
        close = getattr(self.source, "close", None)
        if callable(close):
            close()


def as_live(source: Any, live: set[str] | dict[str, Any]) -> Any:
    """``source`` as the live model's names ask for it: itself, unless the model holds fused experts
    (``...mlp.experts.gate_up_proj``) that the source keeps per expert in Mixtral's or Qwen2-MoE's saved layout."""
    index = source.index()
    plan: dict[str, Any] = {}
    for key in live:
        m = _FUSED.match(key)
        if m is None or key in index:
            continue
        prefix, part = m.group(1), m.group(2)
        if part == "gate.weight":
            if f"{prefix}.block_sparse_moe.gate.weight" in index:
                plan[key] = f"{prefix}.block_sparse_moe.gate.weight"
            continue
        saved = _MIXTRAL if f"{prefix}.{_MIXTRAL[part][0].format(j=0)}" in index else _QWEN2_MOE
        count = 0
        while f"{prefix}.{saved[part][0].format(j=count)}" in index:
            count += 1
        if count:
            plan[key] = [[f"{prefix}.{p.format(j=j)}" for p in saved[part]] for j in range(count)]
            missing = [n for names in plan[key] for n in names if n not in index]
            if missing:
                raise CheckpointCorruptError(f"{getattr(source, 'folder', '')}: {missing[0]!r} is missing beside the "
                                             "other experts of its layer")
    return _LiveExperts(source, plan) if plan else source


class _SavedExperts:
    """``source`` (holding transformers 5's fused live experts) with each expert under its saved names."""

    def __init__(self, source: Any, plan: dict[str, tuple[str, int | None, slice]]) -> None:
        self.source, self.folder, self._plan = source, getattr(source, "folder", None), plan
        index = source.index()
        fused = {live for live, _, _ in plan.values()}
        self._index = {k: v for k, v in index.items() if k not in fused}
        for name, (live, j, rows) in plan.items():
            shape = index[live].shape[1:] if j is not None else index[live].shape
            self._index[name] = TensorInfo((len(range(shape[0])[rows]), *shape[1:]), index[live].dtype)

    def index(self) -> dict[str, TensorInfo]:
        return dict(self._index)

    def read(self, key: str) -> torch.Tensor:
        if key not in self._plan:
            return self.source.read(key)
        live, j, rows = self._plan[key]
        t = self.source.read(live)
        return t if j is None else t[j][rows].clone()

    def close(self) -> None:
        close = getattr(self.source, "close", None)
        if callable(close):
            close()


def as_saved(source: Any, model_type: object = "mixtral") -> Any:
    """``source`` with each layer's fused live experts (``mlp.experts.gate_up_proj`` [E, 2 ffn, hidden],
    ``mlp.experts.down_proj`` [E, hidden, ffn]) under the saved names of ``model_type`` (Mixtral's
    ``block_sparse_moe.experts.{j}.w1/w3/w2.weight`` and router ``block_sparse_moe.gate.weight``; Qwen2-MoE's
    ``mlp.experts.{j}.gate_proj/up_proj/down_proj.weight``, its router's name the live one): the way back of
    :func:`as_live`, for a checkpoint saved from the live model; itself when it holds no fused experts."""
    mixtral = model_type == "mixtral"
    saved = _MIXTRAL if mixtral else _QWEN2_MOE
    index = source.index()
    plan: dict[str, tuple[str, int | None, slice]] = {}
    for key, info in index.items():
        m = _FUSED.match(key)
        if m is None or m.group(2) == "gate.weight":
            continue
        prefix, part = m.group(1), m.group(2)
        if len(info.shape) != 3 or part == "experts.gate_up_proj" and info.shape[1] % 2:
            raise CheckpointCorruptError(f"{getattr(source, 'folder', '')}: {key} is {list(info.shape)}, not the "
                                         "[experts, rows, columns] of fused experts"
                                         + (" with [gate; up] rows" if part == "experts.gate_up_proj" else ""))
        half = info.shape[1] // 2
        for j in range(info.shape[0]):
            if part == "experts.gate_up_proj":
                plan[f"{prefix}.{saved[part][0].format(j=j)}"] = (key, j, slice(0, half))
                plan[f"{prefix}.{saved[part][1].format(j=j)}"] = (key, j, slice(half, None))
            else:
                plan[f"{prefix}.{saved[part][0].format(j=j)}"] = (key, j, slice(None))
        if mixtral and f"{prefix}.mlp.gate.weight" in index:
            plan[f"{prefix}.block_sparse_moe.gate.weight"] = (f"{prefix}.mlp.gate.weight", None, slice(None))
    return _SavedExperts(source, plan) if plan else source

"""Types shared by the format modules."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TensorInfo:
    """What a checkpoint says about one saved tensor, before any of it is read."""

    shape: tuple[int, ...]
    dtype: str
    """The dtype's short name as ``torch`` spells it (``float32``, ``bfloat16``...)."""

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_itemsize(name: str) -> int:
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        return 0
    return dtype.itemsize


def full_tensors(state_dict: dict[str, Any]) -> dict[str, Any]:
    """Collective when any value is a DTensor: the whole tensor of every entry, on CPU."""
    from torch.distributed.tensor import DTensor

    out = {}
    for key, value in state_dict.items():
        if isinstance(value, DTensor):
            value = value.full_tensor()
        out[key] = value.detach().to("cpu").contiguous()
    return out

"""Host staging buffers for background saves: the snapshot of a state at the moment of the save call.

:meth:`Stager.stage` walks a (nested) state dict and copies every tensor into a host buffer kept for
that key, so that training may update its parameters and optimizer state as soon as ``stage``
returns. Buffers are allocated on the first save and reused by the next ones while the key's shape and
dtype stay the same, so host memory does not grow from save to save. On CUDA the buffers are pinned
and the copies are asynchronous, with one synchronisation at the end.

DTensors are staged shard by shard: the local shard is copied and wrapped again with the same mesh
and placements, which is all a writer needs to place it in the global tensor (the wrapper is kept
with its buffer and reused while both stay the same: building hundreds of them cost a fifth of the
pause). A ``Partial`` DTensor is
reduced first (a collective on the training group, so this runs on the training thread).

Thread safety: one :class:`Stager` per manager; :meth:`stage` is called on the training thread only
while no background write is reading the buffers (the manager waits for the previous save first).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate

__all__ = ["Stager"]

_ATOMS = frozenset({bool, int, float, complex, str, bytes})


class Stager:
    """Reusable host buffers into which a background save copies device tensors, so the next training step can
    change them."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._wrapped: dict[str, tuple[torch.Tensor, tuple, DTensor]] = {}  # a DTensor around each buffer
        self._used: set[str] = set()
        self._needs_sync: set[torch.device] = set()

    @property
    def nbytes(self) -> int:
        """Bytes held by the staging buffers."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def stage(self, state: Any) -> Any:
        """A copy of ``state`` whose tensors live in this stager's host buffers."""
        self._used = set()
        self._needs_sync = set()
        with torch.no_grad():  # a DTensor's to_local is then its local tensor, not an autograd function's output
            out = self._stage(state, "")
        for device in self._needs_sync:  # each device the copies came from (not only the current one)
            _synchronize(device)
        for key in set(self._buffers) - self._used:  # keys gone since the last save (a changed model)
            del self._buffers[key]
            self._wrapped.pop(key, None)
        return out

    def _stage(self, value: Any, key: str) -> Any:
        if isinstance(value, DTensor):
            if any(isinstance(p, Partial) for p in value.placements):
                value = value.redistribute(placements=[Replicate() if isinstance(p, Partial) else p
                                                       for p in value.placements])
            local = self._copy(key, value.to_local())
            layout = (value.device_mesh, tuple(value.placements), tuple(value.shape), tuple(value.stride()))
            kept = self._wrapped.get(key)
            if kept is not None and kept[0] is local and kept[1] == layout:
                return kept[2]  # the same buffer in the same place: the wrapper of the last save still fits
            wrapped = DTensor.from_local(local, value.device_mesh, value.placements, run_check=False,
                                         shape=value.shape, stride=value.stride())
            self._wrapped[key] = (local, layout, wrapped)
            return wrapped
        if isinstance(value, torch.Tensor):
            return self._copy(key, value)
        if isinstance(value, dict):
            return {k: self._stage(v, f"{key}/{k}") for k, v in value.items()}
        if value is None or type(value) in _ATOMS:  # immutable: nothing to copy (most of an optimizer's hyper-parameters)
            return value
        if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
            staged = [self._stage(v, f"{key}/{i}") for i, v in enumerate(value)]
            return staged if isinstance(value, list) else tuple(staged)
        return copy.deepcopy(value)

    def _copy(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach()
        if key in self._used:
            raise ValueError(f"two state entries stage to the same key {key!r}")
        self._used.add(key)
        buf = self._buffers.get(key)
        if buf is None or buf.shape != tensor.shape or buf.dtype != tensor.dtype:
            pin = tensor.device.type == "cuda" and torch.cuda.is_available()
            buf = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin)
            self._buffers[key] = buf
        non_blocking = tensor.device.type != "cpu" and buf.is_pinned()  # from pageable memory it would block anyway
        buf.copy_(tensor, non_blocking=non_blocking)
        if non_blocking:
            self._needs_sync.add(tensor.device)
        return buf


def _synchronize(device: torch.device) -> None:
    """Wait for the copies queued from ``device`` (``torch.cuda.synchronize()`` alone waits for the current device
    only)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and accelerator.is_available():
        accelerator.synchronize(device)

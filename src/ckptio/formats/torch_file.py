"""One ``torch.save`` file of a state dict (``.pt``, ``.pth``, ``.bin``): read memory-mapped, written whole.

Reading uses ``torch.load(weights_only=True, mmap=True)`` through the confined opener, so a file from
anywhere never runs code and tensors are paged in as they are read. A file holding
``{"state_dict": {...}}`` (many training scripts) is read as its inner state dict. Writing needs every
tensor at once (``torch.save`` writes one pickle).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from ..errors import CheckpointCorruptError
from . import pt as pt_format
from .common import TensorInfo, dtype_name
from .registry import Format, Opened, WriteOptions, register

if TYPE_CHECKING:
    from .registry import TensorSource

__all__ = ["DictSource", "TorchFile", "read_tensors", "all_tensors", "save_tensors_file"]

SUFFIXES = (".pt", ".pth", ".bin")


class DictSource:
    """Tensors already addressable in memory (a memory-mapped ``torch.load``)."""

    def __init__(self, tensors: dict[str, torch.Tensor], folder: Path) -> None:
        self.tensors = tensors
        self.folder = folder

    def index(self) -> dict[str, TensorInfo]:
        return {k: TensorInfo(tuple(v.shape), dtype_name(v.dtype)) for k, v in self.tensors.items()}

    def read(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def close(self) -> None:
        """Nothing is held open between reads."""


def read_tensors(path: Path, *, unwrap: bool = True) -> dict[str, torch.Tensor]:
    """The state dict of a ``torch.save`` file (memory-mapped), refusing anything but tensors."""
    obj = pt_format.load(path, mmap=True)
    if not isinstance(obj, dict):
        raise CheckpointCorruptError(f"{path}: holds a {type(obj).__name__}, not a state dict")
    if unwrap and "state_dict" in obj and isinstance(obj["state_dict"], dict):
        obj = obj["state_dict"]
    return only_tensors(obj, path)


def only_tensors(sd: dict[str, Any], path: Path) -> dict[str, torch.Tensor]:
    """``sd`` when every value is a tensor; a :class:`~ckptio.errors.CheckpointCorruptError` naming ``path``
    otherwise."""
    bad = [k for k, v in sd.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise CheckpointCorruptError(f"{path}: the state dict has non-tensor entries, e.g. {bad[:3]}")
    return sd


def all_tensors(source: "TensorSource", progress: Callable[[int], None] | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of ``source`` in memory (for formats written in one call)."""
    out = {}
    for key in source.index():
        t = source.read(key)
        out[key] = t.contiguous()
        if progress:
            progress(t.numel() * t.element_size())
    return out


def save_tensors_file(obj: Any, out: Path) -> None:
    """``torch.save(obj)`` as the new file ``out``, appearing whole (temporary name, fsync, rename)."""
    from ..storage import LocalFileWriter

    with LocalFileWriter(out) as writer:
        torch.save(obj, writer.stream)  # type: ignore[arg-type]


class TorchFile(Format):
    """A ``torch.save`` file of a flat state dict (``.pt``, ``.bin``), read with ``weights_only=True``."""
    name = "torch"
    summary = "torch.save file of a state dict"
    priority = 90
    file_suffix = ".pt"

    def detect(self, path: Path) -> bool:
        return path.is_file() and path.suffix in SUFFIXES

    def open(self, path: Path) -> Opened:
        return Opened(self.name, DictSource(read_tensors(path), path.parent), None)

    def write(self, opened: Opened, source: "TensorSource", out: Path, options: WriteOptions) -> None:
        save_tensors_file(all_tensors(source, options.progress), out)


register(TorchFile())

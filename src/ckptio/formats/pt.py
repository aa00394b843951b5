"""Small states as ``.pt`` files: written with ``torch.save``, read with ``torch.load(weights_only=True)``.

``weights_only`` admits tensors and plain containers of numbers and strings only, so a hostile file
cannot run code. States holding other Python objects must convert them in their ``state_dict``.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointCorruptError, CheckpointNotFoundError


def to_bytes(obj: Any, what: str) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getvalue()
    try:  # refuse at save time what could not be loaded safely later
        torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:
        raise TypeError(
            f"the state_dict of {what!r} holds objects that cannot be loaded with weights_only=True "
            f"({exc}); return tensors, numbers, strings, lists, tuples and dicts only"
        ) from exc
    return data


def write_bytes(path: str | Path, data: bytes) -> None:
    """Write and fsync ``data``; the caller commits the directory afterwards."""
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def load(path: str | Path, *, mmap: bool = False) -> Any:
    """``torch.load(weights_only=True)`` with a clear error naming the file; ``mmap`` maps tensors lazily."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointNotFoundError(f"{path}: missing")
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as exc:
        raise CheckpointCorruptError(
            f"{path}: cannot be loaded safely ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        ) from exc

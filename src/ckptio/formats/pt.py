"""Small states as ``.pt`` files: written with ``torch.save``, read with ``torch.load(weights_only=True)``.

``weights_only`` admits tensors and plain containers of numbers and strings only, so a hostile file
cannot run code. States holding other Python objects must convert them in their ``state_dict``.
"""

from __future__ import annotations

import io
import os
import zipfile
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointCorruptError
from ..storage.confined import Folder
from ..storage.parse import Budget, check_pickle, parsing, zip_member

MAX_STATE_BYTES = 2 << 30
"""Largest small state (``.pt``) read into memory: a dataloader's or a user object's state."""


def to_bytes(obj: Any, what: str) -> bytes:
    """``obj`` as ``torch.save`` bytes, refused (naming ``what``) unless ``torch.load(weights_only=True)`` reads it
    back."""
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


def _check_members(fileobj: Any, size: int, where: Path) -> None:
    """Refuse a ``torch.save`` archive before torch reads it: members that would inflate past the file itself, a
    file that is not such an archive, and a ``data.pkl`` the gate's pickle walk refuses (torch's ``weights_only``
    unpickler admits only plain types, but a tuple nested a million deep or a key that hashes 2^64 times is plain).

    ``torch.save`` stores its members uncompressed, but ``torch.load`` inflates a deflated one to the size its
    header claims: a few kilobytes could ask for gigabytes. torch's own format before 1.6 (not a zip archive) is
    refused: its pickles cannot be walked before they are loaded."""
    try:
        with parsing(where, "(its zip directory)"):  # names that are not UTF-8, sizes that do not parse...
            try:
                archive = zipfile.ZipFile(fileobj)
            except zipfile.BadZipFile:
                raise CheckpointCorruptError(f"{where}: not a torch.save archive (a zip file); files in torch's format "
                                             "before 1.6 are not read") from None
            with archive:
                budget = Budget(size, where)
                pickles = []
                for info in archive.infolist():
                    budget.take(info.file_size, f"member {info.filename!r}")
                    if info.filename.endswith("/data.pkl") or info.filename == "data.pkl":
                        pickles.append(info.filename)
                for name in pickles:
                    check_pickle(zip_member(archive, name, Budget(size, where)), f"{where}: {name}")
    finally:
        fileobj.seek(0)


def check_bytes(data: bytes, where: Any) -> None:
    """:func:`_check_members` for a ``torch.save`` archive held in memory (a DCP item read whole)."""
    _check_members(io.BytesIO(data), len(data), where)


def check_archive(folder: Folder, rel: str) -> None:
    """Refuse the file ``rel`` of ``folder`` if it is a zip archive whose members would inflate past it (only its
    directory is read): for files another library's ``torch.load`` reads."""
    with folder.open(rel) as handle, io.BufferedReader(handle.stream(), buffer_size=1 << 16) as fh:
        _check_members(fh, handle.size, folder.display(rel))


def _safe_load(source: Any, where: Path, *, mmap: bool = False) -> Any:
    try:
        return torch.load(source, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as exc:
        raise CheckpointCorruptError(
            f"{where}: cannot be loaded safely ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        ) from exc


def load_from(folder: Folder, rel: str, *, max_size: int = MAX_STATE_BYTES) -> Any:
    """A small ``.pt`` state inside a checkpoint, read through the confined folder (checksummed as read).

    torch reads the archive from the file as it needs it, so a file that is not what it claims (a huge sparse
    one, a member inflating past the file) fails on its first records, before memory is spent on the rest."""
    where = folder.display(rel)
    with folder.open(rel) as handle:
        if handle.size > max_size:
            raise CheckpointCorruptError(f"{where}: {handle.size} bytes, more than the {max_size} a state file may have")
        with io.BufferedReader(handle.stream(), buffer_size=1 << 20) as fh:
            _check_members(fh, handle.size, where)
            return _safe_load(fh, where)


def load(path: str | Path, *, mmap: bool = False) -> Any:
    """``torch.load(weights_only=True)`` of a file, with a clear error naming it; ``mmap`` maps tensors lazily.

    The file is opened like any file of a checkpoint (a regular file, not a link, not a FIFO); with
    ``mmap`` torch maps that same open file (through ``/proc/self/fd`` where it exists).
    """
    path = Path(path)
    with Folder(path.parent).open(path.name) as handle:
        with io.BufferedReader(handle.stream(), buffer_size=1 << 16) as fh:
            _check_members(fh, handle.size, path)
        if mmap:
            proc = Path(f"/proc/self/fd/{handle.fd}")
            return _safe_load(str(proc) if proc.exists() else str(path), path, mmap=True)
        with io.BufferedReader(handle.stream(), buffer_size=1 << 20) as fh:
            return _safe_load(fh, path)

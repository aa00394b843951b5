"""The tensors of a DCP folder, read straight into their destinations.

DCP's ``FileSystemWriter`` stores each tensor chunk as a small ``torch.save`` zip archive inside a
``.distcp`` file; DCP's reader then runs ``torch.load`` on every chunk (a zip reader, the weights-only
unpickler and a new tensor) and copies the result into the destination. That costs a fresh
allocation and a copy of every byte, plus about half a millisecond per chunk.

This module reads the same archives without ``torch.load``: the zip's central directory and local
headers are parsed with :mod:`struct`, the one-record pickle that describes the tensor with an
unpickler that admits exactly the three globals such a pickle names, and the tensor's bytes are read
with one positional read into the destination when they are contiguous there (a bounded buffer and a
copy otherwise). Everything is checked against the archive's bounds and against DCP's own metadata
(dtype and shape of the chunk). An archive of any other shape (compressed, several storages, an
unexpected global) is left to ``torch.load(weights_only=True)`` through :func:`parse` returning
``None``; a malformed one is refused with a :class:`CheckpointCorruptError` naming the file.
"""

from __future__ import annotations

import collections
import io
import pickle
import struct
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import CheckpointCorruptError
from ...storage.confined import ReadHandle
from ...storage.parse import DATA_ERRORS, check_pickle

__all__ = ["StoredTensor", "parse", "plain_value", "read_into"]

_HEAD = 4096
_TAIL = 4096
_MAX_DIRECTORY = 1 << 20
_MAX_PICKLE = 1 << 20
_EOCD = struct.Struct("<4sHHHHIIH")
_EOCD64_LOCATOR = struct.Struct("<4sIQI")
_EOCD64 = struct.Struct("<4sQHHIIQQQQ")
_CENTRAL = struct.Struct("<4sHHHHHHIIIHHHHHII")
_LOCAL = struct.Struct("<4sHHHHHIIIHH")
_STORAGE_TYPES = {"Float": torch.float32, "Double": torch.float64, "Half": torch.float16, "BFloat16": torch.bfloat16,
                  "Long": torch.int64, "Int": torch.int32, "Short": torch.int16, "Char": torch.int8, "Byte": torch.uint8,
                  "Bool": torch.bool, "ComplexFloat": torch.complex64, "ComplexDouble": torch.complex128}


@dataclass(frozen=True)
class StoredTensor:
    """Where a chunk's bytes are (``data``: absolute offset in the file) and how they form the tensor."""

    data: int
    nbytes: int
    dtype: torch.dtype
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


class _Window:
    """Bytes of the archive read so far: its head and its tail, each read once."""

    def __init__(self, handle: ReadHandle, base: int, length: int) -> None:
        self.handle, self.base, self.length = handle, base, length
        self.parts: list[tuple[int, bytes]] = []

    def fetch(self, start: int, n: int) -> bytes:
        """Bytes ``[start, start + n)`` of the archive; an archive too short for them is corrupt."""
        if start < 0 or n < 0 or start + n > self.length:
            raise ValueError(f"a record at {start} (+{n}) lies outside the {self.length}-byte archive")
        for at, data in self.parts:
            if at <= start and start + n <= at + len(data):
                return data[start - at:start - at + n]
        buf = bytearray(n)
        self.handle.readinto(buf, self.base + start, settle=False)  # never written to: only parsed
        data = bytes(buf)
        self.parts.append((start, data))
        return data


def parse(handle: ReadHandle, base: int, length: int) -> StoredTensor | None:
    """The tensor stored as a ``torch.save`` archive at ``[base, base + length)`` of ``handle``'s file.

    ``None``: a well-formed archive of a shape this fast path does not take (``torch.load`` will). A
    malformed one raises :class:`CheckpointCorruptError`.
    """
    try:
        return _parse(_Window(handle, base, length))
    except DATA_ERRORS as exc:
        raise CheckpointCorruptError(f"{handle.path}: the DCP item at byte {base} ({length} bytes) is not a "
                                     f"readable tensor archive: {exc}") from None


def _parse(win: _Window) -> StoredTensor | None:
    if win.length <= _HEAD + _TAIL:
        win.fetch(0, win.length)
    else:
        win.fetch(0, _HEAD)
        win.fetch(win.length - _TAIL, _TAIL)
    records = _directory(win)
    pkl = [name for name in records if name.endswith("/data.pkl")]
    if len(pkl) != 1:
        return None
    prefix = pkl[0][: -len("data.pkl")]
    storages = [name for name in records if name.startswith(prefix + "data/")]
    order = records.get(prefix + "byteorder")
    if order is not None and _record(win, *order) != b"little":
        return None
    stored = _Unpickler(io.BytesIO(_pickle(win, records[pkl[0]]))).load()
    if not isinstance(stored, _Rebuilt) or len(storages) != 1:
        return None
    dtype, numel = stored.storage.dtype, stored.storage.numel
    offset, size, stride = stored.offset, stored.size, stored.stride
    name = prefix + "data/" + stored.storage.key
    if name != storages[0]:
        raise ValueError(f"its pickle names storage {stored.storage.key!r}, the archive holds {storages[0]!r}")
    start, nbytes, method = records[name]
    itemsize = dtype.itemsize
    if method != 0:
        return None
    if nbytes != numel * itemsize:
        raise ValueError(f"storage {stored.storage.key!r} holds {nbytes} bytes, not {numel} x {itemsize}")
    if not (all(type(v) is int and v >= 0 for v in (offset, *size, *stride)) and len(size) == len(stride)):
        raise ValueError(f"tensor placement {offset}, {size}, {stride} is not valid")
    if all(size) and offset + sum((n - 1) * s for n, s in zip(size, stride)) >= max(numel, 1):
        raise ValueError(f"a tensor of size {list(size)} and stride {list(stride)} at {offset} overruns its "
                         f"storage of {numel} elements")
    return StoredTensor(win.base + _data_start(win, start, nbytes), nbytes, dtype, offset, tuple(size), tuple(stride))


def _directory(win: _Window) -> dict[str, tuple[int, int, int]]:
    """Record name -> (local header offset, size, compression method), from the central directory."""
    tail_at = max(0, win.length - _TAIL)
    tail = win.fetch(tail_at, win.length - tail_at)
    at = tail.rfind(b"PK\x05\x06")
    if at < 0 or at + _EOCD.size > len(tail):
        raise ValueError("no end-of-central-directory record")
    _, _, _, _, count, cd_size, cd_offset, _ = _EOCD.unpack_from(tail, at)
    if 0xFFFF in (count,) or 0xFFFFFFFF in (cd_size, cd_offset):
        loc = tail_at + at - _EOCD64_LOCATOR.size
        sig, _, z64, _ = _EOCD64_LOCATOR.unpack(win.fetch(loc, _EOCD64_LOCATOR.size))
        if sig != b"PK\x06\x07":
            raise ValueError("a zip64 archive without its locator")
        sig, *_, count, cd_size, cd_offset = _EOCD64.unpack(win.fetch(z64, _EOCD64.size))
        if sig != b"PK\x06\x06":
            raise ValueError("a zip64 locator pointing at no zip64 record")
    if cd_size > _MAX_DIRECTORY or count > cd_size // _CENTRAL.size:
        raise ValueError(f"a central directory of {count} records in {cd_size} bytes")
    cd = win.fetch(cd_offset, cd_size)
    out: dict[str, tuple[int, int, int]] = {}
    pos = 0
    for _ in range(count):
        (sig, _, _, flags, method, _, _, _, csize, usize, n_name, n_extra, n_comment, _, _, _,
         local) = _CENTRAL.unpack_from(cd, pos)
        if sig != b"PK\x01\x02":
            raise ValueError("a damaged central directory")
        name = cd[pos + _CENTRAL.size: pos + _CENTRAL.size + n_name].decode("utf-8", "strict")
        extra = cd[pos + _CENTRAL.size + n_name: pos + _CENTRAL.size + n_name + n_extra]
        usize, csize, local = _zip64_extra(extra, usize, csize, local)
        if usize != csize and method == 0 or flags & 1:
            raise ValueError(f"record {name!r} is stored with sizes {csize}/{usize} or encrypted")
        out[name] = (local, usize, method)
        pos += _CENTRAL.size + n_name + n_extra + n_comment
    return out


def _zip64_extra(extra: bytes, usize: int, csize: int, local: int) -> tuple[int, int, int]:
    pos = 0
    while pos + 4 <= len(extra):
        tag, n = struct.unpack_from("<HH", extra, pos)
        if tag == 1:
            values = list(struct.unpack_from(f"<{n // 8}Q", extra, pos + 4))
            if usize == 0xFFFFFFFF:
                usize = values.pop(0)
            if csize == 0xFFFFFFFF:
                csize = values.pop(0)
            if local == 0xFFFFFFFF:
                local = values.pop(0)
        pos += 4 + n
    return usize, csize, local


def _data_start(win: _Window, local: int, nbytes: int) -> int:
    sig, *_, n_name, n_extra = _LOCAL.unpack(win.fetch(local, _LOCAL.size))
    if sig != b"PK\x03\x04":
        raise ValueError(f"no local header at {local}")
    start = local + _LOCAL.size + n_name + n_extra
    if start + nbytes > win.length:
        raise ValueError(f"a record of {nbytes} bytes at {start} runs past the archive's end")
    return start


def _record(win: _Window, local: int, nbytes: int, method: int, limit: int = 4096) -> bytes:
    if method != 0 or nbytes > limit:
        raise ValueError(f"a metadata record of {nbytes} bytes (method {method})")
    return win.fetch(_data_start(win, local, nbytes), nbytes)


@dataclass(frozen=True)
class _Storage:
    dtype: torch.dtype
    key: str
    numel: int


@dataclass(frozen=True)
class _Rebuilt:
    storage: _Storage
    offset: Any
    size: Any
    stride: Any


def _rebuild(storage: Any, offset: Any, size: Any, stride: Any, *_: Any) -> _Rebuilt:
    if not isinstance(storage, _Storage):
        raise pickle.UnpicklingError("a tensor rebuilt from something that is not a storage")
    return _Rebuilt(storage, offset, tuple(size), tuple(stride))


def _pickle(win: _Window, record: Any) -> bytes:
    """The bytes of the archive's ``data.pkl`` (``record``: where it lies), walked by the gate before any
    unpickler sees them."""
    start, nbytes, method = record
    data = _record(win, start, nbytes, method, limit=_MAX_PICKLE)
    check_pickle(data, f"{win.handle.path}: the DCP item at byte {win.base}")
    return data


class _Unpickler(pickle.Unpickler):
    """The pickle of one tensor, as ``torch.save`` writes it; any other global is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        if module == "torch" and name.endswith("Storage") and name[: -len("Storage")] in _STORAGE_TYPES:
            return _STORAGE_TYPES[name[: -len("Storage")]]
        raise pickle.UnpicklingError(f"global {module}.{name} is not part of a tensor archive")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], torch.dtype)
                and isinstance(pid[2], str) and type(pid[4]) is int and pid[4] >= 0):
            raise pickle.UnpicklingError(f"persistent id {pid!r:.80} is not a storage")
        return _Storage(pid[1], pid[2], pid[4])


class _NotPlain(Exception):
    pass


class _PlainUnpickler(pickle.Unpickler):
    """A pickle of plain Python values (numbers, strings, tuples, lists, dicts): no class is built."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        raise _NotPlain

    def persistent_load(self, pid: Any) -> Any:
        raise _NotPlain


def plain_value(handle: ReadHandle, base: int, length: int,
                memo: "dict[bytes, Any] | None" = None) -> tuple[bool, Any]:
    """``(True, value)`` for a ``torch.save`` archive at ``[base, base + length)`` holding a plain Python
    value (an optimizer's hyper-parameter, say), read without ``torch.load``; ``(False, None)`` for any
    other archive (the caller then uses ``torch.load(weights_only=True)``, which also reports damage).

    ``memo``: values already parsed, by the bytes of their whole archive. An optimizer saved by DCP holds each
    hyper-parameter once per parameter (11 archives a parameter for AdamW, most of them byte for byte the same);
    an archive seen before is not parsed again. Only immutable values are kept, so no two parameters share a list.
    """
    try:
        win = _Window(handle, base, length)
        whole = win.fetch(0, length) if length <= _HEAD + _TAIL else None
        if memo is not None and whole is not None and whole in memo:
            return True, memo[whole]
        records = _directory(win)
        pkl = [name for name in records if name.endswith("/data.pkl")]
        if len(pkl) != 1 or any(name.startswith(pkl[0][: -len("data.pkl")] + "data/") for name in records):
            return False, None
        value = _PlainUnpickler(io.BytesIO(_pickle(win, records[pkl[0]]))).load()
    except (_NotPlain, ValueError, struct.error, pickle.UnpicklingError, EOFError, KeyError, IndexError, TypeError,
            AttributeError, RecursionError, MemoryError):
        return False, None
    if memo is not None and whole is not None and _immutable(value):
        memo[whole] = value
    return True, value


def _immutable(value: Any, depth: int = 0) -> bool:
    if value is None or type(value) in (bool, int, float, complex, str, bytes):
        return True
    return type(value) is tuple and depth < 4 and all(_immutable(v, depth + 1) for v in value)


def read_into(handle: ReadHandle, stored: StoredTensor, lo: list[int], lengths: list[int],
              target: torch.Tensor) -> None:
    """Fill ``target`` with the box ``[lo, lo + lengths)`` of the stored tensor.

    When that box is contiguous in the file and ``target`` is contiguous CPU memory of the same dtype,
    one read fills it (its last bytes may still be hashed by a verifier after this returns: ``target``
    is a load's destination); otherwise the span of the storage it covers is read and copied.
    """
    if list(target.shape) != list(lengths) or len(lo) != len(stored.size) or any(
            a < 0 or a + n > s for a, n, s in zip(lo, lengths, stored.size)):
        raise CheckpointCorruptError(f"{handle.path}: a DCP item of shape {list(stored.size)} cannot give the box "
                                     f"{lo} + {lengths} that the checkpoint's metadata asks for")
    if target.numel() == 0:
        return
    itemsize = stored.dtype.itemsize
    first = stored.offset + sum(a * s for a, s in zip(lo, stored.stride))
    last = first + sum((n - 1) * s for n, s in zip(lengths, stored.stride))
    contiguous = _is_contiguous(stored.size, stored.stride) and list(lengths[1:]) == list(stored.size[1:])
    if contiguous and target.dtype == stored.dtype and target.device.type == "cpu" and target.is_contiguous():
        view = memoryview(target.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
        handle.readinto(view, stored.data + first * itemsize, settle=False)
        return
    span = torch.empty((last - first + 1) * itemsize, dtype=torch.uint8)
    handle.readinto(memoryview(span.numpy()), stored.data + first * itemsize)  # type: ignore[arg-type]
    box = span.view(stored.dtype).as_strided(tuple(lengths), stored.stride, 0)
    with torch.no_grad():
        target.copy_(box)


def _is_contiguous(size: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    expect = 1
    for n, s in zip(reversed(size), reversed(stride)):
        if n != 1 and s != expect:
            return False
        expect *= n
    return True

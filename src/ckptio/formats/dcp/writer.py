"""DCP's data files written from the tensors' own memory: each item the exact bytes ``torch.save`` gives, without
running ``torch.save`` for it.

DCP stores each tensor as a ``torch.save`` archive inside the rank's ``__R_0.distcp``. With the archive's CRC-32
fields off (``_no_zip_crc32`` in :mod:`ckptio.formats.dcp.save`: ckptio's own checksum guards every file), the
archive is the tensor's storage bytes between a *prefix* (zip headers, the pickle, the small records) and a
*suffix* (the last records and the zip directory) that depend only on the tensor's dtype, shape and strides. So
those two are taken once per such signature — from a real ``torch.save`` of the tensor into a sink that keeps
every write except the one of the tensor's data (recognised by its address, nothing is copied) — and every
later item of that signature is written as prefix, its storage bytes straight from memory, suffix. An AdamW
state of a Llama has about ten signatures: the first save runs ``torch.save`` ten times, later ones never.
Anything else (a tensor subclass, an empty or non-compact storage, a signature whose capture does not split
cleanly) is written by ``torch.save`` itself, as before; the bytes are the same either way
(``tests/test_dcp_writer.py`` compares them, and the golden folders of ``tests/test_ondisk_stability.py``).

Small pieces (prefixes, suffixes, small tensors, pickled values) are gathered into one write; a tensor's data
goes out in pieces of :data:`PIECE` bytes from its memory, so the storage stream checksums and starts writing
each piece out while the next is copied. A stream that uploads from memory (GCS, Azure) takes those pieces as
held writes (``write_held``): sent from the tensor's memory, not copied.
"""

from __future__ import annotations

import io
import math
import pickle
import threading
from typing import Any

import torch

from ... import _faults

__all__ = ["archive_length", "pickled", "write_items"]

PIECE = 32 << 20
"""The largest single write of a tensor's data (see :class:`~ckptio.storage.posix.Writeback`)."""

_SMALL = 1 << 20
"""Small pieces are gathered until they reach this many bytes."""
HEAD_ITEM = 64 << 10
"""A tensor item of at most this many bytes goes to the head of its file, after the pickled values and before the
larger tensors (:func:`head_first`). What a rank reads of another rank's file is such items: a tensor every rank
holds whole (AdamW's ``step`` beside FSDP's sharded moments) is written by one rank for all. Spread among the large
tensors, in the plan's order, they were ranges throughout that file, and an object store's read window spanning
them fetched 103 MB of another rank's 171 MB file for 51 KB (4 ranks, a 1 GB state); at the head they are one
small read."""

_parts: dict[tuple, tuple[bytes, bytes] | None] = {}
_parts_lock = threading.Lock()


def _signature(t: torch.Tensor) -> tuple | None:
    """What the archive around ``t``'s data depends on; ``None``: a tensor that is written by ``torch.save`` itself."""
    from torch import serialization

    if (type(t) is not torch.Tensor or t.layout != torch.strided or t.device.type != "cpu" or t.requires_grad
            or t.is_quantized or t.is_conj() or t.is_neg() or t.storage_offset() != 0 or not t.nbytes
            or t.untyped_storage().nbytes() != t.nbytes or serialization.get_crc32_options()):
        return None
    if getattr(t, "__dict__", None):  # attributes set on the tensor are pickled with it
        return None
    return (t.dtype, tuple(t.shape), t.stride(), torch.__version__, serialization._get_storage_alignment())


class _Capture(io.RawIOBase):
    """A sink for ``torch.save`` that keeps every write except the one of ``address``'s ``nbytes`` bytes."""

    def __init__(self, address: int, nbytes: int) -> None:
        super().__init__()
        self.address, self.nbytes = address, nbytes
        self.before: list[bytes] = []
        self.after: list[bytes] = []
        self.hits = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        import numpy as np

        view = memoryview(data).cast("B")
        if view.nbytes == self.nbytes and np.frombuffer(view, np.uint8).ctypes.data == self.address:
            self.hits += 1
        else:
            (self.after if self.hits else self.before).append(bytes(view))
        return view.nbytes


def _archive_parts(t: torch.Tensor) -> tuple[bytes, bytes] | None:
    """The prefix and suffix of ``torch.save(t)`` around its storage bytes, or ``None`` (write it whole)."""
    key = _signature(t)
    if key is None:
        return None
    with _parts_lock:
        if key in _parts:
            return _parts[key]
    sink = _Capture(t.untyped_storage().data_ptr(), t.nbytes)
    torch.save(t, sink)  # type: ignore[arg-type]  # a binary sink
    found = (b"".join(sink.before), b"".join(sink.after)) if sink.hits == 1 else None
    with _parts_lock:
        if len(_parts) > 4096:  # signatures are few; a run of ever-changing shapes must not grow this forever
            _parts.clear()
        _parts[key] = found
    return found


_pickled: dict[tuple, bytes] = {}
_SMALL_VALUE = 1024
"""Only the archives of values whose pickle is at most this many bytes are kept."""
_PLAIN = (int, float, bool, str, bytes, type(None))


def _plain(value: Any, depth: int = 0) -> bool:
    """A value whose ``torch.save`` archive depends on nothing but its pickle (no storage, no class of its own)."""
    kind = type(value)
    if kind in _PLAIN:
        return True
    return (kind is tuple or kind is list) and depth < 4 and len(value) <= 64 and all(
        _plain(v, depth + 1) for v in value)


def pickled(value: Any) -> io.BytesIO:
    """``torch.save(value)`` into a new buffer, as DCP's planner does for a pickled (``BYTE_IO``) item. An optimizer's
    flattened state repeats its hyper-parameters per parameter (~40 small values a rank, ~60 us of ``torch.save``
    each, every save): the archive of a plain value is kept, keyed by its exact pickle (0.0 and -0.0, 1 and True, a
    tuple and a list stay apart) and the archive settings, and handed out again instead of pickled again."""
    from torch import serialization

    key = None
    if _plain(value):
        key = (pickle.dumps(value, protocol=2), serialization.get_crc32_options(), torch.__version__)
        if len(key[0]) > _SMALL_VALUE:
            key = None  # a large value (a long string): pickled each time, as before, never kept
    if key is not None:
        data = _pickled.get(key)
        if data is not None:
            return io.BytesIO(data)
    out = io.BytesIO()
    torch.save(value, out)
    if key is not None:
        with _parts_lock:
            if len(_pickled) > 4096:  # a run of ever-new values (a step count) must not grow this forever
                _pickled.clear()
            _pickled[key] = out.getvalue()
    return out


def _loaded(data: torch.Tensor) -> torch.Tensor:
    """The tensor as DCP's own loader hands it to ``torch.save``: on the CPU, with storage of its own size."""
    tensor = data.detach().cpu()
    if tensor.untyped_storage().nbytes() != tensor.nbytes:
        tensor = tensor.clone()  # a view of a larger storage: DCP saves a compact copy (layout preserved)
    return tensor


def _whole(tensor: torch.Tensor) -> bytes:
    out = io.BytesIO()
    torch.save(tensor, out)
    return out.getvalue()


def archive_length(data: Any) -> int:
    """The bytes item ``data`` (a resolved DCP write item: a tensor or a pickled value) takes in the file."""
    if isinstance(data, io.BytesIO):
        return data.getbuffer().nbytes
    tensor = _loaded(data)
    parts = _archive_parts(tensor)
    return len(parts[0]) + tensor.nbytes + len(parts[1]) if parts is not None else len(_whole(tensor))


class _Gathered:
    """Writes to ``stream``: small pieces gathered into one call, a tensor's data in :data:`PIECE`-sized writes."""

    def __init__(self, stream: Any) -> None:
        self.stream, self.pos = stream, stream.tell()
        self.buf = bytearray()

    def small(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        self.buf += view
        self.pos += view.nbytes
        if len(self.buf) >= _SMALL:
            self.flush()

    def large(self, tensor: torch.Tensor) -> None:
        if tensor.nbytes < _SMALL // 4:
            self.small(_bytes_of(tensor))
            return
        self.flush()
        view = _bytes_of(tensor)
        # the tensor's bytes do not change until the stream is closed (the save returns after that; a background
        # save writes staged copies): a stream that can keep them by reference sends them from the tensor's memory
        write = getattr(self.stream, "write_held", None) or self.stream.write
        for at in range(0, view.nbytes, PIECE):
            write(view[at:at + PIECE])
        self.pos += view.nbytes

    def flush(self) -> None:
        if self.buf:
            buf, self.buf = self.buf, bytearray()  # a new buffer: the stream may still hold a view of the old
            self.stream.write(buf)


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The bytes of ``tensor``'s storage (its own size: see :func:`_loaded`), as they lie in memory."""
    flat = torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage())
    return memoryview(flat.numpy())  # type: ignore[arg-type]  # an ndarray is a buffer


def item_bytes(item: Any) -> int:
    """The bytes of a DCP write item's tensor data, from its plan (1 for a pickled value: small)."""
    data = getattr(item, "tensor_data", None)
    if data is None:
        return 1
    return math.prod(data.chunk.sizes) * data.properties.dtype.itemsize


def at_head(item: Any) -> bool:
    """Whether ``item`` is written at the head of its file (a pickled value, or a tensor of :data:`HEAD_ITEM`
    bytes at most)."""
    return getattr(item, "tensor_data", None) is None or item_bytes(item) <= HEAD_ITEM


def head_first(items: list[Any]) -> list[Any]:
    """``items`` in the order of the file: the pickled values, then the tensors of :data:`HEAD_ITEM` bytes at most,
    then the others, each in the plan's order (DCP reads an item at the offset its ``.metadata`` records)."""
    from torch.distributed.checkpoint.planner import WriteItemType

    values = [i for i in items if i.type == WriteItemType.BYTE_IO]
    tensors = [i for i in items if i.type != WriteItemType.BYTE_IO]
    return values + [i for i in tensors if at_head(i)] + [i for i in tensors if not at_head(i)]


def write_items(stream: Any, items: list[Any], resolve: Any, storage_key: str) -> list[Any]:
    """Write DCP's write ``items`` into ``stream`` in :func:`head_first` order, each as DCP's writer writes it (a
    pickled value, or a tensor's ``torch.save`` archive); ``resolve`` is the planner's ``resolve_data``. Returns DCP's
    ``WriteResult`` of each."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.storage import WriteResult

    out = _Gathered(stream)
    results = []
    for item in head_first(items):
        data = resolve(item)
        offset = out.pos
        if isinstance(data, io.BytesIO):
            out.small(data.getbuffer())
        else:
            tensor = _loaded(data)
            parts = _archive_parts(tensor)
            if parts is None:
                out.small(_whole(tensor))
            else:
                out.small(parts[0])
                out.large(tensor)
                out.small(parts[1])
        length = out.pos - offset
        results.append(WriteResult(index=item.index, size_in_bytes=length,
                                   storage_data=_StorageInfo(storage_key, offset, length)))
        _faults.point("dcp.item_written")  # a test's Ctrl-C or crash in the middle of a DCP write
    out.flush()
    return results

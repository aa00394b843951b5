"""A streaming safetensors writer: header first, then tensors one at a time, checksummed as written.

The output is byte-for-byte a standard safetensors file (8-byte little-endian header length, JSON
header padded with spaces to 8-byte alignment, raw little-endian tensor data in header order). Only
one tensor is materialised at a time (a held write keeps those of the parts still being sent: see :func:`write`),
and its bytes go to the file without an extra copy.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable

import torch

if TYPE_CHECKING:
    from ...storage.base import WriteStream

ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
}
ST_NAMES = {v: k for k, v in ST_DTYPES.items()}


@dataclass
class Entry:
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    produce: Callable[[], torch.Tensor]
    """Returns the tensor (any device/layout); called once, right before its bytes are written."""

    @property
    def nbytes(self) -> int:
        return nbytes_of(self.dtype, self.shape)


def nbytes_of(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    """The bytes of a tensor of ``dtype`` and ``shape``."""
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


def write(out: "WriteStream", entries: Iterable[Entry], metadata: dict[str, str] | None = None,
          progress: Callable[[int], None] | None = None, *, held: bool = False) -> str:
    """Write ``entries`` as a safetensors file into the new stream ``out`` (closed, durable, on return).

    ``held``: the tensors the entries produce do not change until this returns (a save's own state, or its staged
    copy): a stream that can keep bytes by reference (``write_held``: GCS, Azure) sends them from the tensors' memory
    instead of copying them into its part buffers, and keeps each tensor until its last part is sent.

    Returns the file's checksum, computed as the bytes went out.
    """
    entries = list(entries)
    with out:
        _stream(out, entries, metadata, progress, held)
    return out.close()


def content_digest(entries: Iterable[Entry], metadata: dict[str, str] | None = None) -> str:
    """The SHA-256 of the exact bytes :func:`write` would write for ``entries`` (``sha256:<hex>``), computed
    without writing them: two files with the same digest hold the same bytes (see :mod:`ckptio.engine.sharing`).
    hashlib releases the GIL on large buffers, so files hashed on several threads hash in parallel."""
    import hashlib

    sha = hashlib.sha256()
    _stream(sha, list(entries), metadata, None)
    return f"sha256:{sha.hexdigest()}"


def _header(entries: list[Entry], metadata: dict[str, str] | None) -> bytes:
    header: dict[str, object] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for e in entries:
        if e.dtype not in ST_DTYPES:
            raise TypeError(f"{e.key!r}: dtype {e.dtype} cannot be stored in safetensors")
        header[e.key] = {"dtype": ST_DTYPES[e.dtype], "shape": list(e.shape), "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    return blob + b" " * (-(8 + len(blob)) % 8)


def _stream(out: Any, entries: list[Entry], metadata: dict[str, str] | None,
            progress: Callable[[int], None] | None, held: bool = False) -> None:
    """The file's bytes, in order, into ``out.write`` (or ``out.update``: a hash); with ``held``, the tensors' bytes
    into ``out.write_held`` where the stream has one (see :func:`write`)."""
    put = getattr(out, "write", None) or out.update
    put_data = (getattr(out, "write_held", None) if held else None) or put
    blob = _header(entries, metadata)
    put(len(blob).to_bytes(8, "little"))
    put(blob)
    for e in entries:
        tensor = e.produce().detach()
        if tensor.dtype != e.dtype:
            tensor = tensor.to(e.dtype)
        tensor = tensor.to("cpu").contiguous()
        if tuple(tensor.shape) != tuple(e.shape):
            raise ValueError(f"{e.key!r}: produced shape {list(tensor.shape)}, planned {list(e.shape)}")
        if tensor.numel():
            put_data(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))  # type: ignore[arg-type]
        if progress is not None:
            progress(e.nbytes)
        del tensor


def in_threads(tasks: list, name: str) -> list:
    """Run each task on its own thread; return their results in order, or raise the first error.

    Plain threads rather than a ``concurrent.futures`` pool: a background save may still be writing
    while the interpreter shuts down, when pools refuse new work.
    """
    import threading

    results: list = [None] * len(tasks)
    errors: list[BaseException | None] = [None] * len(tasks)

    def run(i: int) -> None:
        try:
            results[i] = tasks[i]()
        except BaseException as exc:  # re-raised on the calling thread below
            errors[i] = exc

    threads = [threading.Thread(target=run, args=(i,), name=f"{name}-{i}") for i in range(len(tasks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for exc in errors:
        if exc is not None:
            raise exc
    return results

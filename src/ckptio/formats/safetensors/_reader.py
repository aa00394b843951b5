"""The one safetensors reader: a validated header, then positional reads into the caller's memory.

Every safetensors file ckptio reads (its own per-rank shards, a Hugging Face folder, a consolidated
bundle, a ``.qnemo`` rank file) goes through :class:`SafetensorsFile`, which opens it through the
confined :class:`~ckptio.storage.confined.Folder` and checks, before any tensor byte is read or any
large buffer allocated:

* the header length fits the file, the header is a JSON object without duplicate keys;
* every entry has a known dtype, a shape of non-negative integers and data offsets whose length is
  exactly ``numel × itemsize`` and which lie inside the data section;
* no two entries share bytes.

Reads go straight into the destination tensor when its memory is laid out like the stored bytes
(whole tensors, runs of whole rows), otherwise through one buffer of the rows needed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ...errors import CheckpointCorruptError
from ...storage.confined import Folder, ReadHandle
from ...storage.parse import json_value
from ._writer import ST_NAMES

__all__ = ["SafetensorsFile", "StEntry", "MAX_HEADER_BYTES"]

MAX_HEADER_BYTES = 100 * 1024 * 1024
HEAD_BYTES = 64 << 10
"""The first bytes of a file the handle is told its header's reads need, when the data's spans are known: the header's
length and the header (a few KB in most files) are then one request to an object store, not two."""


@dataclass(frozen=True)
class StEntry:
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    """Offset of the first byte in the file (header included)."""
    nbytes: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


class SafetensorsFile:
    """An open, validated safetensors file. Close it (or use ``with``) when done."""

    data_start: int
    """Where the data section begins (the header's ``data_offsets`` count from here)."""

    def __init__(self, folder: Folder, rel: str, spans: "list[tuple[int, int]] | None" = None) -> None:
        """``spans``: the data byte ranges (from the data section's start) the caller will read, when it knows them:
        the handle is told (:meth:`~ckptio.storage.confined.ReadHandle.advise`), the header's reads first."""
        self.handle: ReadHandle = folder.open(rel)
        self.path = self.handle.path
        try:
            if spans is not None:
                self.handle.advise([(0, min(HEAD_BYTES, self.handle.size))])
            self.metadata, self.entries = self._parse()
            if spans is not None:
                self.handle.advise([(self.data_start + a, self.data_start + b) for a, b in spans])
        except BaseException:
            self.handle.close()
            raise

    def __enter__(self) -> "SafetensorsFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.handle.close()

    def _bad(self, what: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(f"{self.path}: not a valid safetensors file ({what})")

    def _parse(self) -> tuple[dict[str, str], dict[str, StEntry]]:
        size = self.handle.size
        if size < 8:
            raise self._bad(f"truncated: {size} bytes")
        n = int.from_bytes(self.handle.read(0, 8), "little")
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise self._bad(f"header length {n} does not fit the file ({size} bytes)")
        try:
            header = json_value(self.handle.read(8, n), "header", unique_keys=True)
        except CheckpointCorruptError as exc:
            raise self._bad(str(exc)) from exc
        if not isinstance(header, dict):
            raise self._bad("header is not a JSON object")
        start = self.data_start = 8 + n
        metadata = header.pop("__metadata__", None) or {}
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise self._bad("__metadata__ is not a mapping of strings")
        entries: dict[str, StEntry] = {}
        for key, e in header.items():
            if not isinstance(e, dict):
                raise self._bad(f"entry {key!r} is not an object")
            dtype = ST_NAMES.get(e.get("dtype"))  # type: ignore[arg-type]
            if dtype is None:
                raise self._bad(f"{key!r} has unsupported dtype {e.get('dtype')!r:.40}")
            shape, offsets = e.get("shape"), e.get("data_offsets")
            if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
                raise self._bad(f"{key!r} has an invalid shape {shape!r:.80}")
            if not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets):
                raise self._bad(f"{key!r} has invalid data_offsets {offsets!r:.80}")
            begin, end = offsets
            entry = StEntry(key, dtype, tuple(shape), start + begin, end - begin)
            if begin < 0 or end < begin or start + end > size:
                raise self._bad(f"{key!r} claims bytes {begin}..{end} of a data section of {size - start} bytes")
            if entry.nbytes != entry.numel * dtype.itemsize:
                raise self._bad(f"{key!r} has {entry.nbytes} bytes for shape {list(shape)} {dtype}")
            entries[key] = entry
        previous = None
        for entry in sorted(entries.values(), key=lambda x: (x.begin, x.nbytes)):
            if previous is not None and entry.nbytes and entry.begin < previous.begin + previous.nbytes:
                raise self._bad(f"{entry.key!r} and {previous.key!r} share bytes")
            if entry.nbytes:
                previous = entry
        return metadata, entries

    def entry(self, key: str) -> StEntry:
        e = self.entries.get(key)
        if e is None:
            raise CheckpointCorruptError(f"{self.path}: holds no tensor {key!r}")
        return e

    def read(self, key: str) -> torch.Tensor:
        """The whole tensor ``key`` in new memory."""
        e = self.entry(key)
        out = torch.empty(e.shape, dtype=e.dtype)
        if e.nbytes:
            self.handle.readinto(_bytes_of(out), e.begin)
        return out

    def read_into(self, key: str, out: torch.Tensor) -> torch.Tensor:
        """The whole tensor ``key`` into ``out`` (contiguous, its shape and dtype): no new memory."""
        e = self.entry(key)
        if tuple(out.shape) != tuple(e.shape) or out.dtype != e.dtype or not out.is_contiguous():
            raise ValueError(f"{key!r}: cannot read a {e.dtype} {list(e.shape)} tensor into a {out.dtype} "
                             f"{list(out.shape)} one")
        if e.nbytes:
            self.handle.readinto(_bytes_of(out), e.begin)
        return out

    def read_box(self, key: str, lo: list[int], hi: list[int]) -> torch.Tensor:
        """The sub-tensor ``[lo:hi]`` (per dimension) of ``key``: the rows it spans are read, then sliced."""
        e = self.entry(key)
        if not e.shape:
            return self.read(key)
        row = e.dtype.itemsize
        for d in e.shape[1:]:
            row *= d
        rows = torch.empty((hi[0] - lo[0],) + e.shape[1:], dtype=e.dtype)
        if rows.numel():
            self.handle.readinto(_bytes_of(rows), e.begin + lo[0] * row)
        return rows[(slice(None),) + tuple(slice(a, b) for a, b in zip(lo[1:], hi[1:]))]

    def read_rows_into(self, key: str, first: int, out: torch.Tensor) -> None:
        """Read rows ``first : first + len(out)`` of ``key`` straight into ``out`` (contiguous, same dtype,
        same trailing dimensions). ``out`` is a load's destination: under a verifier its last bytes may still be
        being hashed when this returns, so nothing may write to it before the verifier finishes."""
        e = self.entry(key)
        row = e.dtype.itemsize
        for d in e.shape[1:]:
            row *= d
        if out.numel():
            self.handle.readinto(_bytes_of(out), e.begin + first * row, settle=False)


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]

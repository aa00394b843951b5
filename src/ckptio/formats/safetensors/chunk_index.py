"""The chunk index of a sharded folder: where every stored piece of every tensor is, in one file.

A restore on any number of ranks must know, for each tensor, its global shape and dtype and which file holds
which box of it. Without an index, every rank reads the header of every safetensors shard (1,024 opens and
JSON parses per reading rank at 1,024 writers) and unpickles DCP's ``.metadata`` (several Python objects per
chunk: 4 s at 1,024 ranks and 400 optimizer tensors). The save therefore writes the map once, beside the data
(rank 0 knows every rank's chunks: for safetensors from the ownership round the ranks take anyway, for DCP
from the metadata it has just written), as ``.ckptio-chunks``::

    {"ckptio_chunk_index": 1, "kind": "safetensors", "world_size": 2, "meta_bytes": 248, "body_bytes": 472,
     "body_crc32c": "crc32c:1a2b3c4d"}
    {"files": ["shard-00001-model-00001-of-00001.safetensors", ...],
     "tensors": {"lm_head.weight": ["float32", [64, 32], 0, 2], ...}}   <- padded with spaces to 8 bytes
    <int64 little-endian rows>

Each tensor names its dtype, global shape and its run of rows in the table; a row is ``[file number,
offsets..., sizes..., first byte, end byte]`` (for safetensors the range inside the file's data section, as
its header's ``data_offsets`` say; for DCP the stored record's range in the file). A DCP index also lists the
non-tensor values' records and DCP's flattening paths. The first line seals the rest (size and CRC-32C): a
flipped bit or a truncated body is refused before anything in it is used, and the file is listed with its
checksum in the manifest like every other. The rows are checked as headers and metadata are (dtypes, bounds,
byte lengths, exact cover), and each piece read is checked against what the data file itself says (a
safetensors header: :func:`check_against_header`; a DCP record's own framing), so an index that disagrees
with the files fails closed. A folder without the index (NeMo AutoModel's, an older ckptio's, plain DCP's) is
planned from its headers or ``.metadata`` as before.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Collection, NamedTuple, Sequence

import numpy as np
import torch

from ...errors import CheckpointCorruptError
from ...storage.parse import as_int, field, json_object, parsing
from ...storage.checksum import bytes_checksum
from ._writer import ST_DTYPES, nbytes_of
from ..common import TensorInfo, check_exact_cover, dtype_name

if TYPE_CHECKING:
    from ...storage.confined import Folder
    from ._reader import SafetensorsFile

__all__ = ["INDEX_NAME", "Item", "FilePlan", "files_of", "Piece", "ChunkTable", "overlapping_rows", "Index", "encode",
           "encode_dcp", "read", "check_cover", "check_against_header"]

INDEX_NAME = ".ckptio-chunks"
VERSION = 1
MAX_INDEX_BYTES = 512 << 20
_LIMIT = 1 << 60
"""Bound on every number in the index (a tensor's bytes included), so that no sum or product of them overflows."""


@dataclass(frozen=True)
class Piece:
    """One stored chunk: the file holding it (relative to the folder), its box in the tensor and, when it
    comes from the index, its byte range in the file's data section (checked against the file's header)."""

    file: str
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    span: tuple[int, int] | None = None


class ChunkTable:
    """Every stored chunk of one tensor, as arrays: the rows a rank's part overlaps are found without a loop
    over the other ranks' chunks."""

    __slots__ = ("names", "file", "offsets", "sizes", "spans")

    def __init__(self, names: Sequence[str], file: np.ndarray, offsets: np.ndarray, sizes: np.ndarray,
                 spans: np.ndarray) -> None:
        self.names, self.file, self.offsets, self.sizes, self.spans = names, file, offsets, sizes, spans

    def __len__(self) -> int:
        return len(self.file)

    def _piece(self, i: int) -> Piece:
        return Piece(self.names[int(self.file[i])], tuple(int(x) for x in self.offsets[i]),
                     tuple(int(x) for x in self.sizes[i]), (int(self.spans[i, 0]), int(self.spans[i, 1])))

    def __iter__(self):  # type: ignore[no-untyped-def]
        return (self._piece(i) for i in range(len(self)))

    def overlapping(self, offsets: Sequence[int], shape: Sequence[int]) -> list[Piece]:
        """The chunks that share at least one element with the box at ``offsets`` of size ``shape``."""
        return [self._piece(i) for i in overlapping_rows(self.offsets, self.sizes, offsets, shape)]


def overlapping_rows(offsets: np.ndarray, sizes: np.ndarray, lo: Sequence[int], shape: Sequence[int]) -> list[int]:
    """Which of the chunks (``(n, dims)`` arrays of offsets and sizes) share an element with the box at ``lo`` of
    size ``shape``: one vectorised test instead of a loop over every rank's chunks."""
    if not len(lo):
        return list(range(len(offsets)))
    start = np.asarray(lo, dtype=np.int64)
    end = start + np.asarray(shape, dtype=np.int64)
    hit = ((offsets < end) & (start < offsets + sizes)).all(axis=1)
    return [int(i) for i in np.flatnonzero(hit)]


# ------------------------------------------------------------------------------------------------- writing
class Item(NamedTuple):
    """A chunk a rank holds, as the ranks describe it to each other before writing."""
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    global_shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return nbytes_of(self.dtype, self.shape)


class FilePlan(NamedTuple):
    """One shard file a rank writes: its name and the chunks in it, in the order they are stored."""
    name: str
    """Relative to the sharded folder."""
    items: list[Item]


def files_of(items: list[Item], threads: int, name: Callable[[int, int], str], *,
             whole_apart: bool = False, apart: Collection[str] = ()) -> list[FilePlan]:
    """The files a rank writes (``name(part, parts)``) and the chunks in each, in order: the chunks it owns,
    less the empty local parts of non-empty tensors, divided by size into ``threads`` files. Every rank plans
    its own files with this, and rank 0 plans everyone's with it for the index, so the index says what the
    files hold. ``whole_apart``: whole tensors (what every rank reads: an optimizer's step counters) go into a
    file of their own after the others, so that a reader of this rank's shards alone does not need it. ``apart``:
    keys (the frozen ones) in files of their own after the others, so that a save whose frozen tensors did not
    change shares those files whole with the previous checkpoint (:mod:`ckptio.engine.sharing`)."""
    kept = [i for i in items if math.prod(i.shape) or not math.prod(i.global_shape)]
    frozen = [i for i in kept if i.key in apart] if apart and not whole_apart else []
    moving = [i for i in kept if i.key not in apart] if frozen else []
    if frozen and moving:
        groups = [*_balance(moving, max(1, min(threads, len(moving)))),
                  *_balance(frozen, max(1, min(threads, len(frozen))))]
        return [FilePlan(name(g, len(groups)), group) for g, group in enumerate(groups)]
    whole = [i for i in kept if tuple(i.shape) == tuple(i.global_shape)] if whole_apart else []
    parts = [i for i in kept if tuple(i.shape) != tuple(i.global_shape)] if whole else []
    if whole and parts:
        groups = [*_balance(parts, max(1, min(threads, len(parts)))), whole]
    else:
        groups = _balance(kept, max(1, min(threads, len(kept))))
    return [FilePlan(name(g, len(groups)), group) for g, group in enumerate(groups)]


def _balance(entries: list[Item], n: int) -> list[list[Item]]:
    """Split ``entries`` into ``n`` runs of consecutive entries with about the same bytes each."""
    if n <= 1:
        return [entries]
    total = sum(e.nbytes for e in entries) or 1
    groups: list[list[Item]] = [[]]
    done = 0
    for e in entries:
        if groups[-1] and len(groups) < n and done >= total * len(groups) / n:
            groups.append([])
        groups[-1].append(e)
        done += e.nbytes
    return groups


def encode(files: list[FilePlan], world_size: int) -> bytes:
    """The index file's bytes for every rank's safetensors ``files`` (the byte ranges follow from the order of
    each file's items, as the writer lays them out)."""
    out = _Encoder([f.name for f in files])
    for number, f in enumerate(files):
        begin = 0
        for item in f.items:
            if item.dtype not in ST_DTYPES:
                raise TypeError(f"{item.key!r}: dtype {item.dtype} cannot be stored in safetensors")
            out.chunk(item.key, dtype_name(item.dtype), item.global_shape,
                      [number, *item.offsets, *item.shape, begin, begin + item.nbytes])
            begin += item.nbytes
    return out.finish("safetensors", world_size)


def encode_dcp(metadata: Any, world_size: int) -> bytes | None:
    """The index of a DCP folder, from the ``Metadata`` its save just wrote: every chunk with the file and byte
    range of its stored record, every non-tensor value's record, and DCP's flattening paths. A restore reads
    this instead of unpickling ``.metadata`` (seconds at a thousand ranks: several objects per chunk).

    ``None`` when the metadata lacks a record (a writer thread failed, and the save is about to be refused):
    no index is better than one that describes bytes that were never written."""
    names: dict[str, int] = {}
    out = _Encoder([])
    values: dict[str, list[int]] = {}
    for key, entry in metadata.state_dict_metadata.items():
        if not hasattr(entry, "chunks"):
            info = metadata.storage_data.get(_index(key, None))
            if info is None:
                return None
            values[key] = [names.setdefault(info.relative_path, len(names)), info.offset, info.offset + info.length]
            continue
        for chunk in entry.chunks:
            info = metadata.storage_data.get(_index(key, chunk.offsets))
            if info is None:
                return None
            out.chunk(key, dtype_name(entry.properties.dtype), tuple(entry.size),
                      [names.setdefault(info.relative_path, len(names)), *chunk.offsets, *chunk.sizes,
                       info.offset, info.offset + info.length])
    out.files = list(names)
    paths = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    out.extra = {"values": values, "paths": {k: list(v) for k, v in paths.items()},
                 "order": list(metadata.state_dict_metadata)}
    return out.finish("dcp", world_size)


def _index(key: str, offsets: Any) -> Any:
    from torch.distributed.checkpoint.metadata import MetadataIndex

    return MetadataIndex(key, offsets)


class _Encoder:
    def __init__(self, files: list[str]) -> None:
        self.files = files
        self.tensors: dict[str, list[Any]] = {}
        self.rows: dict[str, list[list[int]]] = {}
        self.extra: dict[str, Any] = {}

    def chunk(self, key: str, dtype: str, shape: Sequence[int], row: list[int]) -> None:
        if key not in self.tensors:
            self.tensors[key] = [dtype, list(shape)]
            self.rows[key] = []
        self.rows[key].append(row)

    def finish(self, kind: str, world_size: int) -> bytes:
        table: list[int] = []
        for key, rows in self.rows.items():
            self.tensors[key] += [len(table), len(rows)]
            for row in rows:
                table.extend(row)
        meta = json.dumps({"files": self.files, "tensors": self.tensors, **self.extra}, separators=(",", ":")).encode()
        meta += b" " * (-len(meta) % 8)
        body = meta + np.asarray(table, dtype="<i8").tobytes()
        head = {"ckptio_chunk_index": VERSION, "kind": kind, "world_size": world_size, "meta_bytes": len(meta),
                "body_bytes": len(body), "body_crc32c": bytes_checksum(body)}
        return json.dumps(head, separators=(",", ":")).encode() + b"\n" + body


# ------------------------------------------------------------------------------------------------- reading
@dataclass
class Index:
    """A checked chunk index: each tensor's global shape and dtype with its chunks, and (DCP) each non-tensor
    value's record and DCP's flattening paths."""

    kind: str
    files: list[str]
    tensors: dict[str, tuple[TensorInfo, ChunkTable]]
    values: dict[str, tuple[str, int, int]]
    """DCP: key -> (file, first byte, end byte) of a pickled value."""
    paths: dict[str, tuple]
    """DCP: key -> the nesting it was flattened from (``planner_data``)."""
    order: list[str]
    """DCP: every key, tensors and values, in the order of the metadata."""


def read(folder: "Folder", kind: str = "safetensors") -> Index | None:
    """The folder's index of ``kind``, checked (``None`` when it has none): chunk rows that lie inside their tensor,
    cover it exactly once, name files the index lists and (safetensors) span exactly the chunk's bytes. Every field
    is checked for its type, and anything wrong with the file is a :class:`CheckpointCorruptError` naming it."""
    if folder.kind(INDEX_NAME) is None:
        return None
    where = folder.display(INDEX_NAME)
    data = folder.read_bytes(INDEX_NAME, max_size=MAX_INDEX_BYTES)
    with parsing(where, "the chunk index"):
        head, meta, table = _checked_body(data, where)
        found = field(head, "kind", str, where)
        if found != kind:
            raise CheckpointCorruptError(f"{where}: a chunk index of kind {found!r:.20}, not {kind!r}")
        files, tensors = field(meta, "files", list, where), field(meta, "tensors", dict, where)
        suffix = ".safetensors" if kind == "safetensors" else ".distcp"
        for name in files:
            if not isinstance(name, str) or "/" in name or "\\" in name or name.startswith(".") \
                    or not name.endswith(suffix):
                raise CheckpointCorruptError(f"{where}: the chunk index names {name!r:.80}, not a data file of the "
                                             "folder")
        if len(set(files)) != len(files):
            raise CheckpointCorruptError(f"{where}: the chunk index names a data file twice")
        out = Index(kind, files, {}, {}, {}, list(tensors))
        for key, entry in tensors.items():
            out.tensors[key] = _table(key, entry, files, table, where, exact_bytes=kind == "safetensors")
        if kind == "dcp":
            _dcp_extras(out, meta, where)
    return out


def _dcp_extras(out: Index, meta: dict[str, Any], where: object) -> None:
    values, paths = field(meta, "values", dict, where), field(meta, "paths", dict, where)
    for key, row in values.items():
        if not (isinstance(row, list) and len(row) == 3 and all(type(x) is int and 0 <= x < _LIMIT for x in row)
                and row[0] < len(out.files) and row[1] <= row[2]) or key in out.tensors:
            raise CheckpointCorruptError(f"{where}: value {key!r:.80} in the chunk index has a malformed record")
        out.values[key] = (out.files[row[0]], row[1], row[2])
    for key, path in paths.items():
        if not isinstance(path, list) or not path or not all(
                isinstance(p, str) or type(p) is int and 0 <= p < _LIMIT for p in path):
            raise CheckpointCorruptError(f"{where}: malformed flattening path for {key!r:.80} in the chunk index")
        out.paths[key] = tuple(path)
    order = field(meta, "order", list, where)
    strange = next((k for k in order if not isinstance(k, str)), None)
    if strange is not None:
        raise CheckpointCorruptError(f"{where}: the chunk index's key order lists {strange!r:.60}, not a key")
    if len(order) != len(out.tensors) + len(out.values) or set(order) != set(out.tensors) | set(out.values):
        raise CheckpointCorruptError(f"{where}: the chunk index's key order does not list its tensors and values")
    out.order = order


def _checked_body(data: bytes, where: object) -> tuple[dict[str, Any], dict[str, Any], np.ndarray]:
    first, _, body = data.partition(b"\n")
    head = json_object(first, where, "the chunk index's first line ")
    if field(head, "ckptio_chunk_index", int, where, default=None) != VERSION:
        raise CheckpointCorruptError(f"{where}: not a chunk index of version {VERSION} ({first[:80]!r})")
    if head.get("body_bytes") != len(body) or head.get("body_crc32c") != bytes_checksum(body):
        raise CheckpointCorruptError(
            f"{where}: the chunk index is damaged: its body has {len(body)} bytes with checksum "
            f"{bytes_checksum(body)}, its first line records {head.get('body_bytes')!r:.20} and "
            f"{head.get('body_crc32c')!r:.40}")
    split = as_int(field(head, "meta_bytes", int, where), where, "meta_bytes", hi=len(body))
    if split % 8 or (len(body) - split) % 8:
        raise CheckpointCorruptError(f"{where}: the chunk index's meta_bytes {split!r:.20} does not fit its body")
    meta = json_object(body[:split], where, "the chunk index's body ")
    return head, meta, np.frombuffer(body, dtype="<i8", offset=split).astype(np.int64, copy=False)


def _table(key: str, entry: Any, files: list[str], table: np.ndarray, where: object, *,
           exact_bytes: bool) -> tuple[TensorInfo, ChunkTable]:
    def bad(what: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(f"{where}: tensor {key!r:.80} in the chunk index: {what}")

    if not (isinstance(entry, list) and len(entry) == 4 and isinstance(entry[1], list)):
        raise bad("not a [dtype, shape, first row, rows] entry")
    name, shape, at, count = entry
    dtype = torch_dtype_or_none(name)
    if dtype is None:
        raise bad(f"unknown dtype {name!r:.40}")
    if not all(type(d) is int and 0 <= d < _LIMIT for d in shape) or math.prod(shape) * 8 >= _LIMIT:
        raise bad(f"invalid shape {shape!r:.80}")
    d = len(shape)
    width = 3 + 2 * d
    if type(at) is not int or type(count) is not int or count < 1 or at < 0 or at + count * width > len(table):
        raise bad(f"its rows ({at!r:.20}, {count!r:.20}) are not inside the index's table")
    rows = table[at:at + count * width].reshape(count, width)
    if ((rows >= _LIMIT) | (rows <= -_LIMIT)).any():
        raise bad("a number out of range")
    file, offsets, sizes, spans = rows[:, 0], rows[:, 1:1 + d], rows[:, 1 + d:1 + 2 * d], rows[:, 1 + 2 * d:]
    if (file < 0).any() or (file >= len(files)).any():
        raise bad("a chunk names a file number the index does not list")
    check_cover(key, tuple(shape), offsets, sizes, lambda: [files[int(i)] for i in file], where)  # sizes now fit
    length = spans[:, 1] - spans[:, 0]
    if (spans < 0).any() or (length < 0).any() or exact_bytes and (length != sizes.prod(axis=1) * dtype.itemsize).any():
        raise bad(f"a chunk's byte range does not match its sizes and dtype {name}")
    return TensorInfo(tuple(shape), name), ChunkTable(files, file, offsets, sizes, spans)


def torch_dtype_or_none(name: object) -> Any:
    """The torch dtype a checkpoint names (``float32``), or ``None`` for anything else."""
    value = getattr(torch, name, None) if isinstance(name, str) and name.isidentifier() else None
    return value if isinstance(value, torch.dtype) else None


# ------------------------------------------------------------------------------------------------ checking
def _rows_cover(shape: Sequence[int], offsets: np.ndarray, sizes: np.ndarray) -> bool:
    """Whether chunks that differ along one dimension only (each spanning every other one whole) tile it exactly
    once: a sort in numpy."""
    if not len(shape) or (offsets < 0).any() or (sizes < 0).any():
        return False
    live = sizes.prod(axis=1) > 0
    total = int(np.prod(shape, dtype=np.int64))
    if not live.any():
        return total == 0
    o, s = offsets[live], sizes[live]
    whole = ((o == 0) & (s == np.asarray(shape, dtype=np.int64))).all(axis=0)
    split = np.flatnonzero(~whole)
    if len(split) > 1:
        return False
    dim = int(split[0]) if len(split) else 0
    order = np.argsort(o[:, dim], kind="stable")
    starts = o[order, dim]
    ends = starts + s[order, dim]
    return bool(starts[0] == 0 and ends[-1] == shape[dim] and (starts[1:] == ends[:-1]).all())


def check_cover(key: str, shape: tuple[int, ...], offsets: np.ndarray, sizes: np.ndarray, sources: Callable[[], Sequence[str]],
                where: object) -> None:
    """:func:`ckptio.formats.common.check_exact_cover` for chunks given as ``(n, dims)`` integer arrays: a tensor
    split along one dimension (every chunk spanning the others) is checked with a sort in numpy; any other
    split, and every failure, goes through the general check (a sweep, ``O(n log n)`` for a split along any
    dimension or a grid), which names the chunks and files at fault (``sources()``: where each chunk is stored,
    made only then)."""
    if len(offsets) == 1 and offsets.shape[1] == len(shape):  # one chunk, most tensors: without numpy's overhead
        if not any(offsets[0].tolist()) and sizes[0].tolist() == list(shape):
            return
    elif offsets.shape[1] == len(shape) and _rows_cover(shape, offsets, sizes):
        return
    boxes = [(tuple(o), tuple(s), src) for o, s, src in zip(offsets.tolist(), sizes.tolist(), sources())]
    check_exact_cover(key, shape, boxes, where)


def check_against_header(st: "SafetensorsFile", key: str, piece: Piece, placement: tuple[Any, Any] | None,
                         info: TensorInfo) -> None:
    """Refuse a shard whose header disagrees with the index about ``key``: its dtype, shape and byte range and,
    where the header records them, the tensor's global shape and the piece's place in it. The index and the
    files must tell one story."""
    e = st.entry(key)
    found = (dtype_name(e.dtype), e.shape, (e.begin - st.data_start, e.begin - st.data_start + e.nbytes))
    wanted = (info.dtype, piece.shape, piece.span)
    if found != wanted or placement is not None and (
            tuple(placement[1]) != piece.offsets or placement[0] is not None and tuple(placement[0]) != info.shape):
        raise CheckpointCorruptError(
            f"{st.path}: tensor {key!r} is {found[0]} {list(found[1])} at bytes {found[2]} here "
            f"(placement {placement}), but the folder's chunk index ({INDEX_NAME}) says {wanted[0]} {list(wanted[1])} "
            f"at bytes {wanted[2]}, offsets {list(piece.offsets)} of {list(info.shape)}: the index and the shard "
            "files come from different saves")

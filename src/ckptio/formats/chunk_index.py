"""The chunk index of a sharded safetensors folder: where every stored piece of every tensor is, in one file.

A restore on any number of ranks must know, for each tensor, its global shape and dtype and which file holds
which box of it. Without an index every rank reads the header of every shard file: at 1,024 writing ranks
that is 1,024 opens and JSON parses per reading rank, seconds of planning before the first byte moves. The
save therefore writes the map once, beside the shards (rank 0 knows every rank's chunks from the ownership
round the ranks take anyway), as ``.ckptio-chunks.json``::

    {"ckptio_chunk_index": 1, "world_size": 2, "body_bytes": 1234, "body_crc32c": "crc32c:1a2b3c4d"}
    {"files": ["shard-00001-model-00001-of-00001.safetensors", ...],
     "tensors": {"lm_head.weight": ["F32", [64, 32], [[0, 0, 0, 32, 32, 0, 4096], [1, 32, 0, 32, 32, 0, 4096]]]}}

Each chunk row is ``[file number, offsets..., sizes..., first byte, end byte]`` (the byte range inside the
file's data section, as its header's ``data_offsets`` say). The first line checks the second: a flipped bit
or a truncated body is refused before anything in it is used, and the file is listed with its checksum in
the manifest like every other. The index is checked like headers are (shapes, dtypes, byte lengths, exact
cover) and, when a rank opens a shard to read, each piece it reads is checked against that file's own header
(:func:`check_against_header`), so an index that disagrees with the files fails closed. A folder without the
index (NeMo AutoModel's, an older ckptio's, a hand-made one) is planned from its headers as before.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
import math
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Sequence

import numpy as np
import torch

from ..errors import CheckpointCorruptError
from ..storage.checksum import bytes_checksum
from ._st_writer import ST_DTYPES, ST_NAMES
from .common import TensorInfo, check_exact_cover, dtype_name

if TYPE_CHECKING:
    from ..storage.confined import Folder
    from ._st_reader import SafetensorsFile

__all__ = ["INDEX_NAME", "Item", "FilePlan", "files_of", "Piece", "ChunkTable", "encode", "read", "check_cover", "check_against_header"]

INDEX_NAME = ".ckptio-chunks.json"
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
        if not len(offsets):
            return list(self)
        lo = np.asarray(offsets, dtype=np.int64)
        hi = lo + np.asarray(shape, dtype=np.int64)
        hit = ((self.offsets < hi) & (lo < self.offsets + self.sizes)).all(axis=1)
        return [self._piece(int(i)) for i in np.flatnonzero(hit)]


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
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


class FilePlan(NamedTuple):
    """One shard file a rank writes: its name and the chunks in it, in the order they are stored."""
    name: str
    """Relative to the sharded folder."""
    items: list[Item]


def files_of(items: list[Item], threads: int, name: Callable[[int, int], str]) -> list[FilePlan]:
    """The files a rank writes (``name(part, parts)``) and the chunks in each, in order: the chunks it owns,
    less the empty local parts of non-empty tensors, divided by size into ``threads`` files. Every rank plans
    its own files with this, and rank 0 plans everyone's with it for the index, so the index says what the
    files hold."""
    kept = [i for i in items if math.prod(i.shape) or not math.prod(i.global_shape)]
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
    """The index file's bytes for every rank's ``files`` (the byte ranges follow from the order of each file's
    items, as the writer lays them out)."""
    names = [f.name for f in files]
    tensors: dict[str, list[Any]] = {}
    for number, f in enumerate(files):
        begin = 0
        for item in f.items:
            if item.dtype not in ST_DTYPES:
                raise TypeError(f"{item.key!r}: dtype {item.dtype} cannot be stored in safetensors")
            entry = tensors.setdefault(item.key, [ST_DTYPES[item.dtype], list(item.global_shape), []])
            entry[2].append([number, *item.offsets, *item.shape, begin, begin + item.nbytes])
            begin += item.nbytes
    body = json.dumps({"files": names, "tensors": tensors}, separators=(",", ":")).encode()
    head = {"ckptio_chunk_index": VERSION, "world_size": world_size, "body_bytes": len(body),
            "body_crc32c": bytes_checksum(body)}
    return json.dumps(head, separators=(",", ":")).encode() + b"\n" + body


# ------------------------------------------------------------------------------------------------- reading
def read(folder: "Folder") -> tuple[dict[str, ChunkTable], dict[str, TensorInfo]] | None:
    """The folder's index, checked (``None`` when it has none): each tensor's chunks and its global shape and
    dtype, as :func:`ckptio.formats.safetensors_sharded._scan` finds them in the headers."""
    if folder.kind(INDEX_NAME) is None:
        return None
    where = folder.display(INDEX_NAME)
    data = folder.read_bytes(INDEX_NAME, max_size=MAX_INDEX_BYTES)
    body = _checked_body(data, where)
    files = body.get("files")
    tensors = body.get("tensors")
    if not isinstance(files, list) or not isinstance(tensors, dict):
        raise CheckpointCorruptError(f"{where}: the chunk index has no 'files' list or no 'tensors' object")
    for name in files:
        if not isinstance(name, str) or "/" in name or "\\" in name or name.startswith(".") \
                or not name.endswith(".safetensors"):
            raise CheckpointCorruptError(f"{where}: the chunk index names {name!r:.80}, not a shard file of the folder")
    if len(set(files)) != len(files):
        raise CheckpointCorruptError(f"{where}: the chunk index names a shard file twice")
    chunks: dict[str, ChunkTable] = {}
    infos: dict[str, TensorInfo] = {}
    for key, entry in tensors.items():
        chunks[key], infos[key] = _table(key, entry, files, where)
    return chunks, infos


def _checked_body(data: bytes, where: object) -> dict[str, Any]:
    first, _, body = data.partition(b"\n")
    try:
        head = json.loads(first)
    except (ValueError, RecursionError) as exc:
        raise CheckpointCorruptError(f"{where}: the chunk index's first line is not valid JSON ({exc})") from exc
    if not isinstance(head, dict) or head.get("ckptio_chunk_index") != VERSION:
        raise CheckpointCorruptError(f"{where}: not a chunk index of version {VERSION} ({first[:80]!r})")
    if head.get("body_bytes") != len(body) or head.get("body_crc32c") != bytes_checksum(body):
        raise CheckpointCorruptError(
            f"{where}: the chunk index is damaged: its body has {len(body)} bytes with checksum "
            f"{bytes_checksum(body)}, its first line records {head.get('body_bytes')!r:.20} and "
            f"{head.get('body_crc32c')!r:.40}")
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise CheckpointCorruptError(f"{where}: the chunk index's body is not valid JSON ({exc})") from exc
    if not isinstance(parsed, dict):
        raise CheckpointCorruptError(f"{where}: the chunk index's body is not a JSON object")
    return parsed


def _table(key: str, entry: Any, files: list[str], where: object) -> tuple[ChunkTable, TensorInfo]:
    def bad(what: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(f"{where}: tensor {key!r} in the chunk index: {what}")

    if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[1], list) and isinstance(entry[2], list)):
        raise bad("not a [dtype, shape, chunks] triple")
    st_dtype, shape, rows = entry
    dtype = ST_NAMES.get(st_dtype) if isinstance(st_dtype, str) else None
    if dtype is None:
        raise bad(f"unknown dtype {st_dtype!r:.40}")
    if not all(type(d) is int and 0 <= d < _LIMIT for d in shape) or int(np.prod(shape, dtype=object)) * 8 >= _LIMIT:
        raise bad(f"invalid shape {shape!r:.80}")
    d = len(shape)
    if not rows:
        raise bad("no chunks")
    table = np.array(rows)
    if table.dtype.kind != "i" or table.ndim != 2 or table.shape[1] != 3 + 2 * d or ((table >= _LIMIT) | (table <= -_LIMIT)).any():
        raise bad(f"chunk rows are not rows of {3 + 2 * d} integers")
    file, offsets, sizes, spans = table[:, 0], table[:, 1:1 + d], table[:, 1 + d:1 + 2 * d], table[:, 1 + 2 * d:]
    if (file < 0).any() or (file >= len(files)).any():
        raise bad("a chunk names a file number the index does not list")
    sources = [files[int(i)] for i in file]
    check_cover(key, tuple(shape), offsets, sizes, sources, where)  # sizes now lie inside the shape: no overflow below
    if (spans < 0).any() or ((spans[:, 1] - spans[:, 0]) != sizes.prod(axis=1) * dtype.itemsize).any():
        raise bad(f"a chunk's byte range does not match its sizes and dtype {st_dtype}")
    return ChunkTable(files, file, offsets, sizes, spans), TensorInfo(tuple(shape), dtype_name(dtype))


# ------------------------------------------------------------------------------------------------ checking
def _rows_cover(shape: Sequence[int], offsets: np.ndarray, sizes: np.ndarray) -> bool:
    """Whether chunks that each span every trailing dimension tile dim 0 of ``shape`` exactly once."""
    if not len(shape) or (offsets < 0).any() or (sizes < 0).any():
        return False
    live = sizes.prod(axis=1) > 0
    total = int(np.prod(shape, dtype=np.int64))
    if not live.any():
        return total == 0
    o, s = offsets[live], sizes[live]
    if (o[:, 1:] != 0).any() or (s[:, 1:] != np.asarray(shape[1:], dtype=np.int64)).any():
        return False
    order = np.argsort(o[:, 0], kind="stable")
    starts = o[order, 0]
    ends = starts + s[order, 0]
    return bool(starts[0] == 0 and ends[-1] == shape[0] and (starts[1:] == ends[:-1]).all())


def check_cover(key: str, shape: tuple[int, ...], offsets: np.ndarray, sizes: np.ndarray, sources: Sequence[str],
                where: object) -> None:
    """:func:`ckptio.formats.common.check_exact_cover` for chunks given as ``(n, dims)`` integer arrays: a tensor
    split along dim 0 (every chunk spanning the trailing dimensions) is checked with a sort in numpy; any other
    split, and every failure, goes through the general check, which names the chunks and files at fault."""
    if offsets.shape[1] == len(shape) and _rows_cover(shape, offsets, sizes):
        return
    boxes = [(tuple(int(x) for x in o), tuple(int(x) for x in s), src) for o, s, src in zip(offsets, sizes, sources)]
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

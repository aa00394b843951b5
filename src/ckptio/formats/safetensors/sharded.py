"""Sharded safetensors: one ``.safetensors`` file per rank, holding that rank's local shards.

Each file is a plain safetensors file (``safetensors.safe_open`` reads it) keyed by fully qualified
parameter name. Its header metadata records, for every tensor, the global shape and the offset of the
local shard inside it, so a load on any number of ranks can find and read exactly the slices it needs::

    __metadata__ = {"format": "pt", "ckptio_format": "sharded-safetensors/1",
                    "ckptio_rank": "0", "ckptio_world_size": "2",
                    "ckptio_shards": '{"lm_head.weight": {"shape": [67, 32], "offsets": [0, 0]}, ...}',
                    "DCP_SHARDING_INFO": '{"lm_head.weight": {"saved_offsets": [0, 0]}, ...}'}

``DCP_SHARDING_INFO`` is what NeMo AutoModel (torch DCP's Hugging Face writer) records in its shards; ckptio
writes it too, so AutoModel's reader places every piece, and reads AutoModel's shards by it (the whole
tensor is then as large as its pieces reach; the exact-cover check below still applies).

A replicated tensor is written once (by the first rank that holds it), so the files together hold
every element exactly once. Files without ckptio metadata (any Hugging Face safetensors file) load
too: each tensor is then taken to be whole.

Call sequence: :func:`save` is called by every rank with its own state dict, independently (no
collective inside); :func:`load` likewise, each rank reading only the slices it owns.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch

from typing import TYPE_CHECKING, Any, Callable

from ...errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError
from ...engine.plan import chunk_of, chunk_owners, local_view, overlap, spans_whole_rows
from ...storage.confined import Folder
from ...storage.confined import as_folder as _as_folder
from . import _writer as _st_writer, chunk_index
from ._reader import SafetensorsFile
from ...storage.parse import json_object
from ..common import TensorInfo, check_compatible, check_exact_cover, dtype_name, natural_key, torch_dtype

if TYPE_CHECKING:
    from ...storage.base import FolderWriter
    from ..registry import TensorSource

FORMAT_TAG = "sharded-safetensors/1"
FILE_GLOB = "*.safetensors"


def shard_file_name(rank: int, world_size: int, part: int = 0, parts: int = 1, stem: str = "model") -> str:
    # Named after NeMo AutoModel's layout: the shard index is the writing rank, then which of the rank's
    # files this is (several when the rank writes with several threads).
    """The file name of one rank's model shard, in NeMo AutoModel's pattern
    (``shard-0000R-model-0000P-of-0000N.safetensors``)."""
    return f"shard-{rank + 1:05d}-{stem}-{part + 1:05d}-of-{parts:05d}.safetensors"


_Chunk = chunk_index.Piece


def save(state_dict: dict[str, torch.Tensor], writer: "FolderWriter | str | Path", rel: str = "", *, rank: int,
         world_size: int, threads: int = 1, gather: "Callable[[Any], list[Any]] | None" = None,
         stem: str = "model", whole_apart: bool = False, apart: frozenset[str] = frozenset(),
         share: "Callable[[str, str], str | None] | None" = None) -> dict[str, str]:
    """Write this rank's shards of ``state_dict`` as ``rel/shard-…safetensors`` through ``writer``.

    Every chunk is written exactly once. With ``gather`` (an all-gather over the ranks, e.g.
    :func:`ckptio._dist.all_gather_object`; called once, by every rank) the ranks first tell each other
    which chunks they hold and the lowest rank holding a chunk writes it (:func:`ckptio.engine.plan.chunk_owners`:
    pipeline stages each write their own, TP replicas of an FSDP shard write it once). Without it, a plain
    tensor is written by rank 0 and a DTensor shard by its replica at coordinate 0. With ``threads`` > 1
    the rank's tensors are divided by size into that many files, written concurrently. Returns every file written
    (relative to the writer's folder) with its checksum, computed as the bytes went out. ``writer`` may be a
    local folder, written in place. ``apart``, ``share``: see :func:`_write_files`."""
    if isinstance(writer, (str, Path)):
        from ...storage import LocalFolderWriter

        writer = LocalFolderWriter.in_place(writer)
    views, error = _views(state_dict)
    plans: list[list[chunk_index.FilePlan]] | None = None

    def name_files(r: int) -> Callable[[int, int], str]:
        return lambda part, parts: shard_file_name(r, world_size, part, parts, stem)

    if gather is not None:
        offered = None if error else (threads, [_item(k, v) for k, v in views.items() if chunk_of(k, v) is not None],
                                      sorted(apart & views.keys()))
        everyone = gather(offered)
        failed = [r for r, part in enumerate(everyone) if part is None]
        if error is None and failed:
            raise CheckpointError(f"rank(s) {failed} could not prepare their {stem} shards")
    if error is not None:
        raise error
    if gather is not None:
        owners = chunk_owners([[(i.key, i.offsets) for i in items] for _, items, _ in everyone])

        def plan_of(r: int) -> list[chunk_index.FilePlan]:  # the plan rank r makes for itself
            n, items, frozen = everyone[r]
            return chunk_index.files_of([i for i in items if owners.get((i.key, i.offsets)) == r], n, name_files(r),
                                        whole_apart=whole_apart, apart=frozenset(frozen))

        # rank 0 plans every rank's files for the index; the others only their own
        plans = [plan_of(r) for r in range(len(everyone))] if rank == 0 else None
        mine = plans[rank] if plans is not None else plan_of(rank)
    else:
        mine = chunk_index.files_of([_item(k, v) for k, v in views.items() if (rank == 0 if v.owner is None else v.owner)],
                                    threads, name_files(rank), whole_apart=whole_apart, apart=apart)
        plans = [mine] if world_size == 1 else None  # alone, this rank knows every chunk
    sums = _write_files(mine, views, writer, rel, rank, world_size, apart, share)
    if plans is not None and rank == 0:  # rank 0 knows where every rank put every chunk: one index for the restore
        name = f"{rel}/{chunk_index.INDEX_NAME}" if rel else chunk_index.INDEX_NAME
        sums[name] = writer.write_bytes(name, chunk_index.encode([f for p in plans for f in p], world_size))
    return sums


def _views(state_dict: dict[str, torch.Tensor]) -> tuple[dict[str, Any], Exception | None]:
    """Each tensor's local view, or the error to raise after the gather every rank takes part in."""
    views = {}
    try:
        for key, value in state_dict.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"sharded safetensors holds tensors only; {key!r} is a {type(value).__name__}")
            views[key] = local_view(value)
    except Exception as exc:  # noqa: BLE001 - raised by the caller
        return views, exc
    return views, None


def _item(key: str, view: Any) -> chunk_index.Item:
    return chunk_index.Item(key, view.local.dtype, tuple(view.local.shape), view.offsets, view.shape)


def _write_files(files: list[chunk_index.FilePlan], views: dict, writer: "FolderWriter", rel: str, rank: int,
                 world_size: int, apart: frozenset[str] = frozenset(), share: Any = None) -> dict[str, str]:
    """Write this rank's planned files, concurrently when there are several; their checksums by relative path.
    ``apart`` keys (frozen ones) were planned into files of their own; with ``share``, such a file's content digest is
    offered to it first, and a checksum back means the file is there already, shared with an earlier checkpoint
    (:mod:`ckptio.engine.sharing`): it is not written."""
    shards = {i.key: {"shape": list(i.global_shape), "offsets": list(i.offsets)} for f in files for i in f.items}
    metadata = _metadata(shards, rank, world_size)
    names = [f"{rel}/{f.name}" if rel else f.name for f in files]

    def task(f: chunk_index.FilePlan, name: str) -> Callable[[], str]:
        entries = [_st_writer.Entry(i.key, i.dtype, i.shape, lambda k=i.key: views[k].local)  # type: ignore[misc]
                   for i in f.items]
        if share is not None and f.items and all(i.key in apart for i in f.items):
            return lambda: (share(name, _st_writer.content_digest(entries, metadata))
                            or _st_writer.write(writer.open(name), entries, metadata, held=True))
        # the local shards do not change until the save returns (a background save writes its staged copies)
        return lambda: _st_writer.write(writer.open(name), entries, metadata, held=True)

    tasks = [task(f, name) for f, name in zip(files, names)]
    if len(tasks) == 1:
        return {names[0]: tasks[0]()}
    return dict(zip(names, _st_writer.in_threads(tasks, "ckptio-write")))


def save_whole(source: "TensorSource", writer: "FolderWriter", rel: str,
               progress: Callable[[int], None] | None = None, stem: str = "model") -> dict[str, str]:
    """One process's layout of a whole model (or of a state's tensors: ``stem``), tensor by tensor from ``source``
    (what ``convert`` writes)."""
    index = source.index()
    keys = sorted(index, key=natural_key)
    shards = {k: {"shape": list(index[k].shape), "offsets": [0] * len(index[k].shape)} for k in keys}
    metadata = _metadata(shards, 0, 1)
    entries = [_st_writer.Entry(k, torch_dtype(index[k].dtype), index[k].shape, lambda k=k: source.read(k))  # type: ignore[misc]
               for k in keys]
    name = f"{rel}/{shard_file_name(0, 1, stem=stem)}" if rel else shard_file_name(0, 1, stem=stem)
    return {name: _st_writer.write(writer.open(name), entries, metadata, progress=progress)}


DCP_SHARDING_KEY = "DCP_SHARDING_INFO"
"""Header metadata of the shards NeMo AutoModel writes (torch DCP's Hugging Face writer): each tensor's
``saved_offsets`` in the whole tensor, whose shape is the largest extent of its pieces."""


def _metadata(shards: dict[str, dict[str, list[int]]], rank: int, world_size: int) -> dict[str, str]:
    """A shard file's header metadata: ckptio's placement (global shapes too) and AutoModel's (offsets), so
    that AutoModel's reader places every piece of a sharded tensor where ckptio's does."""
    offsets = {k: {"saved_offsets": v["offsets"]} for k, v in shards.items()}
    return {"format": "pt", "ckptio_format": FORMAT_TAG, "ckptio_rank": str(rank), "ckptio_world_size": str(world_size),
            "ckptio_shards": json.dumps(shards, separators=(",", ":")),
            DCP_SHARDING_KEY: json.dumps(offsets, separators=(",", ":"))}


def as_folder(folder: "str | Path | Folder") -> Folder:
    """A confined :class:`~ckptio.storage.confined.Folder` for a path, URL or folder."""
    return _as_folder(folder)


def _shard_meta(st: SafetensorsFile) -> dict:
    """Each tensor's placement from the file's header: ckptio's ``{"shape", "offsets"}``, or, in a file written
    by NeMo AutoModel (torch DCP's Hugging Face writer), ``{"offsets"}`` alone (``DCP_SHARDING_INFO``)."""
    raw = st.metadata.get("ckptio_shards")
    if raw is not None:
        return json_object(raw, st.path, "ckptio_shards metadata ")
    raw = st.metadata.get(DCP_SHARDING_KEY)
    if raw is None:
        return {}
    info = json_object(raw, st.path, f"{DCP_SHARDING_KEY} metadata ")
    return {k: {"offsets": v.get("saved_offsets")} if isinstance(v, dict) else v for k, v in info.items()}


def _placement(st: SafetensorsFile, key: str, local_shape: tuple[int, ...], meta: dict) -> tuple[tuple | None, tuple]:
    """(global shape, offsets) of a stored chunk, from the file's metadata (whole when absent). The global shape
    is ``None`` when the file gives offsets only: the whole tensor is then as large as its pieces reach."""
    entry = meta.get(key)
    if entry is None:
        return local_shape, (0,) * len(local_shape)
    shape, offsets = (entry.get(k) if isinstance(entry, dict) else None for k in ("shape", "offsets"))
    if isinstance(entry, dict) and "shape" not in entry and isinstance(offsets, list):
        if len(offsets) != len(local_shape) or not all(type(o) is int and o >= 0 for o in offsets):
            raise CheckpointCorruptError(f"{st.path}: tensor {key!r} of shape {list(local_shape)} has saved_offsets "
                                         f"{offsets!r:.80}, which do not fit it")
        return None, tuple(offsets)
    if not (isinstance(shape, list) and isinstance(offsets, list)
            and all(type(d) is int and d >= 0 for d in shape + offsets) and len(shape) == len(offsets) == len(local_shape)
            and all(o + n <= g for o, n, g in zip(offsets, local_shape, shape))):
        raise CheckpointCorruptError(
            f"{st.path}: tensor {key!r} of shape {list(local_shape)} has ckptio_shards placement {entry!r:.120}, "
            "which does not fit it"
        )
    return tuple(shape), tuple(offsets)


def _scan(folder: "str | Path | Folder", files: list[str] | None = None) -> tuple[dict[str, Any], dict[str, TensorInfo]]:
    """Every stored chunk of every tensor, and each tensor's global shape and dtype: from the folder's chunk index
    when it has one and every file is wanted (:mod:`ckptio.formats.safetensors.chunk_index`), else from the headers.

    Refuses, naming the files: unreadable headers, a tensor whose shards disagree on its shape or
    dtype, and chunks that do not cover each tensor exactly once (overlaps or gaps).
    """
    folder = as_folder(folder)
    if files is None:
        indexed = chunk_index.read(folder)
        if indexed is not None:
            return ({k: table for k, (_, table) in indexed.tensors.items()},
                    {k: info for k, (info, _) in indexed.tensors.items()})
        files = [e.name for e in folder.listdir() if e.name.endswith(".safetensors") and e.kind == "file"]
    if not files:
        raise CheckpointNotFoundError(f"{folder.path} holds no .safetensors files")
    chunks: dict[str, list[_Chunk]] = {}
    infos: dict[str, TensorInfo] = {}
    reach: dict[str, tuple[int, ...]] = {}  # tensors placed by offsets alone: the extent of their pieces so far
    for rel in files:
        with SafetensorsFile(folder, rel) as st:
            meta = _shard_meta(st)
            for key, e in st.entries.items():
                global_shape, offsets = _placement(st, key, e.shape, meta)
                dtype = dtype_name(e.dtype)
                if global_shape is None:
                    end = tuple(o + n for o, n in zip(offsets, e.shape))
                    before = reach.get(key, end)
                    global_shape = tuple(max(a, b) for a, b in zip(before, end)) if len(before) == len(end) else end
                    reach[key] = global_shape
                    if key in infos:
                        infos[key] = TensorInfo(global_shape, infos[key].dtype)
                known = infos.get(key)
                if known is not None and (known.shape != global_shape or known.dtype != dtype):
                    raise CheckpointCorruptError(
                        f"{st.path}: tensor {key!r} is {list(global_shape)} {dtype} here but "
                        f"{list(known.shape)} {known.dtype} in another shard file"
                    )
                infos[key] = TensorInfo(global_shape, dtype)
                chunks.setdefault(key, []).append(_Chunk(rel, offsets, e.shape))
    for key, parts in chunks.items():
        check_exact_cover(key, infos[key].shape, [(c.offsets, c.shape, c.file) for c in parts], folder.path)
    return chunks, infos


def read_index(folder: "str | Path | Folder") -> dict[str, TensorInfo]:
    """Global shape and dtype of every tensor in a sharded (or plain) safetensors folder."""
    return _scan(folder)[1]


def read_index_file(path: str | Path) -> dict[str, TensorInfo]:
    """Shape (global, when the file is a ckptio shard) and dtype of every tensor in one file."""
    path = Path(path)
    out = {}
    with SafetensorsFile(Folder(path.parent), path.name) as st:
        meta = _shard_meta(st)
        for key, e in st.entries.items():
            shape, offsets = _placement(st, key, e.shape, meta)
            out[key] = TensorInfo(shape or tuple(o + n for o, n in zip(offsets, e.shape)), dtype_name(e.dtype))
    return out


def load(target: dict[str, torch.Tensor], folder: "str | Path | Folder", *, strict: bool = True,
         progress: Callable[[int], None] | None = None, skip: "frozenset[int]" = frozenset(),
         filled: Callable[[int], None] | None = None) -> None:
    """Fill every tensor of ``target`` (local shards of DTensors, or whole tensors) in place; ``progress`` is
    called with the bytes of each local tensor once it is filled. ``skip``: the identities of values of
    ``target`` another rank reads for this one (:mod:`ckptio.engine.shared_reads`): checked, not read;
    ``filled``: called with a value's identity once it is filled (its bytes may then be sent to those ranks)."""
    load_files(target, folder, None, strict=strict, progress=progress, skip=skip, filled=filled)


def load_files(target: dict[str, torch.Tensor], folder: "str | Path | Folder", files: list[str] | None, *,
               strict: bool = True, progress: Callable[[int], None] | None = None,
               skip: "frozenset[int]" = frozenset(), filled: Callable[[int], None] | None = None) -> None:
    """Like :func:`load`, reading only ``files`` (names relative to ``folder``; ``None``: every ``.safetensors``).

    One thread: parallel reads measured slower on the reference machine (``benchmarks/parallel_io.py``).
    """
    folder = as_folder(folder)
    chunks, infos = _scan(folder, files)
    check_compatible(infos, target, str(folder.path), strict=strict)
    _fill(target, [k for k in target if id(target[k]) not in skip], chunks, infos, folder, progress, filled)


def _fill(target: dict[str, torch.Tensor], keys: list[str], chunks: dict[str, Any], infos: dict[str, TensorInfo],
          folder: Folder, progress: Callable[[int], None] | None = None,
          filled: Callable[[int], None] | None = None) -> None:
    """Copy, for each key, the overlap of every stored chunk with this rank's part of the tensor.

    When the overlap spans whole rows on both sides and dtypes match, the bytes are contiguous on both
    and are read straight into the target's memory; otherwise the rows spanned are read into a buffer
    and the box copied. Every element of the rank's part is filled: the chunks were checked to cover the
    tensor exactly once.
    """
    plan: list[tuple[str, Any, list]] = []  # (key, local view, the chunks it overlaps)
    spans: dict[str, list[tuple[int, int]] | None] = {}  # per file, the data ranges to read (None: not known)
    for key in keys:
        view = local_view(target[key])
        if view.local.numel() == 0:
            continue
        parts = chunks[key]
        found = list(parts.overlapping(view.offsets, view.local.shape) if isinstance(parts, chunk_index.ChunkTable)
                     else parts)
        plan.append((key, view, found))
        for chunk in found:
            if chunk.span is None:
                spans[chunk.file] = None
            elif spans.setdefault(chunk.file, []) is not None:
                spans[chunk.file].append(chunk.span)  # type: ignore[union-attr]
    with ExitStack() as stack:
        files: dict[str, SafetensorsFile] = {}

        def open_file(rel: str) -> SafetensorsFile:
            if rel not in files:
                files[rel] = stack.enter_context(SafetensorsFile(folder, rel, spans.get(rel)))
            return files[rel]

        for key, view, found in plan:
            local = view.local
            for chunk in found:
                box = overlap(view.offsets, tuple(local.shape), chunk.offsets, chunk.shape)
                if box is None:
                    continue
                st = open_file(chunk.file)
                _check_piece(st, key, chunk, infos[key])
                with torch.no_grad():
                    if local.dim() == 0:
                        local.copy_(st.read(key).to(local.dtype))
                    elif spans_whole_rows(box, chunk.shape, tuple(local.shape)) and st.entry(key).dtype == local.dtype \
                            and local.is_contiguous() and local.device.type == "cpu":
                        st.read_rows_into(key, box.src_lo[0], local[box.dst_lo[0]:box.dst_hi[0]])
                    else:
                        local[box.dst_index()].copy_(st.read_box(key, list(box.src_lo), list(box.src_hi)))
            if progress is not None:
                progress(local.numel() * local.element_size())
            if filled is not None:
                filled(id(target[key]))


def _check_piece(st: SafetensorsFile, key: str, piece: _Chunk, info: TensorInfo) -> None:
    """A piece planned from the chunk index must be what the file's own header says (fail closed)."""
    if piece.span is None:
        return
    meta = getattr(st, "_placements", None)
    if meta is None:
        meta = st._placements = _shard_meta(st)  # type: ignore[attr-defined]
    placement = _placement(st, key, st.entry(key).shape, meta) if key in meta else None
    chunk_index.check_against_header(st, key, piece, placement, info)


# ---------------------------------------------------------------------------------------- reading whole tensors
class SafetensorsSource:
    """Sharded (ckptio) or plain safetensors files in one folder; whole tensors assembled from their chunks.

    Reads are positional (``pread``) rather than memory maps, so the source's pages stay out of this
    process's resident set and memory stays bounded by the tensor being assembled. ``files``: names
    relative to ``folder`` (``None``: every ``.safetensors`` file in it).
    """

    def __init__(self, folder: "Path | Folder", files: list[str] | None = None) -> None:
        self.root = as_folder(folder)
        self.folder = self.root.path
        self._chunks, self._infos = _scan(self.root, files)
        self._open: dict[str, SafetensorsFile] = {}

    def index(self) -> dict[str, TensorInfo]:
        return dict(self._infos)

    def _file(self, rel: str) -> SafetensorsFile:
        if rel not in self._open:
            if len(self._open) >= 64:  # bound the descriptors held open at once
                self.close()
            self._open[rel] = SafetensorsFile(self.root, rel)
        return self._open[rel]

    def file_of(self, key: str) -> str:
        """The file (relative to the folder) holding ``key``, or its first piece: what an error about it names."""
        if key not in self._chunks:
            raise CheckpointCorruptError(f"{self.folder}: no tensor {key!r} in its safetensors files")
        return next(iter(self._chunks[key])).file

    def close(self) -> None:
        for f in self._open.values():
            f.close()
        self._open.clear()

    def read(self, key: str) -> torch.Tensor:
        if key not in self._infos:
            raise CheckpointCorruptError(f"{self.folder}: no tensor {key!r} in its safetensors files")
        info = self._infos[key]
        chunks = list(self._chunks[key])
        if len(chunks) == 1 and chunks[0].shape == info.shape:
            st = self._file(chunks[0].file)
            _check_piece(st, key, chunks[0], info)
            return st.read(key)
        return self.read_into(key, torch.empty(info.shape, dtype=torch_dtype(info.dtype)))

    def read_into(self, key: str, out: torch.Tensor) -> torch.Tensor:
        """The whole tensor ``key`` assembled into ``out`` (contiguous, its shape and stored dtype), returned: a
        piece whose place in ``out`` is contiguous (a whole tensor, rows of a dim-0 shard) is read straight
        into it, so a caller that reuses one buffer touches no new memory."""
        if key not in self._infos:
            raise CheckpointCorruptError(f"{self.folder}: no tensor {key!r} in its safetensors files")
        for chunk in self._chunks[key]:
            target = out[tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.shape))]
            st = self._file(chunk.file)
            _check_piece(st, key, chunk, self._infos[key])
            if target.is_contiguous():
                st.read_into(key, target)
            else:
                target.copy_(st.read(key))
        return out

"""Sharded safetensors: one ``.safetensors`` file per rank, holding that rank's local shards.

Each file is a plain safetensors file (``safetensors.safe_open`` reads it) keyed by fully qualified
parameter name. Its header metadata records, for every tensor, the global shape and the offset of the
local shard inside it, so a load on any number of ranks can find and read exactly the slices it needs::

    __metadata__ = {"format": "pt", "ckptio_format": "sharded-safetensors/1",
                    "ckptio_rank": "0", "ckptio_world_size": "2",
                    "ckptio_shards": '{"lm_head.weight": {"shape": [67, 32], "offsets": [0, 0]}, ...}'}

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

from ..errors import CheckpointCorruptError, CheckpointMismatchError, CheckpointNotFoundError
from ..storage.confined import Folder
from . import _st_writer
from ._st_reader import SafetensorsFile
from .common import TensorInfo, check_exact_cover, dtype_name

FORMAT_TAG = "sharded-safetensors/1"
FILE_GLOB = "*.safetensors"


def shard_file_name(rank: int, world_size: int, part: int = 0, parts: int = 1) -> str:
    # Named after NeMo AutoModel's layout: the shard index is the writing rank, then which of the rank's
    # files this is (several when the rank writes with several threads).
    return f"shard-{rank + 1:05d}-model-{part + 1:05d}-of-{parts:05d}.safetensors"


@dataclass(frozen=True)
class _Chunk:
    file: str
    """Relative to the folder."""
    offsets: tuple[int, ...]
    shape: tuple[int, ...]


def _local_view(value: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...], bool]:
    """(local tensor, global shape, global offsets, whether this rank is the one to write it)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    if isinstance(value, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        if any(isinstance(p, Partial) for p in value.placements):
            value = value.redistribute(placements=[Replicate() if isinstance(p, Partial) else p for p in value.placements])
        local = value.to_local()
        _shape, offsets = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
        coord = value.device_mesh.get_coordinate() or []
        owner = all(c == 0 for c, p in zip(coord, value.placements) if isinstance(p, Replicate))
        return local, tuple(value.shape), tuple(int(o) for o in offsets), owner
    return value, tuple(value.shape), (0,) * value.dim(), None  # type: ignore[return-value]


def save(state_dict: dict[str, torch.Tensor], folder: str | Path, *, rank: int, world_size: int,
         threads: int = 1) -> dict[Path, str]:
    """Write this rank's shards of ``state_dict`` to ``folder/shard-…safetensors``, fsynced.

    Plain (non-DTensor) tensors are taken as replicated and written by rank 0 only. With ``threads`` > 1
    the rank's tensors are divided by size into that many files, written concurrently. Returns every
    file written with its checksum, computed as the bytes went out.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    shards: dict[str, dict[str, list[int]]] = {}
    for key, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"sharded safetensors holds tensors only; {key!r} is a {type(value).__name__}")
        local, shape, offsets, owner = _local_view(value)
        if owner is None:
            owner = rank == 0
        if not owner or local.numel() == 0 and len(shape) > 0 and any(shape):
            continue
        tensors[key] = local
        shards[key] = {"shape": list(shape), "offsets": list(offsets)}
    metadata = {
        "format": "pt",
        "ckptio_format": FORMAT_TAG,
        "ckptio_rank": str(rank),
        "ckptio_world_size": str(world_size),
        "ckptio_shards": json.dumps(shards, separators=(",", ":")),
    }
    entries = [_st_writer.Entry(k, t.dtype, tuple(t.shape), lambda t=t: t) for k, t in tensors.items()]
    groups = _balance(entries, max(1, min(threads, len(entries))))
    paths = [folder / shard_file_name(rank, world_size, i, len(groups)) for i in range(len(groups))]
    if len(groups) == 1:
        return {paths[0]: _st_writer.write(paths[0], groups[0], metadata)}
    digests = _in_threads([lambda i=i: _st_writer.write(paths[i], groups[i], metadata) for i in range(len(groups))],
                          "ckptio-write")
    return dict(zip(paths, digests))


def _in_threads(tasks: list, name: str) -> list:
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


def _balance(entries: list[_st_writer.Entry], n: int) -> list[list[_st_writer.Entry]]:
    """Split ``entries`` into ``n`` runs of consecutive entries with about the same bytes each."""
    if n <= 1:
        return [entries]
    total = sum(e.nbytes for e in entries) or 1
    groups: list[list[_st_writer.Entry]] = [[]]
    done = 0
    for e in entries:
        if groups[-1] and len(groups) < n and done >= total * len(groups) / n:
            groups.append([])
        groups[-1].append(e)
        done += e.nbytes
    return groups


def as_folder(folder: "str | Path | Folder") -> Folder:
    return folder if isinstance(folder, Folder) else Folder(folder)


def _shard_meta(st: SafetensorsFile) -> dict:
    raw = st.metadata.get("ckptio_shards")
    if raw is None:
        return {}
    try:
        meta = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise CheckpointCorruptError(f"{st.path}: ckptio_shards metadata is not valid JSON ({exc})") from exc
    if not isinstance(meta, dict):
        raise CheckpointCorruptError(f"{st.path}: ckptio_shards metadata is not a mapping")
    return meta


def _placement(st: SafetensorsFile, key: str, local_shape: tuple[int, ...], meta: dict) -> tuple[tuple, tuple]:
    """(global shape, offsets) of a stored chunk, from the file's ckptio metadata (whole when absent)."""
    entry = meta.get(key)
    if entry is None:
        return local_shape, (0,) * len(local_shape)
    shape, offsets = (entry.get(k) if isinstance(entry, dict) else None for k in ("shape", "offsets"))
    if not (isinstance(shape, list) and isinstance(offsets, list)
            and all(type(d) is int and d >= 0 for d in shape + offsets) and len(shape) == len(offsets) == len(local_shape)
            and all(o + n <= g for o, n, g in zip(offsets, local_shape, shape))):
        raise CheckpointCorruptError(
            f"{st.path}: tensor {key!r} of shape {list(local_shape)} has ckptio_shards placement {entry!r:.120}, "
            "which does not fit it"
        )
    return tuple(shape), tuple(offsets)


def _scan(folder: "str | Path | Folder", files: list[str] | None = None) -> tuple[dict[str, list[_Chunk]], dict[str, TensorInfo]]:
    """Every stored chunk of every tensor, and each tensor's global shape and dtype (headers only).

    Refuses, naming the files: unreadable headers, a tensor whose shards disagree on its shape or
    dtype, and chunks that do not cover each tensor exactly once (overlaps or gaps).
    """
    folder = as_folder(folder)
    if files is None:
        files = [e.name for e in folder.listdir() if e.name.endswith(".safetensors") and e.kind == "file"]
    if not files:
        raise CheckpointNotFoundError(f"{folder.path} holds no .safetensors files")
    chunks: dict[str, list[_Chunk]] = {}
    infos: dict[str, TensorInfo] = {}
    for rel in files:
        with SafetensorsFile(folder, rel) as st:
            meta = _shard_meta(st)
            for key, e in st.entries.items():
                global_shape, offsets = _placement(st, key, e.shape, meta)
                dtype = dtype_name(e.dtype)
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
            out[key] = TensorInfo(_placement(st, key, e.shape, meta)[0], dtype_name(e.dtype))
    return out


def check_compatible(
    saved: dict[str, TensorInfo | None], target: dict[str, torch.Tensor], where: str, *, strict: bool
) -> None:
    """Raise :class:`CheckpointMismatchError` naming ``where`` and the key if ``saved`` cannot fill ``target``."""
    missing = [k for k in target if k not in saved]
    wrong = [
        f"{k}: checkpoint has {list(saved[k].shape)}, model expects {list(v.shape)}"  # type: ignore[union-attr]
        for k, v in target.items()
        if k in saved and saved[k] is not None and tuple(saved[k].shape) != tuple(v.shape)  # type: ignore[union-attr]
    ]
    unexpected = [k for k in saved if k not in target] if strict else []
    problems = []
    if missing:
        problems.append(f"{len(missing)} key(s) missing from the checkpoint, e.g. {missing[:3]}")
    if wrong:
        problems.append(f"{len(wrong)} shape mismatch(es): " + "; ".join(wrong[:3]))
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected key(s) in the checkpoint, e.g. {unexpected[:3]}")
    if problems:
        raise CheckpointMismatchError(
            f"{where} does not match the model: " + " | ".join(problems)
            + " (is this a checkpoint of a different model or config?)"
        )


def load(target: dict[str, torch.Tensor], folder: "str | Path | Folder", *, strict: bool = True) -> None:
    """Fill every tensor of ``target`` (local shards of DTensors, or whole tensors) in place."""
    load_files(target, folder, None, strict=strict)


def load_files(target: dict[str, torch.Tensor], folder: "str | Path | Folder", files: list[str] | None, *,
               strict: bool = True) -> None:
    """Like :func:`load`, reading only ``files`` (names relative to ``folder``; ``None``: every ``.safetensors``).

    One thread: parallel reads measured slower on the reference machine (``benchmarks/parallel_io.py``).
    """
    folder = as_folder(folder)
    chunks, infos = _scan(folder, files)
    check_compatible(infos, target, str(folder.path), strict=strict)
    _fill(target, list(target), chunks, folder)


def _fill(target: dict[str, torch.Tensor], keys: list[str], chunks: dict[str, list[_Chunk]], folder: Folder) -> None:
    """Copy, for each key, the overlap of every stored chunk with this rank's part of the tensor.

    When the overlap differs from both only along dim 0 (whole tensors, FSDP2's row shards) and dtypes
    match, the bytes are contiguous on both sides and are read straight into the target's memory;
    otherwise the rows spanned are read into a buffer and the box copied.
    """
    with ExitStack() as stack:
        files: dict[str, SafetensorsFile] = {}

        def open_file(rel: str) -> SafetensorsFile:
            if rel not in files:
                files[rel] = stack.enter_context(SafetensorsFile(folder, rel))
            return files[rel]

        for key in keys:
            local, shape, offsets, _owner = _local_view(target[key])
            if local.numel() == 0:
                continue
            for chunk in chunks[key]:
                lo = [max(a, b) for a, b in zip(offsets, chunk.offsets)]
                hi = [min(a + n, b + m) for a, n, b, m in zip(offsets, local.shape, chunk.offsets, chunk.shape)]
                if local.dim() > 0 and any(h <= l for l, h in zip(lo, hi)):
                    continue
                st = open_file(chunk.file)
                stored = st.entry(key)
                src_lo = [l - c for l, c in zip(lo, chunk.offsets)]
                src_hi = [h - c for h, c in zip(hi, chunk.offsets)]
                dst_index = tuple(slice(l - o, h - o) for l, h, o in zip(lo, hi, offsets))
                whole_rows = all(l == 0 and h == n for l, h, n in zip(src_lo[1:], src_hi[1:], chunk.shape[1:])) and \
                    all(l - o == 0 and h - o == n for l, h, o, n in zip(lo[1:], hi[1:], offsets[1:], local.shape[1:]))
                with torch.no_grad():
                    if local.dim() == 0:
                        local.copy_(st.read(key).to(local.dtype))
                    elif whole_rows and stored.dtype == local.dtype and local.is_contiguous() \
                            and local.device.type == "cpu":
                        st.read_rows_into(key, src_lo[0], local[dst_index[0]])
                    else:
                        local[dst_index].copy_(st.read_box(key, src_lo, src_hi))
            # every element of this rank's part is filled: the chunks cover the tensor exactly (checked in _scan)


def data_files(folder: str | Path) -> list[Path]:
    return sorted(Path(folder).glob(FILE_GLOB))

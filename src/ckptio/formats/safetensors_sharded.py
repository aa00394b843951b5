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
import os
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch
from safetensors import safe_open

from ..errors import CheckpointCorruptError, CheckpointMismatchError, CheckpointNotFoundError
from . import _st_writer
from .common import TensorInfo

FORMAT_TAG = "sharded-safetensors/1"
FILE_GLOB = "*.safetensors"


def shard_file_name(rank: int, world_size: int, part: int = 0, parts: int = 1) -> str:
    # Named after NeMo AutoModel's layout: the shard index is the writing rank, then which of the rank's
    # files this is (several when the rank writes with several threads).
    return f"shard-{rank + 1:05d}-model-{part + 1:05d}-of-{parts:05d}.safetensors"


@dataclass(frozen=True)
class _Chunk:
    file: Path
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


def _scan(folder: Path, files: list[Path] | None = None) -> tuple[dict[str, list[_Chunk]], dict[str, TensorInfo]]:
    if files is None:
        files = sorted(p for p in folder.glob(FILE_GLOB) if p.is_file())
    if not files:
        raise CheckpointNotFoundError(f"{folder} holds no .safetensors files")
    chunks: dict[str, list[_Chunk]] = {}
    infos: dict[str, TensorInfo] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as fh:
                meta = fh.metadata() or {}
                shard_meta = json.loads(meta["ckptio_shards"]) if "ckptio_shards" in meta else {}
                for key in fh.keys():
                    sl = fh.get_slice(key)
                    local_shape = tuple(int(d) for d in sl.get_shape())
                    dtype = _SAFETENSORS_DTYPES.get(sl.get_dtype(), sl.get_dtype().lower())
                    entry = shard_meta.get(key)
                    if entry is None:
                        global_shape, offsets = local_shape, (0,) * len(local_shape)
                    else:
                        global_shape = tuple(int(d) for d in entry["shape"])
                        offsets = tuple(int(o) for o in entry["offsets"])
                    if len(offsets) != len(local_shape) or any(
                        o < 0 or o + n > g for o, n, g in zip(offsets, local_shape, global_shape)
                    ):
                        raise CheckpointCorruptError(
                            f"{path}: tensor {key!r} of shape {list(local_shape)} at offsets {list(offsets)} "
                            f"does not fit its global shape {list(global_shape)}"
                        )
                    known = infos.get(key)
                    if known is not None and (known.shape != global_shape or known.dtype != dtype):
                        raise CheckpointCorruptError(
                            f"{path}: tensor {key!r} is {list(global_shape)} {dtype} here but "
                            f"{list(known.shape)} {known.dtype} in another shard file"
                        )
                    infos[key] = TensorInfo(global_shape, dtype)
                    chunks.setdefault(key, []).append(_Chunk(path, offsets, local_shape))
        except CheckpointCorruptError:
            raise
        except Exception as exc:  # safetensors raises its own error types for damaged headers
            raise CheckpointCorruptError(f"{path}: not a readable safetensors file ({type(exc).__name__}: {exc})") from exc
    for key, parts in chunks.items():
        covered = sum(_numel(c.shape) for c in parts)
        if covered != infos[key].numel:
            raise CheckpointCorruptError(
                f"{folder}: the shards of {key!r} cover {covered} of {infos[key].numel} elements "
                "(a shard file is missing or belongs to another save)"
            )
    return chunks, infos


# safetensors dtype tag -> torch's short dtype name, from the writer's own table
_SAFETENSORS_DTYPES = {tag: str(dtype).removeprefix("torch.") for tag, dtype in _st_writer.ST_NAMES.items()}


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def read_index(folder: str | Path) -> dict[str, TensorInfo]:
    """Global shape and dtype of every tensor in a sharded (or plain) safetensors folder."""
    return _scan(Path(folder))[1]


def read_index_file(path: str | Path) -> dict[str, TensorInfo]:
    """Shape (global, when the file is a ckptio shard) and dtype of every tensor in one file."""
    path = Path(path)
    out = {}
    try:
        with safe_open(str(path), framework="pt") as fh:
            shard_meta = json.loads((fh.metadata() or {}).get("ckptio_shards", "{}"))
            for key in fh.keys():
                sl = fh.get_slice(key)
                shape = tuple(shard_meta[key]["shape"]) if key in shard_meta else tuple(sl.get_shape())
                out[key] = TensorInfo(shape, _SAFETENSORS_DTYPES.get(sl.get_dtype(), sl.get_dtype().lower()))
    except Exception as exc:
        raise CheckpointCorruptError(f"{path}: not a readable safetensors file ({type(exc).__name__}: {exc})") from exc
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


def load(target: dict[str, torch.Tensor], folder: str | Path, *, strict: bool = True) -> None:
    """Fill every tensor of ``target`` (local shards of DTensors, or whole tensors) in place."""
    load_files(target, folder, None, strict=strict)


def load_files(target: dict[str, torch.Tensor], folder: str | Path, files: list[Path] | None, *,
               strict: bool = True) -> None:
    """Like :func:`load`, reading only ``files`` of ``folder`` (``None``: every ``.safetensors`` file).

    One thread: parallel reads measured slower on the reference machine (``benchmarks/parallel_io.py``).
    """
    folder = Path(folder)
    chunks, infos = _scan(folder, files)
    check_compatible(infos, target, str(folder), strict=strict)
    _fill(target, list(target), chunks, folder)


class _DirectReader:
    """Reads a run of whole rows of a stored tensor straight into the target's memory with ``preadv``.

    Used when the overlap between a stored chunk and this rank's tensor differs from both only along
    dim 0 (whole tensors, FSDP2's row shards) and dtypes match: the bytes are contiguous on both sides,
    so no intermediate tensor is allocated and nothing is copied twice.
    """

    def __init__(self, stack: ExitStack) -> None:
        self.stack = stack
        self.fds: dict[Path, int] = {}
        self.headers: dict[Path, tuple[dict, int]] = {}

    def read(self, chunk: _Chunk, key: str, local: torch.Tensor, lo: list[int], hi: list[int],
             offsets: tuple[int, ...]) -> bool:
        if local.dim() == 0 or not local.is_contiguous() or local.device.type != "cpu":
            return False
        if any(l != c or h != c + n for l, h, c, n in zip(lo[1:], hi[1:], chunk.offsets[1:], chunk.shape[1:])) or \
                any(l != o or h != o + n for l, h, o, n in zip(lo[1:], hi[1:], offsets[1:], local.shape[1:])):
            return False
        if chunk.file not in self.headers:
            from .hf_bundle import read_safetensors_header  # the validated header reader

            self.headers[chunk.file] = read_safetensors_header(chunk.file)
            fd = os.open(chunk.file, os.O_RDONLY)
            self.stack.callback(os.close, fd)
            self.fds[chunk.file] = fd
        header, start = self.headers[chunk.file]
        entry = header.get(key)
        if not isinstance(entry, dict) or _st_writer.ST_NAMES.get(entry.get("dtype")) != local.dtype:
            return False
        row = local.element_size()
        for d in local.shape[1:]:
            row *= d
        begin = int(entry["data_offsets"][0])
        src = start + begin + (lo[0] - chunk.offsets[0]) * row
        length = (hi[0] - lo[0]) * row
        if begin + (chunk.shape[0] * row) > int(entry["data_offsets"][1]):
            raise CheckpointCorruptError(f"{chunk.file}: {key!r} holds fewer bytes than its shape needs")
        dst = memoryview(local.view(torch.uint8).reshape(-1).numpy())[(lo[0] - offsets[0]) * row:][:length]
        done = 0
        while done < length:
            n = os.preadv(self.fds[chunk.file], [dst[done:]], src + done)
            if n <= 0:
                raise CheckpointCorruptError(f"{chunk.file}: truncated while reading {key!r}")
            done += n
        return True


def _fill(target: dict[str, torch.Tensor], keys: list[str], chunks: dict[str, list[_Chunk]], folder: Path) -> None:
    with ExitStack() as stack:
        handles: dict[Path, object] = {}
        direct = _DirectReader(stack)

        def handle(path: Path):
            if path not in handles:
                handles[path] = stack.enter_context(safe_open(str(path), framework="pt"))
            return handles[path]

        for key in keys:
            local, shape, offsets, _owner = _local_view(target[key])
            if local.numel() == 0:
                continue
            filled = 0
            for chunk in chunks[key]:
                lo = [max(a, b) for a, b in zip(offsets, chunk.offsets)]
                hi = [min(a + n, b + m) for a, n, b, m in zip(offsets, local.shape, chunk.offsets, chunk.shape)]
                if any(h <= l for l, h in zip(lo, hi)) and local.dim() > 0:
                    continue
                with torch.no_grad():
                    if direct.read(chunk, key, local, lo, hi, offsets):
                        n = 1
                        for l, h in zip(lo, hi):
                            n *= h - l
                        filled += n
                        continue
                src_index = tuple(slice(l - c, h - c) for l, h, c in zip(lo, hi, chunk.offsets))
                dst_index = tuple(slice(l - o, h - o) for l, h, o in zip(lo, hi, offsets))
                try:
                    part = handle(chunk.file).get_slice(key)[src_index] if src_index else handle(chunk.file).get_tensor(key)
                except Exception as exc:
                    raise CheckpointCorruptError(f"{chunk.file}: cannot read {key!r} ({type(exc).__name__}: {exc})") from exc
                with torch.no_grad():
                    local[dst_index].copy_(part)
                filled += part.numel()
            if filled != local.numel():
                raise CheckpointCorruptError(
                    f"{folder}: only {filled} of {local.numel()} elements of {key!r} needed by this rank were found"
                )


def data_files(folder: str | Path) -> list[Path]:
    return sorted(Path(folder).glob(FILE_GLOB))


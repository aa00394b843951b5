"""Consolidated Hugging Face bundles, written by streaming from sharded checkpoints.

A bundle is what ``transformers.AutoModelForCausalLM.from_pretrained(dir)`` reads::

    config.json  generation_config.json  tokenizer files
    model-00001-of-00002.safetensors  model-00002-of-00002.safetensors
    model.safetensors.index.json       # {"metadata": {"total_size": N}, "weight_map": {key: file}}

Consolidation never holds the whole model: the plan (which tensor goes to which file, at which byte
offset) is computed from the source's index alone, each output file's header is written first, and
tensors are then assembled one at a time from the source shards and appended. Peak extra memory is
about twice the largest tensor (the assembled tensor plus one source chunk). With several ranks, output
files are divided among them and written in parallel; every rank computes the same plan.

Sources: a folder of sharded (or plain) safetensors files, or a DCP folder.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

import torch

from ..errors import CheckpointCorruptError, ConfigError
from ..storage import fsync_file
from . import _st_writer
from . import dcp as dcp_format
from . import safetensors_sharded
from ._st_reader import SafetensorsFile
from .common import TensorInfo
from ..storage.confined import Folder

INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = "5GB"
_WEIGHT_SUFFIXES = (".safetensors", ".distcp")
_NOT_EXTRAS = {dcp_format.METADATA_FILE, INDEX_FILE, "manifest.json"}

_ST_DTYPES = _st_writer.ST_DTYPES
_ST_NAMES = _st_writer.ST_NAMES


def parse_size(value: str | int) -> int:
    """``"5GB"`` -> 5_000_000_000 (decimal units, as Hugging Face counts), ``"2GiB"`` -> 2**31, ints as is."""
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(I?)B?\s*", str(value).upper())
        if not m:
            raise ConfigError(f"max shard size {value!r} is not a size such as '5GB', '500MB' or '2GiB'")
        base = 1024 if m.group(3) else 1000
        size = int(float(m.group(1)) * base ** " KMGT".index(m.group(2) or " "))
    if size < 1:
        raise ConfigError(f"max shard size must be positive, got {value!r}")
    return size


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"unknown dtype {name!r}; use e.g. bfloat16, float16 or float32")
    return dtype


# ---------------------------------------------------------------------------------------- sources
class TensorSource(Protocol):
    """Whole tensors, one at a time, from a saved model folder."""

    folder: Path

    def index(self) -> dict[str, TensorInfo]: ...

    def read(self, key: str) -> torch.Tensor: ...


class SafetensorsSource:
    """Sharded (ckptio) or plain safetensors files in one folder; reads whole local chunks positionally.

    Reading with ``pread`` rather than a memory map keeps the source's pages out of this process's
    resident set, so memory stays bounded by the tensor being assembled. ``files``: names relative to
    ``folder`` (``None``: every ``.safetensors`` file in it).
    """

    def __init__(self, folder: "Path | Folder", files: list[str] | None = None) -> None:
        self.root = safetensors_sharded.as_folder(folder)
        self.folder = self.root.path
        self._chunks, self._infos = safetensors_sharded._scan(self.root, files)
        self._open: dict[str, SafetensorsFile] = {}

    def index(self) -> dict[str, TensorInfo]:
        return dict(self._infos)

    def _file(self, rel: str) -> SafetensorsFile:
        if rel not in self._open:
            if len(self._open) >= 64:  # bound the descriptors held open at once
                for f in self._open.values():
                    f.close()
                self._open.clear()
            self._open[rel] = SafetensorsFile(self.root, rel)
        return self._open[rel]

    def close(self) -> None:
        for f in self._open.values():
            f.close()
        self._open.clear()

    def read(self, key: str) -> torch.Tensor:
        if key not in self._infos:
            raise CheckpointCorruptError(f"{self.folder}: no tensor {key!r} in its safetensors files")
        info = self._infos[key]
        chunks = self._chunks[key]
        if len(chunks) == 1 and chunks[0].shape == info.shape:
            return self._file(chunks[0].file).read(key)
        out = torch.empty(info.shape, dtype=torch_dtype(info.dtype))
        for chunk in chunks:
            part = self._file(chunk.file).read(key)
            out[tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.shape))].copy_(part)
            del part
        return out


class DCPSource:
    """A DCP folder; each read is a single-process DCP load of one key (chunks are read whole)."""

    def __init__(self, folder: "Path | Folder") -> None:
        self.root = safetensors_sharded.as_folder(folder)
        self.folder = self.root.path
        self._index = {k: v for k, v in dcp_format.read_index(self.root).items() if v is not None}

    def index(self) -> dict[str, TensorInfo]:
        return dict(self._index)

    def read(self, key: str) -> torch.Tensor:
        if key not in self._index:
            raise CheckpointCorruptError(f"{self.folder}: no tensor {key!r} in its DCP metadata")
        info = self._index[key]
        out = {key: torch.empty(info.shape, dtype=torch_dtype(info.dtype))}
        dcp_format.load(out, self.root, no_dist=True)
        return out[key]


def open_source(folder: "str | Path | Folder") -> TensorSource:
    root = safetensors_sharded.as_folder(folder)
    if root.is_file(dcp_format.METADATA_FILE):
        return DCPSource(root)
    return SafetensorsSource(root)


# ---------------------------------------------------------------------------------------- planning
def _natural_key(key: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", key)]


@dataclass
class BundlePlan:
    """Which tensors go to which output file; identical on every rank."""

    files: list[list[str]]
    infos: dict[str, TensorInfo]
    dtype: torch.dtype | None

    def out_dtype(self, key: str) -> torch.dtype:
        src = torch_dtype(self.infos[key].dtype)
        return self.dtype if self.dtype is not None and src.is_floating_point else src

    def nbytes(self, key: str) -> int:
        return self.infos[key].numel * self.out_dtype(key).itemsize

    def file_name(self, i: int) -> str:
        return f"model-{i + 1:05d}-of-{len(self.files):05d}.safetensors"

    @property
    def total_size(self) -> int:
        return sum(self.nbytes(k) for keys in self.files for k in keys)

    def weight_map(self) -> dict[str, str]:
        return {k: self.file_name(i) for i, keys in enumerate(self.files) for k in keys}


def plan_bundle(infos: dict[str, TensorInfo], max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
                dtype: str | torch.dtype | None = None) -> BundlePlan:
    """Split tensors, in natural key order, into files of at most ``max_shard_size`` bytes.

    A tensor larger than the limit gets a file of its own, as Hugging Face does.
    """
    limit = parse_size(max_shard_size)
    out_dtype = torch_dtype(dtype) if isinstance(dtype, str) else dtype
    plan = BundlePlan([], dict(infos), out_dtype)
    current: list[str] = []
    size = 0
    for key in sorted(infos, key=_natural_key):
        n = plan.nbytes(key)
        if current and size + n > limit:
            plan.files.append(current)
            current, size = [], 0
        current.append(key)
        size += n
    if current or not plan.files:
        plan.files.append(current)
    return plan


# ---------------------------------------------------------------------------------------- writing
def _write_file(path: Path, keys: list[str], plan: BundlePlan, source: TensorSource,
                progress: Callable[[int], None] | None) -> str:
    entries = [_st_writer.Entry(k, plan.out_dtype(k), plan.infos[k].shape, lambda k=k: source.read(k)) for k in keys]
    tmp = path.with_name(f".{path.name}.partial")
    digest = _st_writer.write(tmp, entries, progress=progress)
    os.replace(tmp, path)
    return digest


def write_files(plan: BundlePlan, source: TensorSource, out_dir: str | Path, *, rank: int = 0,
                world_size: int = 1, progress: Callable[[int], None] | None = None) -> dict[Path, str]:
    """Write the files of ``plan`` that fall to ``rank`` (file ``i`` goes to rank ``i % world_size``).

    Returns each written file with its checksum.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = {}
    for i, keys in enumerate(plan.files):
        if i % world_size == rank:
            path = out_dir / plan.file_name(i)
            written[path] = _write_file(path, keys, plan, source, progress)
    return written


def write_index(plan: BundlePlan, out_dir: str | Path) -> Path:
    """Write ``model.safetensors.index.json`` (call once, after every rank wrote its files)."""
    path = Path(out_dir) / INDEX_FILE
    data = {"metadata": {"total_size": plan.total_size}, "weight_map": plan.weight_map()}
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    fsync_file(path)
    return path


_MAX_EXTRA_BYTES = 1 << 30


def copy_extras(src_dir: "str | Path | Folder", out_dir: str | Path) -> list[str]:
    """Copy config, generation config and tokenizer files (every regular file that is not weights) to ``out_dir``.

    Only regular files directly inside ``src_dir`` are copied (through the confined folder: a link there
    is skipped, never followed).
    """
    src = safetensors_sharded.as_folder(src_dir)
    copied = []
    for entry in src.listdir():
        name = entry.name
        if entry.kind == "file" and not name.endswith(_WEIGHT_SUFFIXES) and name not in _NOT_EXTRAS \
                and not name.startswith("."):
            (Path(out_dir) / name).write_bytes(src.read_bytes(name, max_size=_MAX_EXTRA_BYTES))
            fsync_file(Path(out_dir) / name)
            copied.append(name)
    return copied


def save_hf_extras(model: torch.nn.Module, out_dir: str | Path, tokenizer: object | None = None) -> list[str]:
    """Write ``config.json``, ``generation_config.json`` and the tokenizer of a transformers model."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    before = set(os.listdir(out_dir))
    config = getattr(model, "config", None)
    if config is not None and callable(getattr(config, "save_pretrained", None)):
        config.save_pretrained(out_dir)
    gen = getattr(model, "generation_config", None)
    can_generate = getattr(model, "can_generate", None)
    if gen is not None and callable(getattr(gen, "save_pretrained", None)) and (not callable(can_generate) or can_generate()):
        gen.save_pretrained(out_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    new = sorted(set(os.listdir(out_dir)) - before)
    for name in new:
        if (out_dir / name).is_file():
            fsync_file(out_dir / name)
    return new


def prepare(src_folder: str | Path, *, max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
            dtype: str | torch.dtype | None = None) -> tuple[TensorSource, BundlePlan]:
    """Open the saved model in ``src_folder`` and plan its bundle (reads headers and metadata only)."""
    source = open_source(src_folder)
    return source, plan_bundle(source.index(), max_shard_size, dtype)


def write_bundle(source: TensorSource, plan: BundlePlan, out_dir: str | Path, *, rank: int = 0,
                 world_size: int = 1, progress: Callable[[int], None] | None = None) -> dict[Path, str]:
    """Write this rank's share of ``plan``; rank 0 also writes the index and copies config and tokenizer.

    Returns the weight files this rank wrote, with their checksums.
    """
    written = write_files(plan, source, out_dir, rank=rank, world_size=world_size, progress=progress)
    if rank == 0:
        write_index(plan, out_dir)
        copy_extras(getattr(source, "root", None) or source.folder, out_dir)
        if plan.dtype is not None:
            _set_config_dtype(Path(out_dir) / "config.json", plan.dtype)
    return written


def _set_config_dtype(path: Path, dtype: torch.dtype) -> None:
    """Record a cast in config.json, so that ``from_pretrained(dtype="auto")`` keeps it."""
    if not path.is_file():
        return
    config = json.loads(path.read_text())
    name = str(dtype).removeprefix("torch.")
    for key in ("dtype", "torch_dtype"):
        if key in config:
            config[key] = name
    if "dtype" not in config and "torch_dtype" not in config:
        config["dtype"] = name
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    fsync_file(path)


def consolidate(src_folder: str | Path, out_dir: str | Path, *, max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
                dtype: str | torch.dtype | None = None, rank: int = 0, world_size: int = 1,
                progress: Callable[[int], None] | None = None) -> tuple[BundlePlan, dict[Path, str]]:
    """Write a Hugging Face bundle of the model saved in ``src_folder`` (sharded safetensors or DCP).

    Every rank of ``world_size`` calls this with the same arguments (no collective inside): each writes
    its share of the files, and rank 0 also writes the index and copies the config and tokenizer files.
    The bundle is complete once every rank has returned.
    """
    source, plan = prepare(src_folder, max_shard_size=max_shard_size, dtype=dtype)
    checksums = write_bundle(source, plan, out_dir, rank=rank, world_size=world_size, progress=progress)
    return plan, checksums

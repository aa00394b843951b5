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

Sources: a folder of sharded (or plain) safetensors files, or a DCP folder (any format the registry opens).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from ...storage.confined import Folder
from ...storage.parse import json_object
from . import _writer as _st_writer
from ..dcp import format as dcp_format
from . import fp8_blocks, sharded as safetensors_sharded
from ..common import TensorInfo, natural_key, parse_size, torch_dtype
from ..extras import INDEX_FILE, copy_extras, join as _join
from ..registry import Format, Opened, WriteOptions, register

if TYPE_CHECKING:
    from ...storage.base import FolderWriter
    from ..registry import TensorSource

DEFAULT_MAX_SHARD_SIZE = "5GB"



def open_source(folder: "str | Path | Folder") -> "TensorSource":
    """The tensors of a saved model folder (sharded safetensors or DCP), whatever its format."""
    from ..registry import detect

    if isinstance(folder, (str, Path, Folder)):
        path = folder.path if isinstance(folder, Folder) else Path(folder)
        return detect(path).open(path).source
    # a remote folder (a step being written to a bucket): its model is DCP or sharded safetensors
    from .sharded import SafetensorsSource

    if folder.kind(dcp_format.METADATA_FILE) is not None:
        return dcp_format.DCPSource(folder)
    return SafetensorsSource(folder)


# ---------------------------------------------------------------------------------------- planning
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
    for key in sorted(infos, key=natural_key):
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
def write_files(plan: BundlePlan, source: "TensorSource", writer: "FolderWriter", rel: str, *, rank: int = 0,
                world_size: int = 1, progress: Callable[[int], None] | None = None) -> dict[str, str]:
    """Write the files of ``plan`` that fall to ``rank`` (file ``i`` goes to rank ``i % world_size``) under
    ``rel`` of ``writer``. Returns each written file (relative to the writer's folder) with its checksum."""
    written = {}
    scratch = _Scratch()
    for i, keys in enumerate(plan.files):
        if i % world_size == rank:
            name = _join(rel, plan.file_name(i))
            entries = [_st_writer.Entry(k, plan.out_dtype(k), plan.infos[k].shape, scratch.reader(source, plan, k))
                       for k in keys]
            written[name] = _st_writer.write(writer.open(name), entries, progress=progress)
    return written


class _Scratch:
    """One buffer, grown to the largest tensor, that every tensor of a bundle is read into in turn: the writer
    has written (and checksummed) a tensor's bytes before it asks for the next, and memory first touched costs
    more than the read itself on a VM that hands freed pages back to its host."""

    def __init__(self) -> None:
        self.buffer = torch.empty(0, dtype=torch.uint8)

    def view(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        n = dtype.itemsize
        for d in shape:
            n *= d
        if n > self.buffer.numel():
            self.buffer = torch.empty(n, dtype=torch.uint8)
        return self.buffer[:n].view(dtype).view(shape)

    def reader(self, source: "TensorSource", plan: BundlePlan, key: str) -> Callable[[], torch.Tensor]:
        stored = torch_dtype(plan.infos[key].dtype)
        if not hasattr(source, "read_into") or stored != plan.out_dtype(key):
            return lambda: source.read(key)
        return lambda: source.read_into(key, self.view(tuple(plan.infos[key].shape), stored))  # type: ignore[attr-defined]


def write_index(plan: BundlePlan, writer: "FolderWriter", rel: str) -> dict[str, str]:
    """Write ``model.safetensors.index.json`` (once, by rank 0)."""
    data = {"metadata": {"total_size": plan.total_size}, "weight_map": plan.weight_map()}
    name = _join(rel, INDEX_FILE)
    return {name: writer.write_bytes(name, (json.dumps(data, indent=2, sort_keys=True) + "\n").encode())}


def save_hf_extras(model: torch.nn.Module, out_dir: str | Path, tokenizer: Any = None) -> list[str]:
    """Write ``config.json``, ``generation_config.json`` and the tokenizer of a transformers model into the
    local folder ``out_dir`` (a writer's :meth:`~ckptio.storage.base.FolderWriter.local_path`)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    before = set(os.listdir(out_dir))
    config = getattr(model, "config", None)
    if config is not None and callable(getattr(config, "save_pretrained", None)):
        config.save_pretrained(out_dir)
        _drop_fp8_quantization(out_dir / "config.json")
    gen: Any = getattr(model, "generation_config", None)
    can_generate = getattr(model, "can_generate", None)
    if gen is not None and callable(getattr(gen, "save_pretrained", None)) and (not callable(can_generate) or can_generate()):
        gen.save_pretrained(out_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    return sorted(set(os.listdir(out_dir)) - before)


def _drop_fp8_quantization(path: Path) -> None:
    """A model built from a block FP8 release's config keeps its ``quantization_config``, but the weights ckptio
    writes are the dequantized ones: the saved ``config.json`` loses it, or transformers would read the plain
    weights as FP8 blocks without their scales."""
    if not path.is_file():
        return
    config = json_object(path.read_bytes(), path)
    plain = fp8_blocks.plain_config(config)
    if plain is not config:
        path.write_text(json.dumps(plain, indent=2, sort_keys=True) + "\n")


def prepare(src_folder: "str | Path | Folder", *, max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
            dtype: str | torch.dtype | None = None) -> tuple["TensorSource", BundlePlan]:
    """Open the saved model in ``src_folder`` and plan its bundle (reads headers and metadata only)."""
    source = open_source(src_folder)
    return source, plan_bundle(source.index(), max_shard_size, dtype)


def write_bundle(source: "TensorSource", plan: BundlePlan, writer: "FolderWriter", rel: str, *, rank: int = 0,
                 world_size: int = 1, progress: Callable[[int], None] | None = None,
                 extras: "Path | Folder | None" = None) -> dict[str, str]:
    """Write this rank's share of ``plan`` under ``rel``; rank 0 also writes the index and copies config and
    tokenizer files (from ``extras``, by default the source's own folder).

    Returns every file this rank wrote, with its checksum.
    """
    written = write_files(plan, source, writer, rel, rank=rank, world_size=world_size, progress=progress)
    if rank == 0:
        written.update(write_index(plan, writer, rel))
        written.update(copy_extras(extras if extras is not None else getattr(source, "root", None) or source.folder,
                                   writer, rel, dtype=plan.dtype))
    return written


def consolidate(src_folder: "str | Path | Folder", writer: "FolderWriter", rel: str, *,
                max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE, dtype: str | torch.dtype | None = None,
                rank: int = 0, world_size: int = 1,
                progress: Callable[[int], None] | None = None) -> tuple[BundlePlan, dict[str, str]]:
    """Write a Hugging Face bundle of the model saved in ``src_folder`` (sharded safetensors or DCP).

    Every rank of ``world_size`` calls this with the same arguments (no collective inside): each writes
    its share of the files, and rank 0 also writes the index and copies the config and tokenizer files.
    The bundle is complete once every rank has returned.
    """
    source, plan = prepare(src_folder, max_shard_size=max_shard_size, dtype=dtype)
    try:
        checksums = write_bundle(source, plan, writer, rel, rank=rank, world_size=world_size, progress=progress)
    finally:
        source.close()
    return plan, checksums


# ---------------------------------------------------------------------------------------- the format
class HFBundle(Format):
    """A Hugging Face model folder: ``config.json``, ``model-K-of-N.safetensors``, index, tokenizer files."""

    name = "hf"
    summary = "Hugging Face folder (config.json + model safetensors + index)"
    needs_config = True
    priority = 70

    def detect(self, path: Path) -> bool:
        return path.is_dir() and ((path / "config.json").is_file() or (path / INDEX_FILE).is_file()) \
            and any(path.glob("*.safetensors")) and not any(path.glob("shard-*.safetensors"))

    def open(self, path: Path) -> Opened:
        source: Any = safetensors_sharded.SafetensorsSource(path)
        try:
            blocks = fp8_blocks.read_blocks(source.root)  # a block FP8 release reads dequantized
            if blocks is not None:
                source = fp8_blocks.DequantizedSource(source, blocks)
            else:
                fp8_blocks.refuse_undeclared(source.index(), lambda k: source.root.display(source.file_of(k)),
                                             source.root.display("config.json"))
        except BaseException:
            source.close()
            raise
        return Opened(self.name, source, path)

    def write(self, opened: Opened, source: "TensorSource", out: Path, options: WriteOptions) -> None:
        from ...storage import LocalFolderWriter

        plan = plan_bundle(source.index(), options.max_shard_size)
        writer = LocalFolderWriter.create(out)
        try:
            write_files(plan, source, writer, "", progress=options.progress)
            write_index(plan, writer, "")
            if opened.extras is not None:
                copy_extras(opened.extras, writer, "", dtype=options.dtype)
            writer.commit()
        except BaseException:
            writer.abort()
            raise


register(HFBundle())

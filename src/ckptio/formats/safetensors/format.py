"""The ``safetensors`` format of the registry: ckptio's per-rank shard layout as a model format inside a
step directory, as a training state (the optimizer's fast path: tensors as shards, plain values in
``values.json``), and as a convert source and target. The layout itself (writing shards, scanning
headers, exact coverage, reading into local shards) is :mod:`ckptio.formats.safetensors.sharded`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ...errors import CheckpointMismatchError
from ...storage.confined import Folder
from ..common import TensorInfo, flatten, set_dotted
from ..registry import Format, Opened, ShardContext, WriteOptions, register
from .sharded import FILE_GLOB, SafetensorsSource, load, read_index, read_index_file, save, save_whole

if TYPE_CHECKING:
    from ...storage.base import FolderWriter
    from ..registry import TensorSource


class ShardedSafetensors(Format):
    """ckptio's per-rank safetensors layout: a folder of ``shard-R-model-K-of-N.safetensors`` (or one file)."""

    name = "safetensors"
    shares_reads = True
    groups_apart = True
    summary = "safetensors shards (ckptio's per-rank layout, or any plain safetensors files)"
    priority = 60
    full_model = True

    def detect(self, path: Path) -> bool:
        if path.is_file():
            return path.suffix == ".safetensors"
        return path.is_dir() and (any(path.glob("shard-*.safetensors"))
                                  or (any(path.glob(FILE_GLOB)) and not (path / "config.json").is_file()
                                      and not (path / "model.safetensors.index.json").is_file()))

    def open(self, path: Path) -> Opened:
        if path.is_file():
            return Opened(self.name, SafetensorsSource(path.parent, [path.name]), path.parent)
        return Opened(self.name, SafetensorsSource(path), path)

    def write(self, opened: Opened, source: "TensorSource", out: Path, options: WriteOptions) -> None:
        from ...storage import LocalFolderWriter
        from ..extras import copy_extras

        writer = LocalFolderWriter.create(out)
        try:
            save_whole(source, writer, "", options.progress)
            if opened.extras is not None:
                copy_extras(opened.extras, writer, "")
            writer.commit()
        except BaseException:
            writer.abort()
            raise

    def index(self, folder: Folder) -> dict[str, TensorInfo | None]:
        return dict(read_index(folder))

    def save_shards(self, state_dict: dict, writer: "FolderWriter", rel: str, ctx: ShardContext) -> dict[str, str]:
        from ... import _dist

        stem = ctx.extra.get("stem", "model")
        # the ranks agree on who writes which chunk (pipeline stages, TP replicas of FSDP shards) first
        gather = _dist.all_gather_object if ctx.world_size > 1 else None
        return _dist.run_collectively(f"writing {stem} shards", lambda: save(
            state_dict, writer, rel, rank=ctx.rank, world_size=ctx.world_size, threads=ctx.threads,
            gather=gather, stem=stem, whole_apart=bool(ctx.extra.get("whole_apart")),
            apart=frozenset(ctx.extra.get("apart", ())), share=ctx.extra.get("share")))

    def load_shards(self, target: dict, folder: Folder, *, strict: bool, ctx: ShardContext) -> None:
        from ... import _dist

        _dist.run_collectively("loading the model", lambda: load(target, folder, strict=strict, progress=ctx.progress,
                                                                skip=ctx.extra.get("skip", frozenset()),
                                                                filled=ctx.extra.get("filled")))

    # a training state: tensors as shards, plain values in values.json (the optimizer's fast path)
    def save_state(self, state: dict, writer: "FolderWriter", rel: str, ctx: ShardContext) -> dict[str, str]:
        from ... import _dist
        from ..values_json import VALUES_FILE, dumps

        flat = flatten(state)
        tensors = {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}
        values = {k: v for k, v in flat.items() if not isinstance(v, torch.Tensor)}
        sums = self.save_shards(tensors, writer, rel, ShardContext(ctx.rank, ctx.world_size, ctx.threads,
                                                                   {**ctx.extra, "stem": ctx.extra.get("stem", "state")}))
        merged: dict = {}
        for rank, part in enumerate(_dist.all_gather_object(values) if ctx.world_size > 1 else [values]):
            for key, value in part.items():
                if key in merged and merged[key] != value:
                    raise CheckpointMismatchError(f"ranks disagree on {key!r}: {merged[key]!r} and {value!r} (rank {rank})")
                merged[key] = value
        name = f"{rel}/{VALUES_FILE}" if rel else VALUES_FILE

        def write() -> dict[str, str]:
            return {name: writer.write_bytes(name, dumps(merged))} if ctx.rank == 0 and merged else {}

        sums.update(_dist.run_collectively(f"writing {name}", write))
        return sums

    def state_index(self, folder: Folder) -> dict[str, TensorInfo | None]:
        from ..values_json import VALUES_FILE, loads

        index: dict[str, TensorInfo | None] = dict(read_index(folder)) if any(
            e.name.endswith(".safetensors") for e in folder.listdir()) else {}
        if folder.kind(VALUES_FILE) is not None:
            from ..values_json import MAX_VALUES_BYTES

            for key in loads(folder.read_bytes(VALUES_FILE, max_size=MAX_VALUES_BYTES), folder.display(VALUES_FILE)):
                index[key] = None
        return index

    def read_state(self, folder: Folder) -> dict:
        from ..values_json import MAX_VALUES_BYTES, VALUES_FILE, loads

        out: dict = {}
        if any(e.name.endswith(".safetensors") for e in folder.listdir()):
            source = SafetensorsSource(folder)
            try:
                out.update({k: source.read(k) for k in source.index()})
            finally:
                source.close()
        if folder.kind(VALUES_FILE) is not None:
            out.update(loads(folder.read_bytes(VALUES_FILE, max_size=MAX_VALUES_BYTES), folder.display(VALUES_FILE)))
        return out

    def state_values(self, folder: Folder) -> dict:
        from ..values_json import MAX_VALUES_BYTES, VALUES_FILE, loads

        if folder.kind(VALUES_FILE) is None:
            return {}
        return dict(loads(folder.read_bytes(VALUES_FILE, max_size=MAX_VALUES_BYTES), folder.display(VALUES_FILE)))

    def load_state(self, target: dict, folder: Folder, ctx: ShardContext) -> None:
        from ... import _dist
        from ..values_json import MAX_VALUES_BYTES, VALUES_FILE, loads

        flat = flatten(target)
        tensors = {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}

        def read() -> None:
            if tensors:
                load(tensors, folder, strict=False, progress=ctx.progress, skip=ctx.extra.get("skip", frozenset()),
                     filled=ctx.extra.get("filled"))
            if folder.kind(VALUES_FILE) is not None:
                values = loads(folder.read_bytes(VALUES_FILE, max_size=MAX_VALUES_BYTES), folder.display(VALUES_FILE))
                for key in flat:
                    if key in values and not isinstance(flat[key], torch.Tensor):
                        set_dotted(target, key, values[key])

        _dist.run_collectively(f"loading {folder.path}", read)

    def describe(self, path: Path) -> dict:
        if not path.is_file():
            return super().describe(path)
        from dataclasses import asdict

        from ..common import summarize_index

        return {"path": str(path), "kind": "safetensors_file", "label": "safetensors file",
                "tensors": asdict(summarize_index(read_index_file(path))), "files": {path.name: path.stat().st_size}}


register(ShardedSafetensors())

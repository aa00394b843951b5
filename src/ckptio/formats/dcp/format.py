"""PyTorch Distributed Checkpoint (DCP) folders: ``__R_K.distcp`` files per rank plus ``.metadata``.

Saving is :mod:`ckptio.formats.dcp.save`; this module reads, and registers the format.

Saving and loading go through ``torch.distributed.checkpoint`` itself, so plain DCP reads what we
write and resharding on load is DCP's. Two things are made safe on the way in:

* ``.metadata`` is a pickle. It is read with an unpickler that admits only DCP's own metadata
  classes, so a hostile file cannot run code.
* Non-tensor values (optimizer hyper-parameters, scheduler state) are loaded with
  ``torch.load(weights_only=True)`` instead of DCP's default unrestricted ``torch.load``.

Call sequence: :func:`save` and :func:`load` are collectives when a process group is initialised
(every rank calls them with its own local state dict); :func:`read_index` is local.
"""

from __future__ import annotations

import io
import os
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    Metadata,
    TensorStorageMetadata,
)

from ... import _dist
from ...errors import CheckpointCorruptError, CheckpointError
from ...storage.confined import Folder, UnsafePathError, as_folder
from ..common import TensorInfo, check_compatible, dtype_name, flatten, torch_dtype
from ..pt import check_bytes
from .metadata import METADATA_FILE, read_metadata
from .save import _plain_errors, _quiet_single_process, save
from ..registry import Format, Opened, ShardContext, WriteOptions, register

if TYPE_CHECKING:
    from ...storage.base import FolderWriter
    from ..registry import TensorSource

class _ConfinedFileSystem(FileSystem):
    """DCP's filesystem for reading, with every data file opened through the confined :class:`Folder`."""

    def __init__(self, root: Folder, base: Path) -> None:
        super().__init__()
        self.root, self.base = root, base

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        if "r" not in mode or "+" in mode:
            raise CheckpointError(f"{path}: the DCP reader does not write")
        try:
            rel = Path(path).relative_to(self.base).as_posix()
        except ValueError:
            raise UnsafePathError(f"{path}: outside the DCP folder {self.root.path}") from None
        with self.root.open(rel) as handle:
            yield handle.stream()  # type: ignore[misc]


class SafeFileSystemReader(FileSystemReader):
    """DCP's filesystem reader with the restricted metadata unpickler and confined data files."""

    def __init__(self, folder: "str | Path | Folder") -> None:
        self.root = as_folder(folder)
        # DCP joins file names to a base path of its own; a folder in object storage gets a made-up local
        # one, mapped back to the folder by the confined file system (every byte is read through it)
        base = self.root.path if isinstance(self.root.path, Path) else Path("/ckptio-remote-dcp-folder")
        super().__init__(str(base))
        self.fs = _ConfinedFileSystem(self.root, base)

    def read_data(self, plan: Any, planner: Any) -> Any:
        """DCP's read, with each file's items taken in file order: one forward pass per file, so a
        verifying load hashes the bytes as they stream by instead of reading them a second time. (The
        usual load does not come here: :mod:`.direct` reads it; this serves the rest, see :func:`load`.)"""
        import dataclasses

        storage = self.storage_data
        items = sorted(plan.items, key=lambda it: (storage[it.storage_index].relative_path,
                                                   storage[it.storage_index].offset))
        return super().read_data(dataclasses.replace(plan, items=items), planner)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        filename = METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}"
        metadata = read_metadata(self.root, filename)
        storage_meta = getattr(metadata, "storage_meta", None)
        if storage_meta is not None:
            storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but non-tensor values are loaded with ``weights_only=True``; ``progress``
    is told the bytes of each tensor chunk once it has been read into place."""

    def __init__(self, *args: Any, progress: Callable[[int], None] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.progress = progress

    def commit_tensor(self, read_item: Any, tensor: torch.Tensor) -> None:
        super().commit_tensor(read_item, tensor)
        if self.progress is not None:
            self.progress(tensor.numel() * tensor.element_size())

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        check_bytes(value.getvalue(), f"DCP value {read_item.dest_index.fqn!r}")
        value.seek(0)
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as exc:
            raise CheckpointCorruptError(
                f"DCP value {read_item.dest_index.fqn!r} is not a plain value that can be loaded safely: {exc}"
            ) from exc
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._nested_dict import set_element  # noqa: PLC0415

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def load(state_dict: dict[str, Any], folder: "str | Path | Folder", *, no_dist: bool = False,
         progress: Callable[[int], None] | None = None, check: Callable[[], None] | None = None,
         skip: "frozenset[int]" = frozenset(), filled: Callable[[int], None] | None = None) -> None:
    """Collective: fill ``state_dict`` in place from a DCP folder, resharding as DCP does.

    ``no_dist=True`` makes it a local read on this rank alone, whatever the process group. ``progress``:
    called with the bytes of each chunk read into place. ``check``: run first on every rank (e.g. the keys
    against the folder's index); what it raises fails the load on every rank. ``skip``: the identities of tensors
    of ``state_dict`` another rank reads for this one (:mod:`ckptio.engine.shared_reads`), honoured by the direct
    path (DCP's own load, when a rank cannot take that path, reads everything on every rank); ``filled``: called
    by the direct path with a tensor's identity once every chunk of it was read.
    """
    from . import direct as dcp_direct

    reader = SafeFileSystemReader(folder)
    local = no_dist or not _dist.is_dist()

    def direct() -> bool:
        """Each rank plans its own reads from the metadata and makes them, when DCP's load would do exactly that
        (:mod:`.direct`); whether every rank could is agreed in the same round, so that DCP's collective load
        runs on every rank or on none (reading again what a direct rank read: rare, and the same bytes)."""
        if check is not None:
            check()
        planned = dcp_direct.plan(state_dict, reader.root, skip)
        if planned is not None:
            dcp_direct.execute(planned, progress, filled)
        return planned is not None

    if direct() if local else all(_dist.agree(f"loading DCP folder {reader.root.path}", direct, share=bool)[1]):
        return
    with _quiet_single_process(), _plain_errors("loading", reader.root.path):
        dcp.load(state_dict, storage_reader=reader, planner=SafeLoadPlanner(progress=progress),
                 process_group=_dist.current_group(),
                 no_dist=no_dist or not _dist.is_dist())


def read_index(folder: "str | Path | Folder") -> dict[str, TensorInfo | None]:
    """Every key of a DCP folder: tensor keys map to their global shape and dtype, others to ``None``."""
    from .direct import layout

    where = layout(as_folder(folder))
    return {key: where.tensors.get(key) for key in where.order}


def load_all(folder: "str | Path | Folder", under: str | None = None, *, values_only: bool = False) -> dict[str, Any]:
    """Every value of a DCP folder, in the nesting it was saved with, without a template from the caller.

    The template is built from the folder's own metadata (tensor shapes and dtypes, and the flattening
    map DCP records); tensor values are read whole, non-tensor values with ``weights_only=True``. With
    ``under``, only what was saved under that top-level key, returned without it (nothing else is read); with
    ``values_only``, no tensor (only the values saved beside them).
    """
    from .direct import layout

    root = as_folder(folder)
    where = layout(root)
    mapping = where.paths
    template: dict[str, Any] = {}
    for key in where.order:
        path = mapping.get(key, (key,))
        if not isinstance(path, (tuple, list)) or not path or not all(isinstance(p, (str, int)) for p in path):
            raise CheckpointCorruptError(f"{folder}: malformed DCP flattening entry for {key!r}")
        info = where.tensors.get(key)
        if under is not None and path[0] != under or values_only and info is not None:
            continue
        node: Any = template
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise CheckpointCorruptError(f"{folder}: DCP key {key!r} nests inside a value")
        node[path[-1]] = None if info is None else torch.empty(info.shape, dtype=torch_dtype(info.dtype))
    if under is not None and under not in template:
        raise CheckpointCorruptError(f"{root.path}: holds no {under!r} (its keys: {sorted(where.tensors)[:5]}...)")
    load(template, root, no_dist=True)
    return template if under is None else template[under]


class DCPSource:
    """A DCP folder read tensor by tensor; each read is a single-process DCP load of one key."""

    def __init__(self, folder: "Path | Folder") -> None:
        self.root = as_folder(folder)
        self.folder = self.root.path
        self._index = {k: v for k, v in read_index(self.root).items() if v is not None}

    def index(self) -> dict[str, TensorInfo]:
        return dict(self._index)

    def close(self) -> None:
        """Nothing is held open between reads."""

    def read(self, key: str) -> torch.Tensor:
        if key not in self._index:
            raise CheckpointCorruptError(f"{self.folder}: no tensor {key!r} in its DCP metadata")
        info = self._index[key]
        out = {key: torch.empty(info.shape, dtype=torch_dtype(info.dtype))}
        load(out, self.root, no_dist=True)
        return out[key]


class DCPFormat(Format):
    """PyTorch Distributed Checkpoint folders (``.metadata`` plus ``__R_0.distcp`` per rank)."""

    name = "dcp"
    shares_reads = True
    summary = "PyTorch DCP folder"
    priority = 30
    full_model = True
    any_values = True

    def detect(self, path: Path) -> bool:
        return path.is_dir() and (path / METADATA_FILE).is_file()

    def open(self, path: Path) -> Opened:
        return Opened(self.name, DCPSource(path), path)

    def write(self, opened: Opened, source: "TensorSource", out: Path, options: WriteOptions) -> None:
        from ...storage import LocalFolderWriter
        from ..extras import copy_extras

        tensors = {}
        for key in source.index():
            t = source.read(key)
            tensors[key] = t.contiguous()
            if options.progress:
                options.progress(t.numel() * t.element_size())
        writer = LocalFolderWriter.create(out)
        try:
            save(tensors, writer, "")
            if opened.extras is not None:
                copy_extras(opened.extras, writer, "")
            writer.commit()
        except BaseException:
            writer.abort()
            raise

    def index(self, folder: Folder) -> dict[str, TensorInfo | None]:
        return read_index(folder)

    def save_shards(self, state_dict: dict, writer: "FolderWriter", rel: str, ctx: ShardContext) -> dict[str, str]:
        return save(state_dict, writer, rel, thread_count=ctx.threads)

    def load_shards(self, target: dict, folder: Folder, *, strict: bool, ctx: ShardContext) -> None:
        load(target, folder, progress=ctx.progress, skip=ctx.extra.get("skip", frozenset()),
             filled=ctx.extra.get("filled"),
             check=lambda: check_compatible(read_index(folder), target, str(folder.path), strict=strict))

    def save_state(self, state: dict, writer: "FolderWriter", rel: str, ctx: ShardContext) -> dict[str, str]:
        return save(state, writer, rel, thread_count=ctx.threads)

    def state_index(self, folder: Folder) -> dict[str, TensorInfo | None]:
        return read_index(folder)

    def load_state(self, target: dict, folder: Folder, ctx: ShardContext) -> None:
        load(target, folder, progress=ctx.progress, skip=ctx.extra.get("skip", frozenset()),
             filled=ctx.extra.get("filled"))

    def read_state(self, folder: Folder) -> dict:
        return flatten(load_all(folder))

    def state_values(self, folder: Folder) -> dict:
        return flatten(load_all(folder, values_only=True))

    def read_value(self, folder: Folder, key: str) -> Any:
        return load_all(folder, under=key)


register(DCPFormat())

"""Model weights from any format ckptio reads to any it writes, one tensor at a time where the formats allow.

Every format is a :class:`~ckptio.formats.registry.Format` in the registry; this module only chains
them: detect the source's format, open it, apply the dtype cast and naming converter, and have the
target format write it. The formats (``--to`` names) and what travels with each are listed by
``ckptio convert --help`` and described in ``docs/converters.md``.

Streaming: the readers of step directories, HF and safetensors folders read one tensor at a time with
``pread``; torch/nemo/Lightning files are memory-mapped. Writers of hf, safetensors and step_dir stream
tensor by tensor; dcp, torch, nemo and lightning are single pickled/DCP writes that need every tensor at
once (their formats are written in one call).

Call sequence: single process, no collectives.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

from ..errors import CheckpointError, CheckpointNotFoundError
from ..formats import registry
from ..formats.common import TensorInfo, dtype_name, torch_dtype
from ..formats.registry import Opened, WriteOptions
from . import model_config

__all__ = ["FORMATS", "convert", "detect", "open_any", "write"]


DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
"""Short dtype names ``--dtype`` takes besides torch's own."""


def _formats() -> tuple[str, ...]:
    return tuple(registry.names(writable=True))


FORMATS = _formats()
"""The formats ``convert`` writes (every registered format with a writer), in detection order."""


def detect(path: str | Path) -> str:
    """The name of the format of ``path``, from its layout alone."""
    return registry.detect(path).name


def open_any(path: str | Path, kind: str | None = None) -> Opened:
    """Open ``path`` for reading tensors one at a time."""
    path = Path(path)
    fmt = registry.get(kind) if kind is not None else registry.detect(path)
    return fmt.open(path)


class _Cast:
    """A source seen through a dtype cast (floating-point tensors only)."""

    def __init__(self, source: Any, dtype: torch.dtype | None) -> None:
        self.source, self.dtype, self.folder = source, dtype, source.folder

    def out_dtype(self, info: TensorInfo) -> torch.dtype:
        src = torch_dtype(info.dtype)
        return self.dtype if self.dtype is not None and src.is_floating_point else src

    def index(self) -> dict[str, TensorInfo]:
        return {k: TensorInfo(v.shape, dtype_name(self.out_dtype(v))) for k, v in self.source.index().items()}

    def read(self, key: str) -> torch.Tensor:
        t = self.source.read(key)
        want = self.out_dtype(TensorInfo(tuple(t.shape), dtype_name(t.dtype)))
        return t.to(want) if t.dtype != want else t

    def close(self) -> None:
        pass  # the underlying source is closed by whoever opened it


def write(opened: Opened, out: Path, to: str, *, dtype: torch.dtype | None = None, max_shard_size: str = "5GB",
          progress: Callable[[int], None] | None = None, options: dict[str, Any] | None = None) -> None:
    """Write ``opened`` to the new path ``out`` in format ``to`` (appearing whole, or not at all)."""
    fmt = registry.get(to)
    if not fmt.writable:
        raise CheckpointError(f"ckptio cannot write the {to} format; it writes {_formats()}")
    fmt.write(opened, _Cast(opened.source, dtype), Path(out),
              WriteOptions(max_shard_size=max_shard_size, dtype=dtype, progress=progress, extra=options or {}))


def convert(src: str | Path, dst: str | Path, to: str, *, dtype: str | torch.dtype | None = None,
            max_shard_size: str = "5GB", naming: str | None = None,
            progress: Callable[[str, int], Callable[[int], None] | None] | None = None,
            options: dict[str, Any] | None = None, config: str | None = None) -> Path:
    """Convert the model weights at ``src`` into the new path ``dst`` in format ``to``.

    ``naming`` applies a registered naming converter (see :mod:`ckptio.formats.naming`) on the way;
    ``options`` are the target format's own choices (``{"tp": 2, "pp": 2, "layout": "legacy"}`` for megatron).
    ``progress``, once the source is open, is called with its format and total bytes and may return a
    callback that is fed the bytes as they are written. ``config``: the model's ``config.json`` for the output, a
    model folder holding one, or a model's name in the local Hugging Face cache; its side files replace the source's
    (:mod:`ckptio.convert.model_config`). Returns ``dst``.
    """
    from ..storage import url_scheme

    registry.get(to)  # an unknown target fails before anything is read
    if url_scheme(str(src)) is not None or url_scheme(str(dst)) is not None:
        return _convert_remote(str(src), str(dst), to, dtype=dtype, max_shard_size=max_shard_size, naming=naming,
                               progress=progress, options=options, config=config)
    dst = Path(dst)
    if dst.exists():
        raise CheckpointError(f"{dst} already exists; convert into a new path")
    if not dst.parent.is_dir():
        raise CheckpointNotFoundError(f"{dst.parent}: no such folder")
    cast = torch_dtype(DTYPE_ALIASES.get(dtype, dtype)) if isinstance(dtype, str) else dtype
    with model_config.scratch_dir() as scratch:  # a bad --config fails before anything is read
        extras = model_config.config_folder(config, Path(scratch)) if config is not None else None
        _convert_local(src, dst, to, cast, max_shard_size, naming, progress, options, extras)
    return dst


def _convert_local(src: str | Path, dst: Path, to: str, cast: torch.dtype | None, max_shard_size: str,
                   naming: str | None, progress: Any, options: dict[str, Any] | None, extras: Path | None) -> None:
    opened = open_any(src)
    if extras is not None:
        opened.extras = extras
    try:
        update = None
        if progress is not None:
            total = sum(i.numel * torch_dtype(i.dtype).itemsize for i in opened.source.index().values())
            update = progress(opened.kind, total)
        if naming is not None:
            from ..formats.naming import renamed_source

            opened.source = renamed_source(opened.source, naming, opened.extras)
            opened.step_dir = opened.training = None  # optimizer state is keyed by the old names: it cannot follow
        write(opened, dst, to, dtype=cast, max_shard_size=max_shard_size, progress=update, options=options)
    finally:
        opened.close()


def _convert_remote(src: str, dst: str, to: str, **kw: Any) -> Any:
    """``convert`` with an ``s3://`` source or destination: through a private local copy (see
    :mod:`ckptio.storage.transfer`: a source step directory is verified against its manifest first; the
    output is uploaded into a new prefix, its manifest last). Returns ``dst``."""
    import tempfile

    from ..storage import url_scheme
    from ..storage.transfer import copy_down, copy_up, exists

    if url_scheme(dst) is not None and exists(dst):
        raise CheckpointError(f"{dst} already exists; convert into a new location")
    with tempfile.TemporaryDirectory(prefix="ckptio-convert-") as tmp:
        local_src: str | Path = src
        if url_scheme(src) is not None:
            local_src = copy_down(src, Path(tmp) / "src" / src.rstrip("/").rpartition("/")[2])
        local_dst = Path(tmp) / "out" / dst.rstrip("/").rpartition("/")[2] if url_scheme(dst) is not None else Path(dst)
        local_dst.parent.mkdir(parents=True, exist_ok=True)
        out = convert(local_src, local_dst, to, **kw)
        if url_scheme(dst) is not None:
            copy_up(out, dst)
            return dst
        return out

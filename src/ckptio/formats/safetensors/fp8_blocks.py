"""Block-quantized FP8 releases (DeepSeek-V3 style), read as ordinary weights: dequantized on load and convert.

Such a Hugging Face folder says so in its ``config.json``::

    "quantization_config": {"quant_method": "fp8", "weight_block_size": [R, C], ...}

and stores each quantized 2-D weight ``W`` (``[out, in]``) as ``float8_e4m3fn``, with beside it
``<name>_scale_inv``: ``float32`` of shape ``[ceil(out / R), ceil(in / C)]``, one factor per ``R x C`` block of
``W`` (the last block of a dimension that is not a multiple of the block is partial). DeepSeek names the
factor after the inverse of the quantization scale, so it multiplies::

    W[i, j] = float32(W8[i, j]) * scale_inv[i // R, j // C]

computed in ``float32`` (exact: one rounding, the same on every path) and cast afterwards to what the
destination holds. Tensors without a scale (embeddings, norms, often the output head) are stored in their own
dtype and pass through unchanged.

Two readers use this module: :func:`load_files` fills a live model (each rank reads the rows of each weight
it holds and the block rows of the scale covering them, through the one safetensors reader) for
:func:`ckptio.load_pretrained`; :class:`DequantizedSource` gives whole dequantized tensors to ``convert``
and ``inspect``. Before any tensor byte is read, :func:`pair_scales` refuses, naming the file and the
tensor: a quantized weight without a scale, a scale without a quantized weight, a scale that is not
``float32`` or has the wrong shape, a quantized weight that is not 2-D; :func:`read_blocks` refuses a
``weight_block_size`` that is not two positive integers.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from ...errors import CheckpointCorruptError
from ...engine.plan import local_view
from ...storage.parse import as_int, field, read_json
from . import sharded as sts
from ._reader import SafetensorsFile
from ..common import TensorInfo, check_compatible

if TYPE_CHECKING:
    from ...storage.confined import Folder

__all__ = ["SCALE_SUFFIX", "Blocks", "read_blocks", "pair_scales", "refuse_undeclared", "check_scale", "dequantize", "scale_rows", "load_files",
           "DequantizedSource", "plain_config"]

SCALE_SUFFIX = "_scale_inv"
"""What a quantized weight's scale is called: ``<weight name>_scale_inv``."""

CONFIG = "config.json"
_FP8 = ("float8_e4m3fn", "float8_e5m2")
_MAX_CONFIG_BYTES = 16 << 20
_MAX_BLOCK = 1 << 20


@dataclass(frozen=True)
class Blocks:
    """The block of a release: ``rows x cols`` elements of a weight share one scale."""

    rows: int
    cols: int
    where: str
    """The ``config.json`` that says so (named by errors)."""


def read_blocks(folder: "Folder") -> Blocks | None:
    """The FP8 blocks ``folder``'s ``config.json`` declares; ``None`` without such a ``quantization_config``
    (no config, no quantization, or another method, whose weights this module does not touch)."""
    if folder.kind(CONFIG) is None:
        return None
    where = str(folder.display(CONFIG))
    config = read_json(folder, CONFIG, max_size=_MAX_CONFIG_BYTES)
    quant = field(config, "quantization_config", (dict, type(None)), where, default=None)
    if quant is None or field(quant, "quant_method", str, where, default=None) != "fp8":
        return None
    size = field(quant, "weight_block_size", list, f"{where}: quantization_config")
    if len(size) != 2:
        raise CheckpointCorruptError(f"{where}: quantization_config.weight_block_size must be two positive integers "
                                     f"[rows, cols], found {str(size)[:60]}")
    rows, cols = (as_int(v, where, f"quantization_config.weight_block_size[{i}]", lo=1, hi=_MAX_BLOCK)
                  for i, v in enumerate(size))
    return Blocks(rows, cols, where)


def _ceil(n: int, b: int) -> int:
    return -(-n // b)


def pair_scales(blocks: Blocks, infos: dict[str, TensorInfo], file_of: Callable[[str], object]) -> dict[str, str]:
    """Each quantized weight of ``infos`` with its scale's name, checked against each other (headers only);
    ``file_of(key)`` names the file holding ``key`` in errors."""
    pairs: dict[str, str] = {}
    for key, info in infos.items():
        if not key.endswith(SCALE_SUFFIX):
            continue
        weight = key[:-len(SCALE_SUFFIX)]
        w = infos.get(weight)
        if w is None:
            raise CheckpointCorruptError(f"{file_of(key)}: scale {key!r} has no weight {weight!r} beside it")
        if w.dtype not in _FP8:
            raise CheckpointCorruptError(f"{file_of(key)}: scale {key!r} is for {weight!r}, which is {w.dtype}, "
                                         f"not FP8 (in {file_of(weight)})")
        if info.dtype != "float32":
            raise CheckpointCorruptError(f"{file_of(key)}: scale {key!r} is {info.dtype}; block FP8 scales are float32")
        if len(w.shape) != 2:
            raise CheckpointCorruptError(f"{file_of(weight)}: FP8 weight {weight!r} is {list(w.shape)}; block FP8 "
                                         "weights are 2-D")
        want = (_ceil(w.shape[0], blocks.rows), _ceil(w.shape[1], blocks.cols))
        if tuple(info.shape) != want:
            raise CheckpointCorruptError(
                f"{file_of(key)}: scale {key!r} is {list(info.shape)}, but weight {weight!r} {list(w.shape)} in "
                f"blocks of {[blocks.rows, blocks.cols]} ({blocks.where}) needs {list(want)}")
        pairs[weight] = key
    for key, info in infos.items():
        if info.dtype in _FP8 and key not in pairs:
            raise CheckpointCorruptError(f"{file_of(key)}: FP8 weight {key!r} has no scale {key + SCALE_SUFFIX!r}")
    return pairs


def refuse_undeclared(infos: dict[str, TensorInfo], file_of: Callable[[str], object], config: object) -> None:
    """For a folder whose ``config`` declares no block FP8: refuse an FP8 weight stored with a block scale beside it
    (its codes read as values would be off by the scale, ~448 times, without a word); plain FP8 weights pass."""
    for key in infos:
        weight = key[:-len(SCALE_SUFFIX)] if key.endswith(SCALE_SUFFIX) else None
        if weight is not None and weight in infos and infos[weight].dtype in _FP8:
            raise CheckpointCorruptError(
                f"{file_of(weight)}: FP8 weight {weight!r} is stored with a block scale {key!r} beside it, but {config} "
                "declares no block FP8 quantization; read as it is, every value would be off by its scale. Put the "
                "release's \"quantization_config\": {\"quant_method\": \"fp8\", \"weight_block_size\": [R, C]} back "
                "into config.json")


def check_scale(scale: torch.Tensor, key: str, where: object, first: tuple[int, int] = (0, 0)) -> None:
    """Refuse a block scale (or the box of one starting at block ``first``) holding NaN or infinity, naming the
    tensor and the block: every value of that block would come out NaN or infinite."""
    bad = ~torch.isfinite(scale)
    if bool(bad.any()):
        i, j = (int(v) for v in bad.nonzero()[0])
        value = float(scale[i, j])
        raise CheckpointCorruptError(f"{where}: block scale {key!r} holds {value} at block [{first[0] + i}, "
                                     f"{first[1] + j}]; the weight's values there would be {value}")


def dequantized_index(infos: dict[str, TensorInfo], pairs: dict[str, str]) -> dict[str, TensorInfo]:
    """What the folder holds once dequantized: no scales, the quantized weights in ``float32``."""
    scales = set(pairs.values())
    return {k: TensorInfo(v.shape, "float32") if k in pairs else v for k, v in infos.items() if k not in scales}


def scale_rows(blocks: Blocks, lo: tuple[int, int], hi: tuple[int, int]) -> tuple[list[int], list[int]]:
    """The box of the scale whose blocks cover the box ``[lo, hi)`` of the weight."""
    return [lo[0] // blocks.rows, lo[1] // blocks.cols], [_ceil(hi[0], blocks.rows), _ceil(hi[1], blocks.cols)]


def dequantize(q: torch.Tensor, scale: torch.Tensor, blocks: Blocks, lo: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """``float32(q) * scale`` broadcast over each block, as a new ``float32`` tensor.

    ``q`` is the box of the weight starting at ``lo``; ``scale`` the box of the scale :func:`scale_rows` gives
    for it (the whole scale for a whole weight). One row of blocks at a time: no memory beyond the result
    and one row of the scale widened to the box's columns.
    """
    out = q.to(torch.float32)
    first = lo[1] % blocks.cols  # where q's columns start inside their first block
    start = 0
    for i in range(scale.shape[0]):
        end = min(out.shape[0], (i + 1) * blocks.rows - lo[0] % blocks.rows)
        out[start:end].mul_(scale[i].repeat_interleave(blocks.cols)[first:first + out.shape[1]])
        start = end
    return out


def load_files(target: dict[str, torch.Tensor], folder: "Folder", files: list[str], blocks: Blocks, *,
               strict: bool = True) -> None:
    """:func:`ckptio.formats.safetensors.sharded.load_files` for a block FP8 release: the quantized weights are
    dequantized into ``target`` (local shards of DTensors, or whole tensors), each rank reading the rows of
    the weight it holds and the block rows of the scale that cover them; the other tensors load as usual."""
    chunks, infos = sts._scan(folder, files)
    files_of = {k: [c.file for c in chunks[k]] for k in infos}
    pairs = pair_scales(blocks, infos, lambda k: folder.display(files_of[k][0]))
    check_compatible(dequantized_index(infos, pairs), target, str(folder.path), strict=strict)
    sts._fill(target, [k for k in target if k not in pairs], chunks, infos, folder)
    with ExitStack() as stack:
        opened: dict[str, SafetensorsFile] = {}

        def read_box(key: str, lo: list[int], hi: list[int]) -> torch.Tensor:
            rel = _whole(key, files_of[key], chunks[key], infos[key], folder)
            if rel not in opened:
                opened[rel] = stack.enter_context(SafetensorsFile(folder, rel))
            return opened[rel].read_box(key, lo, hi)

        for key in (k for k in target if k in pairs):
            view = local_view(target[key])
            local = view.local
            if local.numel() == 0:
                continue
            lo = (view.offsets[0], view.offsets[1])
            hi = (lo[0] + local.shape[0], lo[1] + local.shape[1])
            q = read_box(key, list(lo), list(hi))
            box = scale_rows(blocks, lo, hi)
            scale = read_box(pairs[key], *box)
            check_scale(scale, pairs[key], folder.display(files_of[pairs[key]][0]), (box[0][0], box[0][1]))
            with torch.no_grad():
                local.copy_(dequantize(q, scale, blocks, lo))


def _whole(key: str, names: list[str], pieces: Any, info: TensorInfo, folder: "Folder") -> str:
    """The one file holding all of ``key`` (a release stores each weight and scale whole)."""
    parts = list(pieces)
    if len(parts) != 1 or tuple(parts[0].shape) != tuple(info.shape):
        raise CheckpointCorruptError(f"{folder.display(names[0])}: {key!r} of a block FP8 release is stored in "
                                     f"{len(parts)} pieces; it is read whole")
    return names[0]


class DequantizedSource:
    """A Hugging Face folder's tensors (a :class:`~ckptio.formats.safetensors.sharded.SafetensorsSource`)
    seen dequantized: no scales, each quantized weight whole in ``float32``."""

    def __init__(self, source: "sts.SafetensorsSource", blocks: Blocks) -> None:
        self.source, self.blocks, self.folder = source, blocks, source.folder
        infos = source.index()
        self.pairs = pair_scales(blocks, infos, lambda k: source.root.display(source.file_of(k)))
        self._index = dequantized_index(infos, self.pairs)

    def index(self) -> dict[str, TensorInfo]:
        return dict(self._index)

    def read(self, key: str) -> torch.Tensor:
        """The tensor ``key``: a quantized weight dequantized whole, any other as stored."""
        if key not in self.pairs:
            return self.source.read(key)
        scale = self.source.read(self.pairs[key])
        check_scale(scale, self.pairs[key], self.source.root.display(self.source.file_of(self.pairs[key])))
        return dequantize(self.source.read(key), scale, self.blocks)

    def close(self) -> None:
        self.source.close()


def plain_config(config: dict[str, Any]) -> dict[str, Any]:
    """A ``config.json``'s content for the dequantized weights: without its FP8 ``quantization_config``
    (another method's is kept: those weights are copied as they are)."""
    quant = config.get("quantization_config")
    if isinstance(quant, dict) and quant.get("quant_method") == "fp8":
        config = {k: v for k, v in config.items() if k != "quantization_config"}
    return config

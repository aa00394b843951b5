"""Types shared by the format modules."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from ..errors import CheckpointCorruptError


@dataclass(frozen=True)
class TensorInfo:
    """What a checkpoint says about one saved tensor, before any of it is read."""

    shape: tuple[int, ...]
    dtype: str
    """The dtype's short name as ``torch`` spells it (``float32``, ``bfloat16``...)."""

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def dtype_name(dtype) -> str:
    """A torch dtype's short name as checkpoints record it (``torch.bfloat16`` -> ``bfloat16``)."""
    return str(dtype).removeprefix("torch.")


def dtype_itemsize(name: str) -> int:
    """Bytes per element of a dtype named as :func:`dtype_name` writes it; 0 for a name torch does not know."""
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        return 0
    return dtype.itemsize


def full_tensors(state_dict: dict[str, Any]) -> dict[str, Any]:
    """Collective when any value is a DTensor: the whole tensor of every entry, on CPU."""
    from torch.distributed.tensor import DTensor

    out = {}
    for key, value in state_dict.items():
        if isinstance(value, DTensor):
            value = value.full_tensor()
        out[key] = value.detach().to("cpu").contiguous()
    return out


def check_exact_cover(key: str, shape: tuple[int, ...], boxes: list[tuple[tuple[int, ...], tuple[int, ...], str]],
                      where: object) -> int:
    """Refuse, naming ``key`` and the files, a set of stored chunks that does not cover ``shape`` exactly once.

    ``boxes``: ``(offsets, sizes, source)`` of every stored chunk of the tensor, ``source`` naming the
    file (or rank) it comes from. Each chunk must lie inside ``shape``, no two may share an element, and
    together they must hold every element; otherwise some elements would be loaded from a stale or
    foreign chunk, or left as uninitialised memory. Cost: a sort and a sweep along the dimension the chunks
    are split along most (:func:`ckptio.formats.cover.find_overlap`), so a tensor split over many ranks along
    any one dimension, or in a grid along two, is checked in ``O(n log n)``. Returns the number of pairwise
    tests the sweep made (what bounds its work).
    """
    from .cover import find_overlap

    total = 1
    for d in shape:
        total *= d
    covered = 0
    live = []
    for offsets, sizes, source in boxes:
        if len(offsets) != len(shape) or len(sizes) != len(shape) or any(
                o < 0 or n < 0 or o + n > g for o, n, g in zip(offsets, sizes, shape)):
            raise CheckpointCorruptError(f"{where}: a chunk of {key!r} in {source} at offsets {list(offsets)} with "
                                         f"sizes {list(sizes)} does not fit the tensor's shape {list(shape)}")
        n = 1
        for s in sizes:
            n *= s
        if n:
            covered += n
            live.append((tuple(offsets), tuple(sizes), source))
    if len(shape) == 0 and len(live) > 1:
        raise CheckpointCorruptError(f"{where}: the scalar {key!r} is stored {len(live)} times "
                                     f"({', '.join(str(b[2]) for b in live[:3])})")
    pair, tests = find_overlap([b[0] for b in live], [b[1] for b in live], shape)
    if pair is not None:
        other, box = live[pair[0]], live[pair[1]]
        raise CheckpointCorruptError(
            f"{where}: chunks of {key!r} overlap: {other[2]} (offsets {list(other[0])}, sizes {list(other[1])}) "
            f"and {box[2]} (offsets {list(box[0])}, sizes {list(box[1])}) both hold some of its elements; "
            "one of them is stale or belongs to another save"
        )
    if covered != total:
        raise CheckpointCorruptError(
            f"{where}: the chunks of {key!r} cover {covered} of its {total} elements "
            "(a shard file is missing or belongs to another save)"
        )
    return tests


def read_json(path: "str | Path", *, max_size: int = 64 << 20) -> dict[str, Any]:
    """A JSON object from a small file (a config, an index), read through the confined folder of its parent."""
    from ..storage.confined import Folder
    from ..storage.parse import read_json as read

    path = Path(path)
    return read(Folder(path.parent), path.name, max_size=max_size)


@dataclass
class TensorSummary:
    """Counts and bytes of a checkpoint's tensors, per dtype (what ``inspect`` prints)."""

    tensors: int = 0
    bytes: int = 0
    elements: int = 0
    """Total number of elements: the parameter count when the tensors are a model's weights."""
    dtypes: dict[str, dict[str, int]] = field(default_factory=dict)

    def add(self, info: TensorInfo) -> None:
        size = info.numel * dtype_itemsize(info.dtype)
        self.tensors += 1
        self.bytes += size
        self.elements += info.numel
        d = self.dtypes.setdefault(info.dtype, {"tensors": 0, "bytes": 0})
        d["tensors"] += 1
        d["bytes"] += size


def summarize_index(index: Mapping[str, TensorInfo | None]) -> TensorSummary:
    """Tensor count, element count, bytes and dtypes of a whole tensor index."""
    summary = TensorSummary()
    for info in index.values():
        if info is not None:
            summary.add(info)
    return summary


def natural_key(key: str) -> list:
    """Sort key that orders ``layers.2`` before ``layers.10``."""
    import re

    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", key)]


def torch_dtype(name: str) -> Any:
    """``torch.bfloat16`` from ``"bfloat16"`` (or ``"torch.bfloat16"``); an error naming it otherwise."""
    import torch

    from ..errors import ConfigError

    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"unknown dtype {name!r}; use e.g. bfloat16, float16 or float32")
    return dtype


def check_compatible(saved: Mapping[str, TensorInfo | None], target: dict[str, Any], where: str, *, strict: bool) -> None:
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
        from ..errors import CheckpointMismatchError

        raise CheckpointMismatchError(
            f"{where} does not match the model: " + " | ".join(problems)
            + " (is this a checkpoint of a different model or config?)"
        )


def flatten(state: dict, prefix: str = "") -> dict:
    """A nested dict of a state as one level with dotted keys (``{"optim": {"state.w.exp_avg": t}}`` ->
    ``{"optim.state.w.exp_avg": t}``)."""
    out: dict = {}
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def set_dotted(state: dict, key: str, value: object) -> None:
    """Set the entry of a nested dict that :func:`flatten` named ``key`` (descending only into dicts)."""
    node = state
    start = 0
    while True:
        i = key.find(".", start)
        if i < 0:
            node[key] = value
            return
        head = key[:i]
        if isinstance(node.get(head), dict):
            node, key, start = node[head], key[i + 1:], 0
        else:
            start = i + 1


def parse_size(value: str | int) -> int:
    """``"5GB"`` -> 5_000_000_000 (decimal units, as Hugging Face counts), ``"2GiB"`` -> 2**31, ints as is."""
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(I?)B?\s*", str(value).upper())
        if not m:
            raise _config_error(f"max shard size {value!r} is not a size such as '5GB', '500MB' or '2GiB'")
        base = 1024 if m.group(3) else 1000
        size = int(float(m.group(1)) * base ** " KMGT".index(m.group(2) or " "))
    if size < 1:
        raise _config_error(f"max shard size must be positive, got {value!r}")
    return size


def _config_error(message: str) -> Exception:
    from ..errors import ConfigError

    return ConfigError(message)

"""Describe checkpoints without loading their tensors: what ``ckptio inspect`` and ``list`` print."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .errors import CheckpointError, CheckpointNotFoundError
from .formats import dcp as dcp_format
from .formats import safetensors_sharded
from .formats.common import TensorInfo, dtype_itemsize
from .layout import BEST, LATEST, pointer_target, scan
from .manifest import MANIFEST_NAME, read_manifest
from .storage.confined import Folder


@dataclass
class TensorSummary:
    tensors: int = 0
    bytes: int = 0
    dtypes: dict[str, dict[str, int]] = field(default_factory=dict)

    def add(self, info: TensorInfo) -> None:
        size = info.numel * dtype_itemsize(info.dtype)
        self.tensors += 1
        self.bytes += size
        d = self.dtypes.setdefault(info.dtype, {"tensors": 0, "bytes": 0})
        d["tensors"] += 1
        d["bytes"] += size


def summarize_index(index: dict[str, TensorInfo | None]) -> TensorSummary:
    summary = TensorSummary()
    for info in index.values():
        if info is not None:
            summary.add(info)
    return summary


def detect_format(path: Path) -> str:
    """``step_dir``, ``dcp``, ``safetensors`` (a folder of them) or ``safetensors_file``."""
    if path.is_file():
        if path.suffix == ".safetensors":
            return "safetensors_file"
        if path.suffix == ".nemo":
            return "nemo"
        raise CheckpointError(f"{path}: not a format ckptio can inspect (expected a .safetensors or .nemo file, "
                              "or a folder)")
    if not path.is_dir():
        raise CheckpointNotFoundError(f"{path}: no such file or directory")
    if (path / MANIFEST_NAME).is_file():
        return "step_dir"
    if (path / "model_config.yaml").is_file():
        return "nemo"
    if (path / dcp_format.METADATA_FILE).is_file():
        return "dcp"
    if any(path.glob("*.safetensors")):
        return "safetensors"
    if any(p.is_dir() and (p / MANIFEST_NAME).is_file() for p in path.iterdir()):
        raise CheckpointError(f"{path} is a checkpoint folder holding several checkpoints; use 'ckptio list {path}'")
    raise CheckpointError(f"{path}: no manifest, DCP metadata or safetensors files found")


def _index_of(folder: "Path | Folder", fmt: str) -> dict[str, TensorInfo | None]:
    if fmt == "dcp":
        return dcp_format.read_index(folder)
    return dict(safetensors_sharded.read_index(folder))


def inspect_path(path: str | Path) -> dict[str, Any]:
    """A JSON-ready description of a step directory, DCP folder or safetensors file/folder."""
    path = Path(path)
    kind = detect_format(path)
    if kind == "nemo":
        from .formats import nemo

        return nemo.describe(path)
    out: dict[str, Any] = {"path": str(path), "kind": kind}
    if kind == "step_dir":
        m = read_manifest(path)
        out.update(name=m.name, step=m.step, epoch=m.epoch, metrics=m.metrics, counters=m.counters,
                   world_size=m.world_size, model_save_format=m.model_save_format, is_peft=m.is_peft,
                   created=m.created, versions=m.versions, total_bytes=m.total_bytes,
                   files={k: v for k, v in sorted(m.files.items())})
        states = {}
        for name, entry in m.states.items():
            info: dict[str, Any] = {"kind": entry.kind, "format": entry.format, "path": entry.path,
                                    "per_rank": entry.per_rank}
            if entry.format in ("dcp", "safetensors"):
                info["tensors"] = asdict(summarize_index(_index_of(Folder(path).sub(entry.path), entry.format)))
            states[name] = info
        out["states"] = states
    elif kind == "safetensors_file":
        index = safetensors_sharded.read_index_file(path)
        out["tensors"] = asdict(summarize_index(index))
        out["files"] = {path.name: path.stat().st_size}
    else:
        fmt = "dcp" if kind == "dcp" else "safetensors"
        out["tensors"] = asdict(summarize_index(_index_of(path, fmt)))
        out["files"] = {e.name: e.size for e in Folder(path).listdir() if e.kind == "file"}
        out["total_bytes"] = sum(out["files"].values())
    return out


def list_checkpoints(checkpoint_dir: str | Path) -> dict[str, Any]:
    """Every directory of a checkpoint folder with its state, newest committed step last."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        raise CheckpointNotFoundError(f"{root}: no such checkpoint folder")
    problems: list[str] = []

    def pointer(name: str) -> str | None:
        try:
            target = pointer_target(root, name)
        except CheckpointError as exc:  # reported, and the listing goes on
            problems.append(str(exc))
            return None
        return None if target is None else target.name

    latest = pointer(LATEST)
    best = pointer(BEST)
    entries = scan(root)
    newest = max((e for e in entries if e.committed), key=lambda e: e.step or 0, default=None)
    rows = []
    for e in entries:
        m = e.manifest
        rows.append({
            "name": e.name,
            "step": m.step if m else None,
            "epoch": m.epoch if m else None,
            "metrics": m.metrics if m else {},
            "bytes": m.total_bytes if m else _du(e.path),
            "committed": e.committed,
            "problem": e.problem,
            "latest": e.name == latest,
            "best": e.name == best,
            # never removed by retention: the newest committed checkpoint and the best one
            "protected": e.committed and (e.name == best or (newest is not None and e.name == newest.name)),
        })
    return {"checkpoint_dir": str(root), "latest": latest, "best": best, "checkpoints": rows, "problems": problems}


def _du(path: Path) -> int:
    try:
        return sum(e.size for _, e in Folder(path).walk_files() if e.kind == "file")
    except CheckpointError:
        return 0

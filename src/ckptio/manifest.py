"""The manifest: a JSON file written last into every step directory.

Its presence marks a committed checkpoint; its content says what is inside (states and their
formats, every file with its size), the training position (step, epoch, metrics, counters) and how
it was made (world size, library versions). It is the source of truth for discovery, ``inspect``
and ``list``.
"""

from __future__ import annotations

import datetime as _dt
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .errors import CheckpointCorruptError, CheckpointNotFoundError

MANIFEST_NAME = "manifest.json"
MANIFEST_VERSION = 1
_MAX_MANIFEST_BYTES = 64 * 1024 * 1024


@dataclass
class StateEntry:
    """One saved state inside a step directory."""

    kind: str
    """``model``, ``optimizer`` or ``object`` (a small ``state_dict`` saved as ``.pt``)."""
    format: str
    """``safetensors``, ``dcp`` or ``pt``."""
    path: str
    """File or folder, relative to the step directory."""
    per_rank: bool = False
    """``.pt`` states only: one file per rank under ``path/`` instead of one shared file."""


@dataclass
class Manifest:
    name: str
    step: int
    epoch: int
    world_size: int
    model_save_format: str
    states: dict[str, StateEntry]
    files: dict[str, int]
    """Relative path -> size in bytes of every file in the step directory except the manifest."""
    metrics: dict[str, float] = field(default_factory=dict)
    counters: dict[str, Any] = field(default_factory=dict)
    is_peft: bool = False
    model_signature: dict[str, Any] = field(default_factory=dict)
    """``{"architecture": …, "shapes": {key: global shape}}`` of the saved model, checked before loading."""
    checksums: dict[str, str] = field(default_factory=dict)
    """Relative path -> ``crc32c:xxxxxxxx``, computed while each file was written."""
    versions: dict[str, str] = field(default_factory=dict)
    created: str = field(default_factory=lambda: _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
    manifest_version: int = MANIFEST_VERSION

    def to_json(self) -> str:
        data = asdict(self)
        return json.dumps(data, indent=2, sort_keys=True) + "\n"

    @property
    def total_bytes(self) -> int:
        return sum(self.files.values())

    @classmethod
    def from_json(cls, text: str, source: Path) -> "Manifest":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise CheckpointCorruptError(f"{source}: manifest is not valid JSON ({exc})") from exc
        if not isinstance(data, dict):
            raise CheckpointCorruptError(f"{source}: manifest must be a JSON object")
        version = data.get("manifest_version")
        if version != MANIFEST_VERSION:
            raise CheckpointCorruptError(
                f"{source}: manifest_version {version!r} is not supported by this ckptio (expects {MANIFEST_VERSION})"
            )
        try:
            states = {
                str(k): StateEntry(**{f: v[f] for f in ("kind", "format", "path", "per_rank") if f in v})
                for k, v in data["states"].items()
            }
            manifest = cls(
                name=str(data["name"]),
                step=int(data["step"]),
                epoch=int(data["epoch"]),
                world_size=int(data["world_size"]),
                model_save_format=str(data["model_save_format"]),
                states=states,
                files={str(k): int(v) for k, v in data["files"].items()},
                metrics={str(k): float(v) for k, v in data.get("metrics", {}).items()},
                counters=dict(data.get("counters", {})),
                is_peft=bool(data.get("is_peft", False)),
                model_signature=dict(data.get("model_signature", {})),
                checksums={str(k): str(v) for k, v in data.get("checksums", {}).items()},
                versions={str(k): str(v) for k, v in data.get("versions", {}).items()},
                created=str(data.get("created", "")),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CheckpointCorruptError(f"{source}: manifest is missing or has a malformed field ({exc!r})") from exc
        for rel in list(manifest.files) + [s.path for s in states.values()]:
            if rel.startswith("/") or ".." in Path(rel).parts:
                raise CheckpointCorruptError(f"{source}: manifest names a path outside the checkpoint: {rel!r}")
        return manifest


def read_manifest(step_dir: Path) -> Manifest:
    """Read and validate ``step_dir``'s manifest; raise a clear error naming the file otherwise."""
    path = Path(step_dir) / MANIFEST_NAME
    if not path.is_file():
        raise CheckpointNotFoundError(
            f"{step_dir} is not a committed ckptio checkpoint: {MANIFEST_NAME} is missing "
            "(an interrupted save, or a folder written by another tool)"
        )
    if path.stat().st_size > _MAX_MANIFEST_BYTES:
        raise CheckpointCorruptError(f"{path}: manifest is implausibly large ({path.stat().st_size} bytes)")
    return Manifest.from_json(path.read_text(encoding="utf-8", errors="replace"), path)


def check_files(step_dir: Path, manifest: Manifest, *, checksums: bool = False) -> list[str]:
    """Problems with the files a manifest lists, one line each naming the file.

    Always: missing files and sizes that differ. With ``checksums``: every byte, against the checksum
    recorded when the file was written.
    """
    problems = []
    for rel, size in sorted(manifest.files.items()):
        path = step_dir / rel
        if not path.is_file():
            problems.append(f"{path}: missing")
        else:
            actual = path.stat().st_size
            if actual != size:
                problems.append(f"{path}: size {actual} bytes, manifest says {size}")
            elif checksums and rel in manifest.checksums:
                from .storage.checksum import file_checksum

                got = file_checksum(path)
                if got != manifest.checksums[rel]:
                    problems.append(f"{path}: checksum {got}, manifest says {manifest.checksums[rel]} (corrupted)")
            elif checksums:
                problems.append(f"{path}: no checksum recorded in the manifest")
    return problems


# ---------------------------------------------------------------------------------------- building one
def model_signature(model: Any, state_dict: dict[str, Any]) -> dict[str, Any]:
    """``{"architecture": …, "shapes": {key: shape}}`` of a model, checked before its weights are loaded."""
    config = getattr(model, "config", None)
    architecture = None
    if config is not None and getattr(config, "architectures", None):
        architecture = ",".join(config.architectures)
    elif model is not None:
        architecture = type(model).__name__.removeprefix("FSDP")
    return {"architecture": architecture, "shapes": {k: list(v.shape) for k, v in state_dict.items()}}


def list_files(root: Path) -> dict[str, int]:
    """Relative path -> size of every file under ``root`` except the manifest (the manifest's ``files``)."""
    return {
        p.relative_to(root).as_posix(): p.stat().st_size
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != MANIFEST_NAME
    }


def software_versions() -> dict[str, str]:
    """Versions of ckptio, torch and safetensors (and transformers when already imported)."""
    import sys

    import safetensors
    import torch

    from . import __version__

    versions = {"ckptio": __version__, "torch": torch.__version__, "safetensors": safetensors.__version__}
    transformers = sys.modules.get("transformers")  # recorded only when in use: importing it costs seconds
    if transformers is not None:
        versions["transformers"] = getattr(transformers, "__version__", "unknown")
    return versions

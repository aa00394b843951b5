"""The manifest: a JSON file written last into every step directory.

Its presence marks a committed checkpoint; its content says what is inside (states and their
formats, every file with its size and checksum), the training position (step, epoch, metrics,
counters) and how it was made (world size, library versions). It is the source of truth for
discovery, ``inspect`` and ``list``.

The manifest protects itself: ``manifest_checksum`` is the CRC-32C of its own canonical content (every
other field, as compact JSON with sorted keys), so a flipped bit anywhere in a value is detected before
anything in it is trusted. Every field is type-checked on reading; a malformed manifest is a
:class:`~ckptio.CheckpointCorruptError` that names the file and the field.
"""

from __future__ import annotations

import datetime as _dt
import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from ..errors import CheckpointCorruptError, CheckpointNotFoundError
from ..storage.parse import json_object
from ..storage.checksum import bytes_checksum
from ..storage.confined import Folder, UnsafePathError, as_folder, check_relative
from ..storage.verify import Verifier

MANIFEST_NAME = "manifest.json"
PENDING_NAME = ".ckptio-pending"
"""An object store has no rename: a step there is written in place, and this empty object, written before anything
else and removed after the manifest, says that ckptio is (or was, if the save died) writing it. A folder without a
manifest and without it is someone else's (a NeMo AutoModel step): never swept."""
MANIFEST_VERSION = 2
"""2: carries ``manifest_checksum``. Version 1 manifests (no self-checksum) are still read."""
_READABLE_VERSIONS = (1, 2)
MAX_MANIFEST_BYTES = 64 * 1024 * 1024
STATE_KINDS = ("model", "optimizer", "object")
_DIGEST = re.compile(r"crc32c:[0-9a-f]{8}")
_CONTENT = re.compile(r"sha256:[0-9a-f]{64}")


@dataclass
class StateEntry:
    """One saved state inside a step directory."""

    kind: str
    """``model``, ``optimizer`` or ``object`` (a small ``state_dict`` saved as ``.pt``)."""
    format: str
    """``safetensors``, ``dcp``, ``peft`` or ``pt``."""
    path: str
    """File or folder, relative to the step directory."""
    per_rank: bool = False
    """``.pt`` states only: one file per rank under ``path/`` instead of one shared file."""
    rank_file: str | None = None
    """Per-rank states: the name of rank ``r``'s file, ``{rank}`` standing for ``r`` (AutoModel's
    ``rng_global_rank_{rank}.pt``); ``None``: ``rank_{rank:05d}.pt``, the names of earlier ckptio versions."""
    identical: bool = False
    """Per-rank states: every rank saved the same bytes (a rank beyond the saved count takes rank 0's file)."""
    key: str | None = None
    """A value stored inside another state's folder rather than a file of its own (NeMo AutoModel keeps the LR
    scheduler as ``sched`` in the optimizer's DCP folder): the top-level key there."""

    def file_of(self, rank: int) -> str:
        """The file (relative to the step directory) holding ``rank``'s copy of a per-rank state."""
        return f"{self.path}/{(self.rank_file or 'rank_{rank:05d}.pt').format(rank=rank)}"


@dataclass
class Manifest:
    """A step directory's ``manifest.json``: what the step holds (states, files, sizes, checksums) and its step,
    epoch and metrics; written last, it commits the step."""
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
    pruned: dict[str, str] = field(default_factory=dict)
    """State name -> why it was removed after the save (``keep_optimizer_latest``): see
    :mod:`ckptio.engine.prune_optim`. Written only when not empty."""
    pruned_paths: dict[str, str] = field(default_factory=dict)
    """State name -> the folder it was in (relative, checked as every path of a manifest)."""
    pruned_groups: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    """Pruned optimizer state name -> its parameter groups, kept when its moments were removed: a list of
    ``{"params": [parameter names], "hyper": {"lr": …, "initial_lr": …, "betas": […], …}}`` (what a resume from the
    step restores, the moments starting from zero). Absent in steps pruned by earlier versions."""
    contents: dict[str, str] = field(default_factory=dict)
    """Shareable files (frozen tensors) -> ``sha256:<hex>`` of their bytes: what the next save compares its own
    against (:mod:`ckptio.engine.sharing`). Written only when not empty."""
    shared: dict[str, str] = field(default_factory=dict)
    """Files whose bytes live in another step's object (a bucket): relative path -> ``<step>/<path>``, resolved
    by every reader of the step. Written only when not empty."""
    created: str = field(default_factory=lambda: _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
    manifest_version: int = MANIFEST_VERSION

    foreign: ClassVar[str | None] = None
    """The tool that wrote a step directory described by a manifest ckptio made up for it (``"automodel"``: no
    sizes or checksums to verify, never deleted by retention); ``None`` for a manifest read from disk."""

    def to_json(self) -> str:
        data = json.loads(json.dumps(asdict(self), allow_nan=True))  # the values exactly as a reader parses them
        for empty in ("pruned", "pruned_paths", "pruned_groups", "contents", "shared"):  # a manifest nothing was pruned from is what it always was
            if not data[empty]:
                del data[empty]
        data["manifest_version"] = MANIFEST_VERSION
        data["manifest_checksum"] = _self_checksum(data)
        return json.dumps(data, indent=2, sort_keys=True) + "\n"

    @property
    def total_bytes(self) -> int:
        return sum(self.files.values())

    def ownership(self, folder: Any, referenced: "set[str] | frozenset[str]" = frozenset()) -> tuple[int, int]:
        """(bytes this step owns, bytes it shares): a file it refers to in another step (``shared``), one another
        step refers to (``referenced``: its paths) and, locally, one with other hard links (``folder.lstat``) is
        shared; deleting the step frees only what it owns."""
        lstat = getattr(folder, "lstat", None)
        shared = 0
        for rel, size in self.files.items():
            info = lstat(rel) if lstat is not None and rel in self.contents else None
            if rel in self.shared or rel in referenced or (info is not None and info.st_nlink > 1):
                shared += size
        return self.total_bytes - shared, shared

    @classmethod
    def from_json(cls, text: str | bytes, source: Path) -> "Manifest":
        data = json_object(text, source, "manifest ")
        version = data.get("manifest_version")
        if type(version) is not int or version not in _READABLE_VERSIONS:
            raise CheckpointCorruptError(
                f"{source}: manifest_version {version!r} is not supported by this ckptio (reads {list(_READABLE_VERSIONS)})"
            )
        if version >= 2:
            recorded = data.pop("manifest_checksum", None)
            if not isinstance(recorded, str):
                raise CheckpointCorruptError(f"{source}: manifest has no manifest_checksum (required since version 2)")
            actual = _self_checksum(data)
            if actual != recorded:
                raise CheckpointCorruptError(
                    f"{source}: the manifest's own checksum is {actual}, it records {recorded}: the manifest is "
                    "corrupted (or was edited by hand)"
                )
        return _parse(data, source)


_RANK_FILE = re.compile(r"[\w.-]*\{rank(?::0?\d*d)?\}[\w.-]*")


def _self_checksum(data: dict[str, Any]) -> str:
    body = {k: v for k, v in data.items() if k != "manifest_checksum"}
    return bytes_checksum(json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=True).encode())


# ---------------------------------------------------------------------------------------- validation
class _Fields:
    """Typed access to a JSON object's fields; a wrong type raises an error naming the field."""

    def __init__(self, data: dict[str, Any], source: Path, where: str = "") -> None:
        self.data, self.source, self.where = data, source, where

    def fail(self, key: str, what: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(f"{self.source}: manifest field {self.where}{key!r} {what}")

    def get(self, key: str, kinds: type | tuple[type, ...], *, default: Any = ..., check: Any = None,
            what: str = "") -> Any:
        if key not in self.data:
            if default is ...:
                raise self.fail(key, "is missing")
            return default
        value = self.data[key]
        kinds = kinds if isinstance(kinds, tuple) else (kinds,)
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            raise self.fail(key, f"must be {what or ' or '.join(k.__name__ for k in kinds)}, not {value!r:.80}")
        if check is not None and not check(value):
            raise self.fail(key, f"must be {what}, not {value!r:.80}")
        return value

    def mapping(self, key: str, value_kinds: tuple[type, ...], *, what: str, check=None,
                required: bool = False) -> dict[str, Any]:
        raw = self.get(key, dict) if required else self.get(key, dict, default={})
        for k, v in raw.items():
            if not isinstance(v, value_kinds) or (isinstance(v, bool) and bool not in value_kinds) \
                    or (check is not None and not check(v)):
                raise self.fail(key, f"has an entry {k!r} whose value is not {what}: {v!r:.80}")
        return raw


def _overlap(a: str, b: str) -> bool:
    a, b = a.strip("/"), b.strip("/")
    return a == b or a.startswith(b + "/") or b.startswith(a + "/")


def _is_shape(value: Any) -> bool:
    return isinstance(value, list) and all(type(d) is int and d >= 0 for d in value)


def _parse(data: dict[str, Any], source: Path) -> Manifest:
    f = _Fields(data, source)
    name = f.get("name", str, check=lambda s: bool(s) and "/" not in s and "\\" not in s and s not in (".", ".."),
                 what="a directory name")
    non_negative: dict[str, Any] = dict(check=lambda v: v >= 0, what="a non-negative integer")
    states: dict[str, StateEntry] = {}
    for key, raw in f.get("states", dict).items():
        if not isinstance(raw, dict):
            raise f.fail("states", f"has an entry {key!r} that is not an object")
        s = _Fields(raw, source, f"states.{key}.")
        kind = s.get("kind", str, check=lambda v: v in STATE_KINDS, what=f"one of {list(STATE_KINDS)}")
        states[key] = StateEntry(kind=kind, format=s.get("format", str), path=s.get("path", str),
                                 per_rank=s.get("per_rank", bool, default=False),
                                 rank_file=s.get("rank_file", (str, type(None)), default=None,
                                                 check=lambda v: v is None or bool(_RANK_FILE.fullmatch(v)),
                                                 what="a file name with one {rank} field"),
                                 identical=s.get("identical", bool, default=False),
                                 key=s.get("key", (str, type(None)), default=None))
    files = f.mapping("files", (int,), what="a size in bytes", check=lambda v: v >= 0, required=True)
    checksums = f.mapping("checksums", (str,), what="a crc32c digest", check=lambda v: bool(_DIGEST.fullmatch(v)))
    signature = f.get("model_signature", dict, default={})
    sig = _Fields(signature, source, "model_signature.")
    sig.get("architecture", (str, type(None)), default=None)
    shapes = sig.get("shapes", dict, default={})
    for key, shape in shapes.items():
        if not _is_shape(shape):
            raise sig.fail("shapes", f"has an entry {key!r} that is not a list of non-negative integers: {shape!r:.80}")
    metrics = f.mapping("metrics", (int, float), what="a number")
    manifest = Manifest(
        name=name,
        step=f.get("step", int, **non_negative),
        epoch=f.get("epoch", int, **non_negative),
        world_size=f.get("world_size", int, check=lambda v: v >= 1, what="a positive integer"),
        model_save_format=f.get("model_save_format", str),
        states=states,
        files=dict(files),
        metrics={k: float(v) for k, v in metrics.items()},
        counters=dict(f.get("counters", dict, default={})),
        is_peft=f.get("is_peft", bool, default=False),
        model_signature=dict(signature),
        checksums=dict(checksums),
        versions={k: str(v) for k, v in f.mapping("versions", (str,), what="a string").items()},
        created=f.get("created", str, default=""),
        manifest_version=data["manifest_version"],
        pruned=dict(f.mapping("pruned", (str,), what="a reason")),
        pruned_paths=dict(f.mapping("pruned_paths", (str,), what="a folder")),
        pruned_groups=dict(f.mapping("pruned_groups", (list,), what="a list of parameter groups",
                                     check=lambda v: all(_is_group(g) for g in v))),
    )
    _sharing(manifest, f, source)
    _pruning(manifest, f)
    for rel in list(manifest.files) + list(manifest.checksums) + [s.path for s in states.values()] + \
            list(manifest.pruned_paths.values()):
        try:
            check_relative(rel, source)
        except UnsafePathError as exc:
            raise CheckpointCorruptError(f"{exc} (a manifest names files inside its own step directory only)") from None
    return manifest


def _is_group(value: Any) -> bool:
    """``{"params": [names], "hyper": {name: value}}``: a parameter group kept by :attr:`Manifest.pruned_groups`."""
    return (isinstance(value, dict) and set(value) == {"params", "hyper"} and isinstance(value["params"], list)
            and all(isinstance(p, str) for p in value["params"]) and isinstance(value["hyper"], dict))


def _pruning(manifest: Manifest, f: _Fields) -> None:
    """A state is either kept or pruned, and a pruned folder neither holds nor lies in what the step keeps."""
    if set(manifest.pruned_groups) - set(manifest.pruned):
        raise f.fail("pruned_groups", "names a state that was not pruned")
    if set(manifest.pruned_paths) - set(manifest.pruned) or set(manifest.pruned) & set(manifest.states):
        raise f.fail("pruned", "does not match pruned_paths and states (a state is either kept or pruned)")
    kept = [e.path for e in manifest.states.values()] + list(manifest.files)
    for gone in manifest.pruned_paths.values():
        if gone.strip("/") in ("", ".") or any(_overlap(gone, k) for k in kept):
            raise f.fail("pruned_paths", f"names {gone!r}, which holds or lies in what the step still keeps")


def _sharing(manifest: Manifest, f: _Fields, source: Path) -> None:
    """``contents`` and ``shared``: they name files of the step; a shared file lives in another step, by a relative
    path."""
    manifest.contents = dict(f.mapping("contents", (str,), what="a sha256 digest",
                                       check=lambda v: bool(_CONTENT.fullmatch(v))))
    manifest.shared = dict(f.mapping("shared", (str,), what="a file of another step"))
    for key in ("contents", "shared"):
        stray = sorted(set(getattr(manifest, key)) - set(manifest.files))
        if stray:
            raise f.fail(key, f"names {stray[0]!r}, which is not among the step's files")
    for rel, target in manifest.shared.items():
        try:
            parts = check_relative(target, source)
        except UnsafePathError as exc:
            raise f.fail("shared", f"entry {rel!r}: {exc}") from None
        if len(parts) < 2 or parts[0] == manifest.name or parts[0].startswith("."):
            raise f.fail("shared", f"entry {rel!r} must name a file of another step, not {target!r}")


def held_by(shared_maps: Any) -> dict[str, set[str]]:
    """Step -> the paths of its files that the given ``shared`` maps (``rel -> step/path``) refer to."""
    out: dict[str, set[str]] = {}
    for shared in shared_maps:
        for target in shared.values():
            owner, _, rel = target.partition("/")
            out.setdefault(owner, set()).add(rel)
    return out


def read_manifest(step_dir: str | Path | Folder) -> Manifest:
    """Read and validate ``step_dir``'s manifest; raise a clear error naming the file otherwise."""
    folder = as_folder(step_dir)
    path = folder.display(MANIFEST_NAME)
    kind = folder.kind(MANIFEST_NAME)
    if kind is None:
        raise CheckpointNotFoundError(
            f"{folder.path} is not a committed ckptio checkpoint: {MANIFEST_NAME} is missing "
            "(an interrupted save, or a folder written by another tool)"
        )
    data = folder.read_bytes(MANIFEST_NAME, max_size=MAX_MANIFEST_BYTES)
    return Manifest.from_json(data, path)


def check_files(step_dir: str | Path | Folder, manifest: Manifest, *, checksums: bool = False,
                progress: Any = None) -> list[str]:
    """Problems with the files a manifest lists, one line each naming the file.

    Always: missing files, links and special files in their place, and sizes that differ. With
    ``checksums``: every byte, against the checksum recorded when the file was written.
    """
    folder = as_folder(step_dir)
    problems = []
    good = []
    for rel, size in sorted(manifest.files.items()):
        try:
            actual = folder.size(rel)
        except (CheckpointCorruptError, CheckpointNotFoundError) as exc:
            problems.append(str(exc))
            continue
        if actual != size:
            problems.append(f"{folder.display(rel)}: size {actual} bytes, manifest says {size}")
        elif checksums and rel not in manifest.checksums:
            problems.append(f"{folder.display(rel)}: no checksum recorded in the manifest")
        else:
            good.append(rel)
    if checksums:
        problems += Verifier(folder, manifest.checksums).finish(good, progress)
    return problems


# ---------------------------------------------------------------------------------------- building one
def model_signature(model: Any, state_dict: dict[str, Any]) -> dict[str, Any]:
    """``{"architecture": …, "shapes": {key: shape}, "dtypes": {key: dtype}}`` of a model, checked before its
    weights are loaded."""
    config = getattr(model, "config", None)
    architecture = None
    if config is not None and getattr(config, "architectures", None):
        architecture = ",".join(config.architectures)
    elif model is not None:
        architecture = type(model).__name__.removeprefix("FSDP")
    return {"architecture": architecture, "shapes": {k: list(v.shape) for k, v in state_dict.items()},
            "dtypes": {k: str(v.dtype).removeprefix("torch.") for k, v in state_dict.items()}}


def merge_shapes(per_rank: list[dict[str, list[int]]]) -> dict[str, list[int]]:
    """The union of every rank's ``{key: global shape}``; a key with two different shapes is an error."""
    from ..errors import CheckpointError

    merged: dict[str, list[int]] = {}
    for rank, shapes in enumerate(per_rank):
        for key, shape in shapes.items():
            if merged.setdefault(key, shape) != shape:
                raise CheckpointError(f"ranks disagree on the shape of {key!r}: {merged[key]} and {shape} (rank {rank})")
    return merged


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

    from .. import __version__

    versions = {"ckptio": __version__, "torch": torch.__version__, "safetensors": getattr(safetensors, "__version__", "unknown")}
    transformers = sys.modules.get("transformers")  # recorded only when in use: importing it costs seconds
    if transformers is not None:
        versions["transformers"] = getattr(transformers, "__version__", "unknown")
    return versions

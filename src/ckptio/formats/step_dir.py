"""A ckptio step directory as a format: read its model (whatever format the model is in), write a new one.

Opening a step directory opens its model folder with the format its manifest names (through the
registry), and keeps the step directory at hand so that formats which hold a whole training state (a
Lightning ``.ckpt``) can carry its optimizer and scheduler over. Writing produces a one-rank step
directory: the model as ckptio's sharded safetensors, its config and tokenizer, and a manifest.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointError, ConfigError
from ..engine.manifest import MANIFEST_NAME, Manifest, StateEntry, read_manifest, software_versions
from ..storage.confined import Folder
from .common import summarize_index
from .registry import Format, Opened, WriteOptions, get, register

if TYPE_CHECKING:
    from .registry import TensorSource

MODEL_DIR = "model"


OPTIM_DIR = "optim"


class _Prefixed:
    """A source's tensors under ``prefix`` + their names (the optimizer's entries as a state's flattened keys)."""

    def __init__(self, source: Any, prefix: str) -> None:
        self.source, self.prefix, self.folder = source, prefix, source.folder

    def index(self) -> dict[str, Any]:
        return {self.prefix + k: v for k, v in self.source.index().items()}

    def read(self, key: str) -> Any:
        return self.source.read(key[len(self.prefix):])

    def close(self) -> None:
        pass  # the source is closed by whoever opened it


def _write_training(training: dict[str, Any], writer: Any, sums: dict[str, str]) -> dict[str, StateEntry]:
    """A foreign checkpoint's optimizer and scheduler (``Opened.training``), one tensor at a time: the optimizer in
    ``optim/`` as the manager's ``optimizer_save_format="safetensors"`` keeps it (its tensors in a shard file, its
    other entries in the values file), the scheduler as ``lr_scheduler.pt``."""
    from . import pt
    from .safetensors.sharded import save_whole
    from .values_json import VALUES_FILE, dumps

    states: dict[str, StateEntry] = {}
    if training.get("tensors") is not None:
        sums.update(save_whole(_Prefixed(training["tensors"], "optim."), writer, OPTIM_DIR, stem="optim"))
        values = {f"optim.{k}": v for k, v in training.get("values", {}).items()}
        sums[f"{OPTIM_DIR}/{VALUES_FILE}"] = writer.write_bytes(f"{OPTIM_DIR}/{VALUES_FILE}", dumps(values))
        states["optim"] = StateEntry("optimizer", "safetensors", OPTIM_DIR)
    if training.get("lr_scheduler") is not None:
        data = pt.to_bytes(training["lr_scheduler"], "the LR scheduler's state")
        sums["lr_scheduler.pt"] = writer.write_bytes("lr_scheduler.pt", data)
        states["lr_scheduler"] = StateEntry("object", "pt", "lr_scheduler.pt")
    return states


class StepDirectory(Format):
    """A ckptio step directory as a conversion source: its model state, in whatever format it was saved."""
    name = "step_dir"
    summary = "ckptio step directory"
    priority = 10

    def detect(self, path: Path) -> bool:
        return path.is_dir() and (path / MANIFEST_NAME).is_file()

    def open(self, path: Path) -> Opened:
        manifest = read_manifest(path)
        entry = manifest.states.get("model")
        fmt = None if entry is None else get(entry.format)
        if entry is None or not fmt.readable or entry.format == "peft":  # type: ignore[union-attr]
            raise CheckpointError(f"{path}: holds no full model (states: {sorted(manifest.states)}); "
                                  "PEFT adapters are already a PEFT folder")
        folder = Folder(path).sub(entry.path)  # a real folder inside the step directory, not a link
        inner = fmt.open(folder.path)  # type: ignore[union-attr]
        opened = Opened(self.name, inner.source, folder.path, manifest.step, manifest.epoch)
        opened.step_dir = path
        return opened

    def write(self, opened: Opened, source: "TensorSource", out: Path, options: WriteOptions) -> None:
        from ..storage import LocalFolderWriter
        from .common import read_json
        from .extras import copy_extras
        from .safetensors.sharded import save_whole

        writer = LocalFolderWriter.create(out)
        try:
            sums = save_whole(source, writer, MODEL_DIR, options.progress)
            if opened.extras is not None:
                sums.update(copy_extras(opened.extras, writer, MODEL_DIR))
            states = {"model": StateEntry("model", "safetensors", MODEL_DIR)}
            if opened.training is not None:
                states.update(_write_training(opened.training(), writer, sums))
            architecture = None
            if writer.exists(f"{MODEL_DIR}/config.json"):
                archs = read_json(writer.local_path(MODEL_DIR) / "config.json").get("architectures") or []
                architecture = ",".join(archs) or None
            manifest = Manifest(name=out.name, step=opened.step, epoch=opened.epoch, world_size=1,
                                model_save_format="safetensors", states=states,
                                files=writer.files(), checksums=sums,
                                model_signature={"architecture": architecture,
                                                 "shapes": {k: list(v.shape) for k, v in source.index().items()}},
                                versions=software_versions())
            writer.commit((MANIFEST_NAME, manifest.to_json().encode()))
        except BaseException:
            writer.abort()
            raise

    def describe(self, path: Any) -> dict[str, Any]:
        """From the manifest and the formats' indexes only; ``path`` may be a local or remote (``s3://``) folder."""
        from ..storage.confined import as_folder
        from ..storage.parse import json_object

        root = as_folder(path)
        m = read_manifest(root)
        out: dict[str, Any] = {
            "path": str(path), "kind": self.name, "label": self.summary, "name": m.name, "step": m.step,
            "epoch": m.epoch, "metrics": m.metrics, "counters": m.counters, "world_size": m.world_size,
            "model_save_format": m.model_save_format, "is_peft": m.is_peft, "created": m.created,
            "versions": m.versions, "total_bytes": m.total_bytes, "files": dict(sorted(m.files.items())),
        }
        out["owned_bytes"], out["shared_bytes"] = m.ownership(root)
        if m.shared:
            out["shared"] = dict(sorted(m.shared.items()))
        architecture = m.model_signature.get("architecture") if isinstance(m.model_signature, dict) else None
        if "model/consolidated/config.json" in m.files:
            try:
                cfg = json_object(root.read_bytes("model/consolidated/config.json", max_size=16 << 20), path)
                named = cfg.get("architectures") or [cfg.get("model_type")]
                architecture = named[0] if isinstance(named[0], str) else architecture
            except CheckpointError:
                pass  # describing must not fail on a side file; loading reports it
        if architecture:
            out["architecture"] = architecture
        states = {}
        for name, entry in m.states.items():
            info: dict[str, Any] = {"kind": entry.kind, "format": entry.format, "path": entry.path,
                                    "per_rank": entry.per_rank}
            try:
                fmt = get(entry.format) if entry.kind != "object" else None
            except ConfigError:
                fmt = None  # a format this version does not know: described by name only
            if fmt is not None and fmt.has_index:
                info["tensors"] = asdict(summarize_index(fmt.index(root.sub(entry.path))))
            states[name] = info
        out["states"] = states
        return out


register(StepDirectory())

"""Model weights from any supported format to any other, one tensor at a time where the formats allow.

Formats (``--to`` names)::

    step_dir     a ckptio step directory (model only: model/ + manifest.json)   reads either model format
    hf           a Hugging Face folder: config.json, model-0000K-of-0000N.safetensors, index, tokenizer
    safetensors  a sharded-safetensors folder (ckptio's per-rank layout, one writer)
    dcp          a PyTorch DCP folder (.metadata + __0_0.distcp)
    torch        one torch.save file of a state dict (.pt/.bin/.pth)
    nemo         a .nemo archive (model_config.yaml + model_weights.ckpt + artifacts)
    lightning    a Lightning .ckpt holding the weights under "model." (no optimizer: see formats.lightning)

Streaming: the readers of step directories, HF and safetensors folders read one tensor at a time with
``pread``; torch/nemo/Lightning files are memory-mapped. Writers of hf, safetensors and step_dir stream
tensor by tensor; dcp, torch, nemo and lightning are single pickled/DCP writes that need every tensor at
once (their formats are written in one call).

Call sequence: single process, no collectives.
"""

from __future__ import annotations

import json
import os
import shutil
import tarfile
import tempfile
import uuid
from pathlib import Path
from typing import Any, Callable

import torch

from ..errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError, ConfigError
from ..formats import _st_writer, hf_bundle, nemo, safetensors_sharded
from ..formats import dcp as dcp_format
from ..formats import pt as pt_format
from ..formats.common import TensorInfo, dtype_name
from ..manifest import MANIFEST_NAME, Manifest, StateEntry, list_files, read_manifest, software_versions
from ..storage import fsync_dir, fsync_tree
from ..storage.confined import Folder
from ..storage.checksum import file_checksum

FORMATS = ("step_dir", "hf", "safetensors", "dcp", "torch", "nemo", "lightning")
_TORCH_SUFFIXES = (".pt", ".pth", ".bin")


class DictSource:
    """Tensors already addressable in memory (memory-mapped torch files)."""

    def __init__(self, tensors: dict[str, torch.Tensor], folder: Path) -> None:
        self.tensors = tensors
        self.folder = folder

    def index(self) -> dict[str, TensorInfo]:
        return {k: TensorInfo(tuple(v.shape), dtype_name(v.dtype)) for k, v in self.tensors.items()}

    def read(self, key: str) -> torch.Tensor:
        return self.tensors[key]


class Opened:
    """An opened source: its tensors, the folder with its side files (config, tokenizer), its position."""

    def __init__(self, kind: str, source: Any, extras: Path | None, step: int = 0, epoch: int = 0,
                 cleanup: Callable[[], None] | None = None) -> None:
        self.kind, self.source, self.extras, self.step, self.epoch = kind, source, extras, step, epoch
        self._cleanup = cleanup
        self.step_dir: Path | None = None
        """A ckptio step directory: its optimizer and scheduler travel to formats that hold them."""

    def close(self) -> None:
        if self._cleanup is not None:
            self._cleanup()


def detect(path: Path) -> str:
    """The format of ``path`` (see the module docstring), from its layout alone."""
    if not path.exists():
        raise CheckpointNotFoundError(f"{path}: no such file or folder")
    if path.is_dir():
        if (path / MANIFEST_NAME).is_file():
            return "step_dir"
        if (path / nemo.CONFIG_FILE).is_file():
            return "nemo"
        if (path / dcp_format.METADATA_FILE).is_file():
            return "dcp"
        if any(path.glob("shard-*.safetensors")):  # ckptio's per-rank layout (config.json may sit beside it)
            return "safetensors"
        if any(path.glob("*.safetensors")):
            return "hf" if (path / "config.json").is_file() else "safetensors"
        raise CheckpointError(f"{path}: not a checkpoint folder ckptio knows (no manifest, DCP metadata, "
                              ".safetensors files or model_config.yaml)")
    if path.suffix == ".safetensors":
        return "safetensors"
    if path.suffix == ".nemo" or (tarfile.is_tarfile(path) and path.suffix not in _TORCH_SUFFIXES + (".ckpt",)):
        return "nemo"
    if path.suffix == ".ckpt":
        return "lightning"
    if path.suffix in _TORCH_SUFFIXES:
        return "torch"
    raise CheckpointError(f"{path}: unknown file type (expected .safetensors, .nemo, .ckpt, .pt, .pth or .bin)")


def _torch_tensors(path: Path) -> dict[str, Any]:
    obj = pt_format.load(path, mmap=True)
    if not isinstance(obj, dict):
        raise CheckpointCorruptError(f"{path}: holds a {type(obj).__name__}, not a state dict")
    return obj


def _only_tensors(sd: dict[str, Any], path: Path) -> dict[str, torch.Tensor]:
    bad = [k for k, v in sd.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise CheckpointCorruptError(f"{path}: the state dict has non-tensor entries, e.g. {bad[:3]}")
    return sd


def open_any(path: str | Path, kind: str | None = None) -> Opened:
    """Open ``path`` for reading tensors one at a time."""
    path = Path(path)
    kind = kind or detect(path)
    if kind == "step_dir":
        manifest = read_manifest(path)
        entry = manifest.states.get("model")
        if entry is None or entry.format not in ("safetensors", "dcp"):
            raise CheckpointError(f"{path}: holds no full model (states: {sorted(manifest.states)}); "
                                  "PEFT adapters are already a PEFT folder")
        folder = Folder(path).sub(entry.path)  # a real folder inside the step directory, not a link
        opened = Opened(kind, hf_bundle.open_source(folder), folder.path, manifest.step, manifest.epoch)
        opened.step_dir = path
        return opened
    if kind in ("hf", "safetensors", "dcp"):
        if path.is_file():
            return Opened(kind, hf_bundle.SafetensorsSource(path.parent, [path.name]), path.parent)
        return Opened(kind, hf_bundle.open_source(path), path)
    if kind == "torch":
        sd = _torch_tensors(path)
        if "state_dict" in sd and isinstance(sd["state_dict"], dict):
            sd = sd["state_dict"]
        return Opened(kind, DictSource(_only_tensors(sd, path), path.parent), None)
    if kind == "lightning":
        from ..formats.lightning import read_lightning

        ckpt = read_lightning(path)
        sd = ckpt["state_dict"]
        if sd and all(k.startswith("model.") for k in sd):  # the LightningModule's model attribute
            sd = {k[len("model."):]: v for k, v in sd.items()}
        return Opened(kind, DictSource(_only_tensors(sd, path), path.parent), None,
                      int(ckpt.get("global_step", 0)), int(ckpt.get("epoch", 0)))
    if kind == "nemo":
        base = Path(tempfile.mkdtemp(prefix="ckptio-convert-"))
        try:
            folder = nemo.unpack(path, base / "x") if path.is_file() else path
            config = nemo.read_config(folder, archive=path)
            extras = base / "extras"
            extras.mkdir()
            if isinstance(config.get("hf_config"), dict):
                (extras / "config.json").write_text(json.dumps(config["hf_config"], indent=2))
            tree = Folder(folder)
            nemo.copy_tokenizer(tree, nemo.tokenizer_files(config, path), extras)  # files inside the archive only
            if tree.is_file(f"{nemo.WEIGHTS_DIR}/{dcp_format.METADATA_FILE}"):
                source: Any = hf_bundle.DCPSource(tree.sub(nemo.WEIGHTS_DIR))
            else:
                source = DictSource(_only_tensors(_torch_tensors(folder / nemo.WEIGHTS_FILE), path),
                                    folder)
        except BaseException:
            shutil.rmtree(base, ignore_errors=True)
            raise
        return Opened(kind, source, extras, cleanup=lambda: shutil.rmtree(base, ignore_errors=True))
    raise ConfigError(f"unknown source format {kind!r}; use one of {list(FORMATS)}")


# ---------------------------------------------------------------------------------------- writing
class _Cast:
    """A source seen through a dtype cast (floating-point tensors only) and a key transform."""

    def __init__(self, source: Any, dtype: torch.dtype | None) -> None:
        self.source, self.dtype, self.folder = source, dtype, source.folder

    def out_dtype(self, info: TensorInfo) -> torch.dtype:
        src = hf_bundle.torch_dtype(info.dtype)
        return self.dtype if self.dtype is not None and src.is_floating_point else src

    def index(self) -> dict[str, TensorInfo]:
        return {k: TensorInfo(v.shape, dtype_name(self.out_dtype(v))) for k, v in self.source.index().items()}

    def read(self, key: str) -> torch.Tensor:
        t = self.source.read(key)
        want = self.out_dtype(TensorInfo(tuple(t.shape), dtype_name(t.dtype)))
        return t.to(want) if t.dtype != want else t


def _all(source: Any, progress: Callable[[int], None] | None) -> dict[str, torch.Tensor]:
    out = {}
    for key, info in source.index().items():
        t = source.read(key)
        out[key] = t.contiguous()
        if progress:
            progress(t.numel() * t.element_size())
    return out


def _copy_extras(extras: Path | None, out: Path) -> None:
    if extras is not None and extras.is_dir():
        hf_bundle.copy_extras(extras, out)


def _write_sharded(source: Any, folder: Path, progress: Callable[[int], None] | None) -> dict[Path, str]:
    folder.mkdir(parents=True, exist_ok=True)
    index = source.index()
    keys = sorted(index, key=hf_bundle._natural_key)
    shards = {k: {"shape": list(index[k].shape), "offsets": [0] * len(index[k].shape)} for k in keys}
    metadata = {"format": "pt", "ckptio_format": safetensors_sharded.FORMAT_TAG, "ckptio_rank": "0",
                "ckptio_world_size": "1", "ckptio_shards": json.dumps(shards, separators=(",", ":"))}
    entries = [_st_writer.Entry(k, hf_bundle.torch_dtype(index[k].dtype), index[k].shape,
                                lambda k=k: source.read(k)) for k in keys]
    path = folder / safetensors_sharded.shard_file_name(0, 1)
    return {path: _st_writer.write(path, entries, metadata, progress=progress)}


def write(opened: Opened, out: Path, to: str, *, dtype: torch.dtype | None = None, max_shard_size: str = "5GB",
          progress: Callable[[int], None] | None = None) -> None:
    """Write ``opened`` to the new path ``out`` in format ``to`` (folder formats are renamed into place)."""
    if to not in FORMATS:
        raise ConfigError(f"unknown target format {to!r}; use one of {list(FORMATS)}")
    source = _Cast(opened.source, dtype)
    stage = out.parent / f".{out.name}.convert-{uuid.uuid4().hex[:8]}"
    try:
        if to == "hf":
            plan = hf_bundle.plan_bundle(source.index(), max_shard_size)
            stage.mkdir()
            hf_bundle.write_files(plan, source, stage, progress=progress)
            hf_bundle.write_index(plan, stage)
            _copy_extras(opened.extras, stage)
            if dtype is not None:
                hf_bundle._set_config_dtype(stage / "config.json", dtype)
        elif to == "safetensors":
            _write_sharded(source, stage, progress)
            _copy_extras(opened.extras, stage)
        elif to == "step_dir":
            _write_step_dir(opened, source, stage, out.name, progress)
        elif to == "dcp":
            dcp_format.save(_all(source, progress), stage)
            _copy_extras(opened.extras, stage)
        elif to == "torch":
            with open(stage, "wb") as fh:
                torch.save(_all(source, progress), fh)
                fh.flush()
                os.fsync(fh.fileno())
        elif to == "lightning":
            from ..formats.lightning import checkpoint_dict

            optim = sched = None
            if opened.step_dir is not None:
                from .training import read_training_state

                optim, sched = read_training_state(opened.step_dir)
            weights = _all(source, progress)
            config = None if opened.extras is None else opened.extras / "config.json"
            if config is not None and config.is_file():
                from .training import tied_aliases

                # a LightningModule loads strictly: a tied alias that the weights store once is written under
                # both names, as nn.Module.state_dict() does
                for alias, primary in tied_aliases(config).items():
                    if alias not in weights and primary in weights:
                        weights[alias] = weights[primary]
            ckpt = checkpoint_dict(weights, step=opened.step, epoch=opened.epoch, optimizer_state=optim,
                                   scheduler_state=sched)
            with open(stage, "wb") as fh:
                torch.save(ckpt, fh)
                fh.flush()
                os.fsync(fh.fileno())
        elif to == "nemo":
            _write_nemo(opened, source, stage, out, progress)
        if stage.is_dir():
            fsync_tree(stage)
        os.rename(stage, out)
        fsync_dir(out.parent)
    except BaseException:
        if stage.is_dir():
            shutil.rmtree(stage, ignore_errors=True)
        else:
            stage.unlink(missing_ok=True)
        raise


def _write_step_dir(opened: Opened, source: Any, stage: Path, name: str,
                    progress: Callable[[int], None] | None) -> None:
    written = _write_sharded(source, stage / "model", progress)
    _copy_extras(opened.extras, stage / "model")
    files = list_files(stage)
    sums = {p.relative_to(stage).as_posix(): d for p, d in written.items()}
    for rel in files:
        sums.setdefault(rel, file_checksum(stage / rel))
    architecture = None
    config = stage / "model" / "config.json"
    if config.is_file():
        archs = json.loads(config.read_text()).get("architectures") or []
        architecture = ",".join(archs) or None
    index = source.index()
    manifest = Manifest(name=name, step=opened.step, epoch=opened.epoch, world_size=1,
                        model_save_format="safetensors",
                        states={"model": StateEntry("model", "safetensors", "model")}, files=files, checksums=sums,
                        model_signature={"architecture": architecture,
                                         "shapes": {k: list(v.shape) for k, v in index.items()}},
                        versions=software_versions())
    (stage / MANIFEST_NAME).write_text(manifest.to_json())


def _write_nemo(opened: Opened, source: Any, stage: Path, out: Path, progress: Callable[[int], None] | None) -> None:
    import yaml

    with tempfile.TemporaryDirectory(prefix="ckptio-nemo-", dir=out.parent) as tmp:
        folder = Path(tmp)
        with open(folder / nemo.WEIGHTS_FILE, "wb") as fh:
            torch.save(_all(source, progress), fh)
        doc: dict[str, Any] = {"ckptio_nemo": 1, "weights": nemo.WEIGHTS_FILE}
        files = {}
        if opened.extras is not None and opened.extras.is_dir():
            for p in sorted(opened.extras.iterdir()):
                if not p.is_file() or p.name.endswith((".safetensors", ".distcp")) or p.name.startswith(".") \
                        or p.name in (hf_bundle.INDEX_FILE, MANIFEST_NAME, dcp_format.METADATA_FILE):
                    continue
                if p.name == "config.json":
                    doc["hf_config"] = json.loads(p.read_text())
                    doc["architecture"] = (doc["hf_config"].get("architectures") or [None])[0]
                elif p.name != "generation_config.json":
                    shutil.copyfile(p, folder / p.name)
                    files[p.name] = nemo.PREFIX + p.name
        if files:
            doc["tokenizer"] = {"library": "huggingface", "files": files}
        (folder / nemo.CONFIG_FILE).write_text(yaml.safe_dump(doc, sort_keys=False))
        nemo._tar_folder(folder, stage)


def convert(src: str | Path, dst: str | Path, to: str, *, dtype: str | torch.dtype | None = None,
            max_shard_size: str = "5GB", naming: str | None = None,
            progress: Callable[[str, int], Callable[[int], None] | None] | None = None) -> Path:
    """Convert the model weights at ``src`` into the new path ``dst`` in format ``to``.

    ``naming`` applies a registered naming converter (see :mod:`ckptio.convert.naming`) on the way.
    ``progress``, once the source is open, is called with its format and total bytes and may return a
    callback that is fed the bytes as they are written. Returns ``dst``.
    """
    dst = Path(dst)
    if dst.exists():
        raise CheckpointError(f"{dst} already exists; convert into a new path")
    if not dst.parent.is_dir():
        raise CheckpointNotFoundError(f"{dst.parent}: no such folder")
    cast = hf_bundle.torch_dtype(dtype) if isinstance(dtype, str) else dtype
    opened = open_any(src)
    try:
        update = None
        if progress is not None:
            total = sum(i.numel * hf_bundle.torch_dtype(i.dtype).itemsize for i in opened.source.index().values())
            update = progress(opened.kind, total)
        if naming is not None:
            from .naming import renamed_source

            opened.source = renamed_source(opened.source, naming, opened.extras)
            opened.step_dir = None  # optimizer state is keyed by the old names: it cannot follow
        write(opened, dst, to, dtype=cast, max_shard_size=max_shard_size, progress=update)
    finally:
        opened.close()
    return dst


__all__ = ["FORMATS", "convert", "detect", "open_any", "write"]

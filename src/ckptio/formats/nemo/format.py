""".nemo archives: a model's config, weights and artifacts in one plain tar file.

::

    model.nemo  (tar, uncompressed; gzip is accepted when reading)
    ├── ./model_config.yaml       # the model's config; artifacts referenced as "nemo:<file name>"
    ├── ./model_weights.ckpt      # a torch.save state dict (one writer), or
    ├── ./model_weights/          # a DCP folder of local shards (several ranks; reshards on load)
    └── ./tokenizer.json …        # artifacts: tokenizer files and anything passed as artifacts=

``model_config.yaml`` as ckptio writes it::

    ckptio_nemo: 1
    architecture: LlamaForCausalLM
    weights: model_weights.ckpt | model_weights
    hf_config: {…}                 # the transformers config, when the model has one
    tokenizer: {library: huggingface, files: {tokenizer.json: nemo:tokenizer.json, …}}
    artifacts: {vocab.txt: nemo:vocab.txt}
    …                              # any keys passed as config=

Reading accepts any archive with a ``model_config.yaml`` and either weights layout, with members
named ``./x`` (NeMo, ``tar -C dir .``) or ``x`` (``tar cf out.nemo *``). A ``nemo:`` reference is
resolved to the unpacked file, so an artifact swapped by hand inside the archive is what is loaded.

Saving and restoring live models as ``.nemo`` (:func:`~ckptio.formats.nemo.model.save_nemo`,
:func:`~ckptio.formats.nemo.model.restore_nemo`) is in :mod:`ckptio.formats.nemo.model`; the config's
rules in :mod:`ckptio.formats.nemo.config`. This module is the format itself: pack, unpack, describe,
and the registry's reader and writer (``convert``).
"""

from __future__ import annotations

import shutil
import tarfile
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
import yaml

from ...errors import CheckpointCorruptError, CheckpointError
from ...storage import LocalFileWriter
from ...storage.archive import safe_extract
from ...storage.confined import Folder
from ..dcp import format as dcp_format
from .. import pt as pt_format
from .config import (_MAX_ARTIFACT_BYTES, CONFIG_FILE, PREFIX, WEIGHTS_DIR, WEIGHTS_FILE, artifact_refs, copy_tokenizer,
                     read_config, tokenizer_files)
from ..registry import Format, Opened, WriteOptions, register

if TYPE_CHECKING:
    from ..registry import TensorSource

__all__ = ["pack", "unpack", "read_config", "describe", "NemoArchive", "CONFIG_FILE", "WEIGHTS_FILE", "WEIGHTS_DIR",
           "PREFIX"]


def pack(folder: str | Path, out: str | Path, progress: Callable[[int], object] | None = None) -> Path:
    """Tar ``folder`` (an unpacked .nemo) into ``out``, checked first, written atomically.

    Members are named ``./<path>`` as NeMo writes them. Symbolic links and special files are refused.
    """
    folder, out = Path(folder), Path(out)
    read_config(folder)  # refuses a folder that is not a .nemo layout
    return _tar_folder(folder, out, progress)


def _tar_folder(folder: Path, out: Path, progress: Callable[[int], object] | None = None) -> Path:
    """Tar every file and folder under ``folder`` as ``./<path>`` into the new file ``out``, atomically."""
    writer = LocalFileWriter(out)
    try:
        with tarfile.open(fileobj=writer.stream, mode="w", format=tarfile.PAX_FORMAT) as tar:  # type: ignore[call-overload]
            for p in sorted(folder.rglob("*")):
                rel = p.relative_to(folder).as_posix()
                if p.is_symlink() or not (p.is_file() or p.is_dir()):
                    raise CheckpointError(f"{p}: only regular files and folders can go into a .nemo")
                info = tar.gettarinfo(str(p), arcname=f"./{rel}")
                info.uid = info.gid = 0
                info.uname = info.gname = ""
                if p.is_file():
                    with open(p, "rb") as src:
                        tar.addfile(info, src)
                    if progress is not None:
                        progress(info.size)
                else:
                    tar.addfile(info)
        writer.commit()
    except BaseException:
        writer.abort()
        raise
    return out


def unpack(archive: str | Path, dest: str | Path, progress: Callable[[int], object] | None = None) -> Path:
    """Unpack a .nemo safely into the new folder ``dest`` and check its layout."""
    dest = safe_extract(archive, dest, progress=progress)
    try:
        read_config(dest, archive=Path(archive))
    except CheckpointError:
        shutil.rmtree(dest, ignore_errors=True)
        raise
    return dest


# ---------------------------------------------------------------------------------------------- read
def describe(path: str | Path) -> dict[str, Any]:
    """What ``ckptio inspect x.nemo`` prints: members, config summary, weights layout and tensors."""
    from dataclasses import asdict

    from ..common import TensorInfo, dtype_name, summarize_index

    path = Path(path)
    with tempfile.TemporaryDirectory(prefix="ckptio-inspect-") as tmp:
        folder = unpack(path, Path(tmp) / "x") if path.is_file() else path
        config = read_config(folder, archive=path)
        files = {rel: e.size for rel, e in Folder(folder).walk_files() if e.kind == "file"}
        megatron = _megatron_weights(folder, config)
        if megatron is not None:
            from ..megatron.format import MegatronSource, _as_llama
            from ..megatron.config import nemo_args

            src = MegatronSource(megatron, args=nemo_args(config))
            weights = f"Megatron {'model-parallel folders' if src.layout == 'legacy' else WEIGHTS_DIR + '/ (torch_dist)'}"
            index = _as_llama(src).index()
        elif (folder / WEIGHTS_DIR / dcp_format.METADATA_FILE).is_file():
            weights, index = WEIGHTS_DIR + "/ (DCP)", dcp_format.read_index(folder / WEIGHTS_DIR)
        else:
            full = pt_format.load(folder / WEIGHTS_FILE, mmap=True)
            if not isinstance(full, dict):
                raise CheckpointCorruptError(f"{path}: {WEIGHTS_FILE} does not hold a state dict")
            weights = WEIGHTS_FILE
            index = {k: TensorInfo(tuple(v.shape), dtype_name(v.dtype)) for k, v in full.items()
                     if isinstance(v, torch.Tensor)}
    return {"path": str(path), "kind": "nemo", "architecture": config.get("architecture"), "weights": weights,
            "artifacts": sorted(set(artifact_refs(config, path).values())), "files": files,
            "total_bytes": sum(files.values()), "tensors": asdict(summarize_index(index)),
            "config_keys": sorted(config)}


def _megatron_weights(folder: Path, config: dict[str, Any]) -> Path | None:
    """Where a NeMo 1.x archive keeps Megatron weights: rank folders (``mp_rank_TT``, ``tp_rank_TT_pp_rank_PPP``)
    or a Megatron-Core distributed ``model_weights/``; ``None`` for ckptio's own archives and plain weights."""
    from ..megatron.format import layout_of

    if config.get("ckptio_nemo"):
        return None
    if layout_of(folder) == "legacy":
        return folder
    if layout_of(folder / WEIGHTS_DIR) == "dist":
        return folder / WEIGHTS_DIR
    return None


# ---------------------------------------------------------------------------------------------- the format
def _is_nemo_file(path: Path) -> bool:
    from ..torch_file import SUFFIXES

    return path.is_file() and (path.suffix == ".nemo" or (
        path.suffix not in SUFFIXES + (".ckpt", ".safetensors") and tarfile.is_tarfile(path)))


class NemoArchive(Format):
    """``.nemo`` archives (or their unpacked folders): config YAML, weights, artifacts."""

    name = "nemo"
    summary = ".nemo archive"
    priority = 20
    file_suffix = ".nemo"

    def detect(self, path: Path) -> bool:
        return (path.is_dir() and (path / CONFIG_FILE).is_file()) or _is_nemo_file(path)

    def open(self, path: Path) -> Opened:
        import json

        from ..torch_file import DictSource, only_tensors, read_tensors

        base = Path(tempfile.mkdtemp(prefix="ckptio-convert-"))
        try:
            folder = unpack(path, base / "x") if path.is_file() else path
            config = read_config(folder, archive=path)
            extras = base / "extras"
            extras.mkdir()
            if isinstance(config.get("hf_config"), dict):
                (extras / "config.json").write_text(json.dumps(config["hf_config"], indent=2))
            tree = Folder(folder)
            copy_tokenizer(tree, tokenizer_files(config, path), extras)  # files inside the archive only
            source: Any
            if _megatron_weights(folder, config) is not None:  # NeMo 1.x model-parallel or distributed weights
                from ..megatron.format import MegatronSource, _as_llama
                from ..megatron.config import nemo_args

                megatron = MegatronSource(_megatron_weights(folder, config), args=nemo_args(config))  # type: ignore[arg-type]
                source = _as_llama(megatron)
                (extras / "config.json").write_text(json.dumps(megatron.config, indent=2))
            elif tree.is_file(f"{WEIGHTS_DIR}/{dcp_format.METADATA_FILE}"):
                source = dcp_format.DCPSource(tree.sub(WEIGHTS_DIR))
            else:
                source = DictSource(only_tensors(read_tensors(folder / WEIGHTS_FILE, unwrap=False), path), folder)
        except BaseException:
            shutil.rmtree(base, ignore_errors=True)
            raise
        return Opened(self.name, source, extras, cleanup=lambda: shutil.rmtree(base, ignore_errors=True))

    def write(self, opened: Opened, source: "TensorSource", out: Path, options: WriteOptions) -> None:
        import json

        from ..extras import INDEX_FILE
        from ..torch_file import all_tensors

        with tempfile.TemporaryDirectory(prefix="ckptio-nemo-", dir=out.parent) as tmp:
            folder = Path(tmp)
            with open(folder / WEIGHTS_FILE, "wb") as fh:
                torch.save(all_tensors(source, options.progress), fh)
            doc: dict[str, Any] = {"ckptio_nemo": 1, "weights": WEIGHTS_FILE}
            files = {}
            extras = Folder(opened.extras) if opened.extras is not None and opened.extras.is_dir() else None
            for entry in extras.listdir() if extras is not None else []:
                name = entry.name
                if entry.kind != "file" or name.endswith((".safetensors", ".distcp")) or name.startswith(".") \
                        or name in (INDEX_FILE, "manifest.json", dcp_format.METADATA_FILE):
                    continue
                data = extras.read_bytes(name, max_size=_MAX_ARTIFACT_BYTES)  # type: ignore[union-attr]
                if name == "config.json":
                    doc["hf_config"] = json.loads(data)
                    doc["architecture"] = (doc["hf_config"].get("architectures") or [None])[0]
                elif name != "generation_config.json":
                    (folder / name).write_bytes(data)
                    files[name] = PREFIX + name
            if files:
                doc["tokenizer"] = {"library": "huggingface", "files": files}
            (folder / CONFIG_FILE).write_text(yaml.safe_dump(doc, sort_keys=False))
            _tar_folder(folder, out)

    def describe(self, path: Path) -> dict[str, Any]:
        return describe(path)


register(NemoArchive())

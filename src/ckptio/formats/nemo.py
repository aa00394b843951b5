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

Call sequence: :func:`save_nemo` and :func:`restore_nemo` are collectives when a process group is
initialised (every rank calls them with its own model); rank 0 writes the archive.
"""

from __future__ import annotations

import os
import shutil
import tarfile
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import nn

from .. import _dist, safe_yaml
from ..errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError
from ..storage import fsync_dir
from ..storage.archive import safe_extract
from ..storage.confined import Folder, UnsafePathError, check_relative
from . import dcp as dcp_format
from . import pt as pt_format
from .common import full_tensors

__all__ = ["NemoModel", "save_nemo", "restore_nemo", "pack", "unpack", "read_config", "CONFIG_FILE"]

CONFIG_FILE = "model_config.yaml"
WEIGHTS_FILE = "model_weights.ckpt"
WEIGHTS_DIR = "model_weights"
PREFIX = "nemo:"
_MAX_ARTIFACT_BYTES = 1 << 30


@dataclass
class NemoModel:
    """What :func:`restore_nemo` returns. ``folder`` is the unpacked archive (removed by :meth:`cleanup`
    when it was a temporary one)."""

    path: Path
    folder: Path
    config: dict[str, Any]
    artifacts: dict[str, Path] = field(default_factory=dict)
    model: nn.Module | None = None
    weights_format: str = "ckpt"
    _temporary: bool = False

    def tokenizer(self) -> Any:
        """The archive's Hugging Face tokenizer (``transformers.AutoTokenizer``), or ``None``."""
        files = tokenizer_files(self.config, self.path)
        if not files:
            return None
        from transformers import AutoTokenizer

        with tempfile.TemporaryDirectory(prefix="ckptio-tok-") as tmp:
            copy_tokenizer(Folder(self.folder), files, Path(tmp))
            return AutoTokenizer.from_pretrained(tmp)

    def cleanup(self) -> None:
        if self._temporary:
            shutil.rmtree(self.folder, ignore_errors=True)


def _safe_name(name: object, where: Path) -> str:
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or name in (".", "..") \
            or name.startswith("."):
        raise CheckpointCorruptError(f"{where}: artifact name {name!r} is not a plain file name")
    return name


# ---------------------------------------------------------------------------------------------- save
def save_nemo(path: str | Path, model: nn.Module, *, config: dict[str, Any] | None = None,
              artifacts: dict[str, str | Path] | None = None, tokenizer: Any | None = None,
              sharded: bool | None = None) -> Path:
    """Collective: write ``model`` (its config, weights and artifacts) as the ``.nemo`` file ``path``.

    ``sharded``: weights as a DCP folder of every rank's local shards (default when the model is
    sharded or there are several ranks), else one ``model_weights.ckpt`` written by rank 0.
    ``artifacts`` maps a file name inside the archive to a local file. The archive is written to a
    temporary name and renamed into place, so a crash never leaves a torn ``.nemo``.
    """
    from ..state import ModelState

    path = Path(path)
    rank = _dist.rank()
    state = ModelState(model)
    local = state.state_dict()
    has_dtensor = any(type(v).__name__ == "DTensor" for v in local.values())
    if sharded is None:
        sharded = has_dtensor or _dist.world_size() > 1

    def prepare() -> str | None:
        if rank != 0:
            return None
        path.parent.mkdir(parents=True, exist_ok=True)
        stage = path.parent / f".{path.name}.pack-{uuid.uuid4().hex[:8]}"
        stage.mkdir()
        return str(stage)

    stage = Path(_dist.broadcast_object(_dist.run_collectively(f"preparing {path}", prepare)))
    try:
        if sharded:
            dcp_format.save(local, stage / WEIGHTS_DIR)
        else:
            full = full_tensors(local)  # collective under FSDP2

            def write_ckpt() -> None:
                if rank == 0:
                    with open(stage / WEIGHTS_FILE, "wb") as fh:
                        torch.save(full, fh)
                        fh.flush()
                        os.fsync(fh.fileno())

            _dist.run_collectively(f"writing {WEIGHTS_FILE}", write_ckpt)
        del local

        def finish() -> None:
            if rank != 0:
                return
            doc = _config_doc(model, stage, sharded, config, artifacts, tokenizer)
            (stage / CONFIG_FILE).write_text(yaml.safe_dump(doc, sort_keys=False))
            pack(stage, path)

        _dist.run_collectively(f"writing {path}", finish)
    finally:
        if rank == 0:
            shutil.rmtree(stage, ignore_errors=True)
    return path


def _config_doc(model: nn.Module, stage: Path, sharded: bool, config: dict[str, Any] | None,
                artifacts: dict[str, str | Path] | None, tokenizer: Any | None) -> dict[str, Any]:
    doc: dict[str, Any] = {"ckptio_nemo": 1, "architecture": type(model).__name__,
                           "weights": WEIGHTS_DIR if sharded else WEIGHTS_FILE}
    hf = getattr(model, "config", None)
    if hf is not None and hasattr(hf, "to_dict"):
        doc["hf_config"] = _plain(hf.to_dict())
        if getattr(hf, "architectures", None):
            doc["architecture"] = hf.architectures[0]
    if tokenizer is not None:
        with tempfile.TemporaryDirectory(prefix="ckptio-tok-") as tmp:
            tokenizer.save_pretrained(tmp)
            files = {}
            for f in sorted(Path(tmp).iterdir()):
                if f.is_file():
                    shutil.copyfile(f, stage / f.name)
                    files[f.name] = PREFIX + f.name
        doc["tokenizer"] = {"library": "huggingface", "files": files}
    if artifacts:
        refs = {}
        for name, src in artifacts.items():
            name = _safe_name(name, stage)
            if name in (CONFIG_FILE, WEIGHTS_FILE, WEIGHTS_DIR) or (stage / name).exists():
                raise CheckpointError(f"artifact name {name!r} clashes with another file of the archive")
            src = Path(src)
            if not src.is_file():
                raise CheckpointNotFoundError(f"artifact {name!r}: {src} is not a file")
            shutil.copyfile(src, stage / name)
            refs[name] = PREFIX + name
        doc["artifacts"] = refs
    for key, value in (config or {}).items():
        doc[key] = _plain(value)
    return doc


def _plain(value: Any) -> Any:
    """YAML-safe copy: dicts, lists, strings, numbers, booleans and None."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    return str(value)


def pack(folder: str | Path, out: str | Path) -> Path:
    """Tar ``folder`` (an unpacked .nemo) into ``out``, checked first, written atomically.

    Members are named ``./<path>`` as NeMo writes them. Symbolic links and special files are refused.
    """
    folder, out = Path(folder), Path(out)
    read_config(folder)  # refuses a folder that is not a .nemo layout
    return _tar_folder(folder, out)


def _tar_folder(folder: Path, out: Path) -> Path:
    """Tar every file and folder under ``folder`` as ``./<path>`` into ``out``, atomically."""
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "wb") as fh:
            with tarfile.open(fileobj=fh, mode="w", format=tarfile.PAX_FORMAT) as tar:
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
                    else:
                        tar.addfile(info)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, out)
        fsync_dir(out.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return out


def unpack(archive: str | Path, dest: str | Path) -> Path:
    """Unpack a .nemo safely into the new folder ``dest`` and check its layout."""
    dest = safe_extract(archive, dest)
    try:
        read_config(dest, archive=Path(archive))
    except CheckpointError:
        shutil.rmtree(dest, ignore_errors=True)
        raise
    return dest


# ---------------------------------------------------------------------------------------------- read
def read_config(folder: str | Path, archive: Path | None = None) -> dict[str, Any]:
    """The parsed ``model_config.yaml`` of an unpacked .nemo, after checking weights and artifacts exist.

    The YAML is read with a bounded size and without aliases. Every artifact the config names (see
    :func:`artifact_refs`) must be a ``nemo:`` reference to a regular file inside the archive.
    """
    folder = Path(folder)
    where = archive or folder
    tree = Folder(folder)
    if tree.kind(CONFIG_FILE) is None:
        raise CheckpointNotFoundError(f"{where} is not a .nemo: {CONFIG_FILE} is missing")
    config = safe_yaml.load(tree.read_bytes(CONFIG_FILE, max_size=safe_yaml.MAX_BYTES), f"{where}: {CONFIG_FILE}")
    if not isinstance(config, dict):
        raise CheckpointCorruptError(f"{where}: {CONFIG_FILE} does not hold a mapping")
    if not tree.is_file(WEIGHTS_FILE) and not tree.is_file(f"{WEIGHTS_DIR}/{dcp_format.METADATA_FILE}"):
        raise CheckpointNotFoundError(f"{where} holds no weights: neither {WEIGHTS_FILE} nor {WEIGHTS_DIR}/")
    for key, name in artifact_refs(config, where).items():
        if not tree.is_file(name):
            raise CheckpointNotFoundError(f"{where}: {CONFIG_FILE} key {key} refers to {PREFIX}{name} but the archive "
                                          f"has no regular file {name}")
    return config


# Config keys whose values ckptio reads as files: they must be ``nemo:`` references into the archive.
_TOKENIZER_FILE_KEYS = ("model", "vocab_file", "merge_file", "tokenizer_model")


def artifact_refs(config: dict[str, Any], where: Path) -> dict[str, str]:
    """Dotted config key -> file name inside the archive, for every artifact the config names.

    Artifacts are the entries of ``artifacts:`` and ``tokenizer.files:`` (ckptio's layout) and NeMo's
    tokenizer keys (``tokenizer.model``, ``vocab_file``, ``merge_file``). Each must be a ``nemo:``
    reference to a plain relative name; anything else (an absolute path, ``..``, a path on the host
    that wrote the archive) is an error naming the key and the value, so that no host file is ever read.
    """
    out: dict[str, str] = {}

    def ref(key: str, value: Any) -> None:
        if not isinstance(value, str) or not value.startswith(PREFIX):
            raise CheckpointCorruptError(f"{where}: {CONFIG_FILE} key {key} = {value!r:.200} is not a {PREFIX} reference "
                                         "to a file inside the archive; ckptio reads artifacts from the archive only")
        name = value[len(PREFIX):]
        try:
            check_relative(name, f"{where}: {CONFIG_FILE} key {key}")
        except UnsafePathError as exc:
            raise CheckpointCorruptError(str(exc)) from None
        out[key] = name

    for section in ("artifacts",):
        entries = config.get(section)
        if entries is not None:
            if not isinstance(entries, dict):
                raise CheckpointCorruptError(f"{where}: {CONFIG_FILE} key {section} is not a mapping")
            for k, v in entries.items():
                ref(f"{section}.{k}", v)
    tok = config.get("tokenizer")
    if tok is not None and not isinstance(tok, dict):
        raise CheckpointCorruptError(f"{where}: {CONFIG_FILE} key tokenizer is not a mapping")
    if isinstance(tok, dict):
        files = tok.get("files")
        if files is not None:
            if not isinstance(files, dict):
                raise CheckpointCorruptError(f"{where}: {CONFIG_FILE} key tokenizer.files is not a mapping")
            for k, v in files.items():
                _safe_name(k, where)
                ref(f"tokenizer.files.{k}", v)
        for k in _TOKENIZER_FILE_KEYS:
            if tok.get(k) is not None:
                ref(f"tokenizer.{k}", tok[k])
    for value in _refs(config):  # any other nemo: reference must stay inside the archive too
        name = value[len(PREFIX):]
        if name not in out.values():
            ref(f"(a {PREFIX} reference elsewhere in the config)", value)
    return out


def tokenizer_files(config: dict[str, Any], where: Path) -> dict[str, str]:
    """File name the tokenizer expects -> file inside the archive, for ckptio's Hugging Face tokenizer layout."""
    refs = artifact_refs(config, where)
    return {k[len("tokenizer.files."):]: v for k, v in refs.items() if k.startswith("tokenizer.files.")}


def copy_tokenizer(folder: Folder, files: dict[str, str], out: Path) -> None:
    """Copy the tokenizer files (from inside the unpacked archive only) to ``out`` under their own names."""
    for name, rel in files.items():
        (out / _safe_name(name, folder.path)).write_bytes(folder.read_bytes(rel, max_size=_MAX_ARTIFACT_BYTES))


def _refs(value: Any, depth: int = 0) -> list[str]:
    if depth > 64:
        return []
    if isinstance(value, str):
        return [value] if value.startswith(PREFIX) else []
    if isinstance(value, dict):
        return [r for v in value.values() for r in _refs(v, depth + 1)]
    if isinstance(value, list):
        return [r for v in value for r in _refs(v, depth + 1)]
    return []


def restore_nemo(path: str | Path, model: nn.Module | None = None, *, workdir: str | Path | None = None,
                 strict: bool = True) -> NemoModel:
    """Collective: load a ``.nemo`` file (or an unpacked one) into ``model``, or into a new model.

    Without ``model``, a ``transformers`` model is built from the archive's ``hf_config`` (no hub
    access). ``model`` may be plain or FSDP2-sharded; the DCP layout reshards onto any number of ranks.
    The archive is unpacked (safely) into a temporary folder under ``workdir`` that stays until
    :meth:`NemoModel.cleanup`, so artifacts can be read from it.
    """
    from ..formats.safetensors_sharded import check_compatible
    from ..state import ModelState

    path = Path(path)
    if not path.exists():
        raise CheckpointNotFoundError(f"{path}: no such .nemo file or folder")
    temporary = path.is_file()
    if temporary:
        base = Path(tempfile.mkdtemp(prefix="ckptio-nemo-", dir=workdir))
        folder = unpack(path, base / "unpacked")
    else:
        folder = path
    try:
        config = read_config(folder, archive=path)
        if model is None:
            model = model_from_config(config, path)
        state = ModelState(model)
        target = state.state_dict()
        if (folder / WEIGHTS_DIR / dcp_format.METADATA_FILE).is_file():
            fmt = "dcp"
            check_compatible(dcp_format.read_index(folder / WEIGHTS_DIR), target, str(path), strict=strict)
            dcp_format.load(target, folder / WEIGHTS_DIR)
            state.load_state_dict(target)
        else:
            fmt = "ckpt"
            full = pt_format.load(folder / WEIGHTS_FILE)
            if not isinstance(full, dict) or not all(isinstance(v, torch.Tensor) for v in full.values()):
                raise CheckpointCorruptError(f"{path}: {WEIGHTS_FILE} does not hold a state dict of tensors")
            from ..formats.common import TensorInfo, dtype_name

            check_compatible({k: TensorInfo(tuple(v.shape), dtype_name(v.dtype)) for k, v in full.items()},
                             target, str(path), strict=strict)
            _load_full(model, state, full)
        artifacts = {name: folder / name for name in artifact_refs(config, path).values()}
    except BaseException:
        if temporary:
            shutil.rmtree(folder.parent, ignore_errors=True)
        raise
    return NemoModel(path=path, folder=folder, config=config, artifacts=artifacts, model=model,
                     weights_format=fmt, _temporary=temporary)


def _load_full(model: nn.Module, state: Any, full: dict[str, torch.Tensor]) -> None:
    """Copy whole tensors into a plain or FSDP2-sharded model (each rank keeps its slice)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.tensor import DTensor

    target = state.state_dict()
    if any(isinstance(v, DTensor) for v in target.values()):
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, strict=False))
        tie = getattr(model, "tie_weights", None)
        if state.tied_aliases and callable(tie):
            tie()
        return
    for key, value in target.items():
        with torch.no_grad():
            value.copy_(full[key])
    state.load_state_dict(target)


def model_from_config(config: dict[str, Any], where: Path) -> nn.Module:
    """A freshly initialised ``transformers`` model from a .nemo config's ``hf_config``."""
    hf = config.get("hf_config")
    if not isinstance(hf, dict) or not isinstance(hf.get("model_type"), str):
        raise CheckpointError(
            f"{where}: its config has no hf_config with a model_type, so ckptio cannot build the model; "
            "pass model= (an instance of the model the archive was saved from)"
        )
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**hf)
    return AutoModelForCausalLM.from_config(cfg)


def describe(path: str | Path) -> dict[str, Any]:
    """What ``ckptio inspect x.nemo`` prints: members, config summary, weights layout and tensors."""
    from ..describe import summarize_index
    from dataclasses import asdict
    from .common import TensorInfo, dtype_name

    path = Path(path)
    with tempfile.TemporaryDirectory(prefix="ckptio-inspect-") as tmp:
        folder = unpack(path, Path(tmp) / "x") if path.is_file() else path
        config = read_config(folder, archive=path)
        files = {rel: e.size for rel, e in Folder(folder).walk_files() if e.kind == "file"}
        if (folder / WEIGHTS_DIR / dcp_format.METADATA_FILE).is_file():
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

"""Live models to and from ``.nemo`` archives: :func:`save_nemo` and :func:`restore_nemo`.

Call sequence: both are collectives when a process group is initialised (every rank calls them with its
own model); rank 0 writes the archive. The model may be plain or FSDP2-sharded; weights go to one
``model_weights.ckpt`` (rank 0) or a ``model_weights/`` DCP folder of every rank's shards (default on
several ranks; it reshards on restore).
"""

from __future__ import annotations

import shutil
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import nn

from ... import _dist
from ...errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError, require
from ...storage import LocalFolderWriter
from ...storage.confined import Folder
from ..dcp import format as dcp_format
from .. import pt as pt_format
from ..common import full_tensors
from .format import pack, unpack
from .config import (CONFIG_FILE, PREFIX, WEIGHTS_DIR, WEIGHTS_FILE, _plain, _safe_name, artifact_refs, copy_tokenizer,
                     read_config, tokenizer_files)

__all__ = ["NemoModel", "save_nemo", "restore_nemo", "model_from_config"]


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
        AutoTokenizer = require("transformers", extra="hf", purpose="loading a .nemo's tokenizer").AutoTokenizer

        with tempfile.TemporaryDirectory(prefix="ckptio-tok-") as tmp:
            copy_tokenizer(Folder(self.folder), files, Path(tmp))
            return AutoTokenizer.from_pretrained(tmp)

    def cleanup(self) -> None:
        if self._temporary:  # the whole temporary folder restore_nemo made, not only the unpacked archive in it
            shutil.rmtree(self.folder.parent, ignore_errors=True)


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
    from ...state import ModelState

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
        return stage.name

    token = _dist.broadcast_object(_dist.run_collectively(f"preparing {path}", prepare))
    # a scratch folder for the archive's contents (never committed: its contents go into the tar)
    assert token is not None  # rank 0 always names the folder
    stage_writer = LocalFolderWriter.in_place(path.parent / token)
    stage = stage_writer.local_path()
    try:
        if sharded:
            dcp_format.save(local, stage_writer, WEIGHTS_DIR)
        else:
            full = full_tensors(local)  # collective under FSDP2

            def write_ckpt() -> None:
                if rank == 0:
                    with stage_writer.open(WEIGHTS_FILE) as out:
                        torch.save(full, out)  # type: ignore[arg-type]

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


def restore_nemo(path: str | Path, model: nn.Module | None = None, *, workdir: str | Path | None = None,
                 strict: bool = True) -> NemoModel:
    """Collective: load a ``.nemo`` file (or an unpacked one) into ``model``, or into a new model.

    Without ``model``, a ``transformers`` model is built from the archive's ``hf_config`` (no hub
    access). ``model`` may be plain or FSDP2-sharded; the DCP layout reshards onto any number of ranks.
    The archive is unpacked (safely) into a temporary folder under ``workdir`` that stays until
    :meth:`NemoModel.cleanup`, so artifacts can be read from it.
    """
    from ..safetensors.sharded import check_compatible
    from ...state import ModelState

    path = Path(path)
    if not path.exists():
        raise CheckpointNotFoundError(f"{path}: no such .nemo file or folder")
    temporary = path.is_file()
    base = Path(tempfile.mkdtemp(prefix="ckptio-nemo-", dir=workdir)) if temporary else None
    try:
        folder = unpack(path, base / "unpacked") if base is not None else path
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
            from ..common import TensorInfo, dtype_name

            check_compatible({k: TensorInfo(tuple(v.shape), dtype_name(v.dtype)) for k, v in full.items()},
                             target, str(path), strict=strict)
            _load_full(model, state, full)
        artifacts = {name: folder / name for name in artifact_refs(config, path).values()}
    except BaseException:
        if base is not None:  # nothing of a refused archive stays behind, however far its unpacking got
            shutil.rmtree(base, ignore_errors=True)
        raise
    return NemoModel(path=path, folder=folder, config=config, artifacts=artifacts, model=model,
                     weights_format=fmt, _temporary=temporary)


def _load_full(model: nn.Module, state: Any, full: dict[str, torch.Tensor]) -> None:
    """Copy whole tensors into a plain or FSDP2-sharded model (each rank keeps its slice)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.tensor import DTensor

    target = state.state_dict()
    if any(isinstance(v, DTensor) for v in target.values()):
        set_model_state_dict(model, full,  # type: ignore[arg-type]
                             options=StateDictOptions(full_state_dict=True, strict=False))
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
    transformers = require("transformers", extra="hf", purpose="building the model of a .nemo from its config")
    AutoConfig, AutoModelForCausalLM = transformers.AutoConfig, transformers.AutoModelForCausalLM

    cfg = AutoConfig.for_model(**hf)
    return AutoModelForCausalLM.from_config(cfg)

"""The ``model_config.yaml`` of a ``.nemo`` archive: reading it safely, and the rules for its artifacts.

The YAML is read bounded in size and without aliases (:func:`ckptio.storage.parse.yaml_value`). Every
artifact the config names — the entries of ``artifacts:`` and ``tokenizer.files:`` (ckptio's layout) and NeMo's
tokenizer keys (``tokenizer.model``, ``vocab_file``, ``merge_file``) — must be a ``nemo:`` reference to a
plain relative name inside the archive; anything else is an error naming the key and the value, so that
no file of the host is ever read on an archive's say-so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ...storage.parse import YAML_MAX_BYTES, yaml_value
from ...errors import CheckpointCorruptError, CheckpointNotFoundError
from ...storage.confined import Folder, UnsafePathError, check_relative
from ..dcp import metadata as dcp_metadata

__all__ = ["CONFIG_FILE", "WEIGHTS_FILE", "WEIGHTS_DIR", "PREFIX", "read_config", "artifact_refs",
           "tokenizer_files", "copy_tokenizer"]

CONFIG_FILE = "model_config.yaml"
WEIGHTS_FILE = "model_weights.ckpt"
WEIGHTS_DIR = "model_weights"
PREFIX = "nemo:"
_MAX_ARTIFACT_BYTES = 1 << 30


def _safe_name(name: object, where: Path) -> str:
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or name in (".", "..") \
            or name.startswith("."):
        raise CheckpointCorruptError(f"{where}: artifact name {name!r} is not a plain file name")
    return name


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
    config = yaml_value(tree.read_bytes(CONFIG_FILE, max_size=YAML_MAX_BYTES), f"{where}: {CONFIG_FILE}")
    if not isinstance(config, dict):
        raise CheckpointCorruptError(f"{where}: {CONFIG_FILE} does not hold a mapping")
    if not tree.is_file(WEIGHTS_FILE) and not tree.is_file(f"{WEIGHTS_DIR}/{dcp_metadata.METADATA_FILE}") and \
            not any(e.kind == "dir" and e.name.startswith(("mp_rank_", "tp_rank_")) for e in tree.listdir()):
        raise CheckpointNotFoundError(f"{where} holds no weights: neither {WEIGHTS_FILE}, {WEIGHTS_DIR}/ nor "
                                      "model-parallel folders (mp_rank_TT/, tp_rank_TT_pp_rank_PPP/)")
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

"""``convert --config``: the model's ``config.json`` (and side files) for an output whose source has none beside it.

A DeepSpeed run, a ``.pt`` file or a bare safetensors folder holds weights only; ``from_pretrained`` needs a
``config.json`` to build the model, and without one builds the class's default (a full-size Llama, tens of GB).
``--config`` names one of:

* a ``config.json`` file (any name: it is written as ``config.json``);
* a model folder holding ``config.json``: its side files (config, generation config, tokenizer) are carried over;
* the name of a model in the local Hugging Face cache (``org/name``), as ``from_pretrained`` would take it: read
  offline from the cache only, never downloaded.

Each file is read through the confined reader, bounded, and ``config.json`` must be a JSON object.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from ..errors import ConfigError
from ..storage.confined import Folder
from ..storage.parse import json_object

__all__ = ["config_folder", "MISSING_CONFIG"]

CONFIG = "config.json"
_CACHED = (CONFIG, "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
           "tokenizer.model")
"""What is taken from a model in the Hugging Face cache: its config and tokenizer, not its weights."""
_MAX_BYTES = 256 << 20

MISSING_CONFIG = ("{out} holds the weights only: {source} has no config.json beside its weights (a DeepSpeed run "
                  "keeps one only inside an HF Trainer's checkpoint-N/), and from_pretrained needs one to build the "
                  "model (without it, it builds the class's default size). Convert again with --config naming the "
                  "model's config.json, a model folder holding one, or the model's name in your Hugging Face cache (--config org/name; "
                  "read offline), or copy the config.json into {out}")
"""The message when a Hugging Face bundle was written without a ``config.json``."""


def config_folder(spec: str, scratch: Path) -> Path:
    """A folder whose side files the output takes, from ``--config spec`` (see the module's docstring); a file is
    copied into ``scratch`` as ``config.json``. A spec that names nothing of the kind is a :class:`ConfigError`
    naming it."""
    path = Path(spec).expanduser()
    if path.is_dir():
        folder = Folder(path)
        if folder.kind(CONFIG) != "file":
            raise ConfigError(f"--config {spec}: the folder holds no {CONFIG}")
        json_object(folder.read_bytes(CONFIG, max_size=_MAX_BYTES), folder.display(CONFIG))
        return path
    if path.is_file():
        _copy(path, scratch / CONFIG)
        return scratch
    found = _cached(spec)
    if not found:
        raise ConfigError(f"--config {spec!r}: no such file or folder, and no model of that name in the Hugging Face "
                          "cache (read offline: ckptio downloads nothing); name a config.json, a model folder holding "
                          "one, or a model you have downloaded")
    for name, where in found.items():
        _copy(where, scratch / name, json=name == CONFIG)
    return scratch


def _copy(src: Path, dest: Path, json: bool = True) -> None:
    """``src`` (a regular file, read bounded through the confined reader) written as ``dest``; a config is checked
    to be a JSON object first."""
    folder = Folder(src.parent)
    data = folder.read_bytes(src.name, max_size=_MAX_BYTES)
    if json:
        json_object(data, src)
    dest.write_bytes(data)


def _cached(name: str) -> dict[str, Path]:
    """The config and tokenizer files of the model ``name`` in the local Hugging Face cache (the cache's own files,
    which its snapshot folder links to), ``{}`` when its ``config.json`` is not there."""
    if name.count("/") > 1 or name.startswith((".", "/")) or not name.strip():
        return {}
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return {}
    found = {}
    for file in _CACHED:
        try:
            where = try_to_load_from_cache(name, file)
        except Exception:  # a name the hub's own checks refuse: not a cached model
            return {}
        if isinstance(where, str):
            found[file] = Path(where).resolve()  # the blob the snapshot's link leads to
    return found if CONFIG in found else {}


def scratch_dir() -> tempfile.TemporaryDirectory:
    """A private folder for the side files taken from a file or the cache, removed after the conversion."""
    return tempfile.TemporaryDirectory(prefix="ckptio-config-")

"""The side files of a model folder: its config, generation config and tokenizer, copied beside the weights.

Every format that writes a whole model (a Hugging Face bundle, sharded safetensors, DCP, a step directory)
carries them over from its source with :func:`copy_extras`; weights, indexes and ckptio's own files are
not side files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..storage.parse import json_object
from .safetensors import fp8_blocks, sharded as safetensors_sharded

if TYPE_CHECKING:
    from ..storage.base import FolderWriter
    from ..storage.confined import Folder

__all__ = ["INDEX_FILE", "copy_extras", "config_with_dtype", "join"]

INDEX_FILE = "model.safetensors.index.json"
"""The index of a Hugging Face bundle: which file holds each tensor."""

_WEIGHT_SUFFIXES = (".safetensors", ".distcp", ".pt", ".pth", ".bin", ".py")
"""Weights, a training run's pickled states (an HF Trainer's ``training_args.bin``, ``rng_state.pth``) and scripts
(DeepSpeed's ``zero_to_fp32.py``): never side files of a model."""
_NOT_EXTRAS = {".metadata", INDEX_FILE, "manifest.json", "latest", "latest_universal", "trainer_state.json"}
"""DCP's metadata, the bundle's index, ckptio's manifest, DeepSpeed's pointers, the HF Trainer's state."""
_MAX_EXTRA_BYTES = 1 << 30


def join(rel: str, name: str) -> str:
    """``name`` inside the folder ``rel`` of a writer (``""``: its top)."""
    return f"{rel}/{name}" if rel else name


def copy_extras(src_dir: "str | Path | Folder", writer: "FolderWriter", rel: str,
                dtype: torch.dtype | None = None) -> dict[str, str]:
    """Copy config, generation config and tokenizer files (every regular file that is not weights) into
    ``rel`` of ``writer``; with ``dtype``, ``config.json`` records the cast (so that
    ``from_pretrained(dtype="auto")`` keeps it); the ``quantization_config`` of a block FP8 release is dropped
    (the weights written are dequantized). Returns the files written with their checksums.

    Only regular files directly inside ``src_dir`` are copied (through the confined folder: a link there
    is skipped, never followed).
    """
    src = safetensors_sharded.as_folder(src_dir)
    written = {}
    for entry in src.listdir():
        name = entry.name
        if entry.kind == "file" and not name.endswith(_WEIGHT_SUFFIXES) and name not in _NOT_EXTRAS \
                and not name.startswith("."):
            data = src.read_bytes(name, max_size=_MAX_EXTRA_BYTES)
            if name == "config.json":
                data = _config_for(data, dtype, src.display(name))
            written[join(rel, name)] = writer.write_bytes(join(rel, name), data)
    return written


def _config_for(data: bytes, dtype: torch.dtype | None, where: object) -> bytes:
    """A source's ``config.json`` for the weights written beside it: the FP8 ``quantization_config`` of a block
    FP8 release goes (ckptio's readers dequantize its weights), and ``dtype`` is recorded when given; the
    bytes are kept as they are when neither applies."""
    config = json_object(data, where)
    plain = fp8_blocks.plain_config(config)
    if plain is not config:
        data = (json.dumps(plain, indent=2, sort_keys=True) + "\n").encode()
    return config_with_dtype(data, dtype, where) if dtype is not None else data


def config_with_dtype(data: bytes, dtype: torch.dtype, where: object) -> bytes:
    """A ``config.json``'s bytes (read from ``where``), recording ``dtype`` as the weights' dtype."""
    config = json_object(data, where)
    name = str(dtype).removeprefix("torch.")
    for key in ("dtype", "torch_dtype"):
        if key in config:
            config[key] = name
    if "dtype" not in config and "torch_dtype" not in config:
        config["dtype"] = name
    return (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()

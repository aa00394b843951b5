"""Start fine-tuning from a Hugging Face model folder on disk, on any number of ranks.

``load_pretrained(model, folder)`` fills a freshly built model — plain, FSDP2-sharded, and/or built on
the ``meta`` device — from ``config.json`` + safetensors (one file or an index). Each rank reads, through
a memory map, only the slices of each tensor it holds, so no rank ever holds the whole model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import _dist
from .._log import get_logger
from ..errors import CheckpointError, CheckpointNotFoundError, require
from ..formats.safetensors import fp8_blocks, sharded as safetensors_sharded
from ..formats.safetensors.hf_bundle import INDEX_FILE
from ..state import ModelState
from ..storage.confined import Folder, check_relative
from ..storage.parse import field, read_json

__all__ = ["load_pretrained"]

_MAX_INDEX_BYTES = 64 * 1024 * 1024


def _weight_files(folder: Folder) -> list[str]:
    """Names of the weight files of a Hugging Face folder: those its index lists, else every ``.safetensors``."""
    if folder.kind(INDEX_FILE) is not None:
        where = folder.display(INDEX_FILE)
        weight_map = field(read_json(folder, INDEX_FILE, max_size=_MAX_INDEX_BYTES), "weight_map", dict, where)
        names = sorted({field(weight_map, key, str, where) for key in weight_map})
        for name in names:
            check_relative(name, folder.display(INDEX_FILE))
        missing = [n for n in names if folder.kind(n) is None]
        if missing:
            raise CheckpointNotFoundError(f"{folder.display(INDEX_FILE)} lists files that do not exist: {missing[:3]}")
        return names
    files = [e.name for e in folder.listdir() if e.name.endswith(".safetensors") and e.kind == "file"]
    if not files:
        raise CheckpointNotFoundError(f"{folder.path} holds no .safetensors weights (nor {INDEX_FILE})")
    return files


def _materialize(model: nn.Module, device: torch.device) -> None:
    """Give a meta-device model real (uninitialised) storage, and recompute non-persistent buffers."""
    model.to_empty(device=device)
    unknown = []
    for name, module in model.named_modules():
        non_persistent: set[str] = getattr(module, "_non_persistent_buffers_set", set())
        if not non_persistent:
            continue
        if hasattr(module, "inv_freq") and hasattr(module, "config") and hasattr(module, "rope_type"):
            _rebuild_rotary(module, device)
        else:
            unknown += [f"{name}.{b}" if name else b for b in sorted(non_persistent)]
    if unknown:
        raise CheckpointError(
            f"non-persistent buffers {unknown[:5]} are not in the checkpoint and cannot be rebuilt after building on "
            "the meta device; initialise them yourself after model.to_empty(), then load with materialize=False"
        )


def _rebuild_rotary(module: Any, device: torch.device) -> None:
    # transformers' rotary embeddings compute inv_freq from the config in __init__; do the same here.
    init: Any
    if module.rope_type == "default":
        init = module.compute_default_rope_parameters
    else:
        ROPE_INIT_FUNCTIONS = require("transformers.modeling_rope_utils", extra="hf",
                                      purpose="rebuilding rotary embeddings").ROPE_INIT_FUNCTIONS

        init = ROPE_INIT_FUNCTIONS[module.rope_type]
    inv_freq, scaling = init(module.config, device=device)
    with torch.no_grad():
        module.inv_freq.copy_(inv_freq)
        if hasattr(module, "original_inv_freq"):
            module.original_inv_freq.copy_(inv_freq)
    module.attention_scaling = scaling


def _peft_base_key(key: str) -> str:
    """``base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight`` -> ``model.layers.0.self_attn.q_proj.weight``."""
    return key.removeprefix("base_model.model.").replace(".base_layer.", ".")


def load_pretrained(model: nn.Module, folder: str | Path, *, strict: bool = True, key_prefix: str = "",
                    device: str | torch.device | None = None) -> None:
    """Load the weights of a Hugging Face folder into ``model`` (collective only through error gathering).

    Args:
        model: built from the same config; may be FSDP2-sharded and may live on the ``meta`` device; may be
            a peft model wrapping such a model (the base weights are filled, adapters keep their init —
            build it on a real device, since adapters created on ``meta`` have no values).
        folder: ``config.json`` plus ``model.safetensors`` or ``model-K-of-N.safetensors`` with an index. A
            block FP8 release (``quantization_config`` ``{"quant_method": "fp8", "weight_block_size": [R, C]}``)
            is dequantized as it is read: ``float32(weight) * weight_scale_inv`` per block, then cast to the
            model's dtype (:mod:`ckptio.formats.safetensors.fp8_blocks`).
        strict: refuse checkpoints with keys the model lacks (missing keys and other shapes always fail).
        key_prefix: outer prefix the model's keys carry but the folder's do not.
        device: where to materialise a meta model (default: CPU, or the current accelerator).
    """
    folder = Path(folder)
    log = get_logger()
    if not folder.is_dir():
        raise CheckpointNotFoundError(f"{folder}: no such pretrained model folder")
    if any(t.is_meta for t in list(model.parameters()) + list(model.buffers())):
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        _materialize(model, torch.device(device))
    state = ModelState(model, key_prefix=key_prefix)
    target = state.state_dict()
    is_peft = hasattr(model, "peft_config")
    model_keys: dict[str, str] = {}  # file key -> model key, for a peft model's frozen base weights
    if is_peft:
        # Fill the base weights (named as in the base model's folder); adapters keep their init.
        trainable = {n.removeprefix(key_prefix) for n, p in model.named_parameters() if p.requires_grad}
        model_keys = {_peft_base_key(k): k for k in target if k not in trainable}
        target = {f: target[k] for f, k in model_keys.items()}
    # a folder the user names: links to regular files are followed (a Hugging Face cache snapshot links
    # into blobs/); everything read still has to be a regular file
    tree = Folder(folder, links=True)
    files = _weight_files(tree)

    def load() -> None:
        blocks = fp8_blocks.read_blocks(tree)  # a block FP8 release is dequantized as it is read
        if blocks is None:
            chunks, infos = safetensors_sharded._scan(tree, files)  # headers only; read again below, cheaply
            fp8_blocks.refuse_undeclared(infos, lambda k: tree.display(next(iter(chunks[k])).file),
                                         tree.display("config.json"))
            safetensors_sharded.load_files(target, tree, files, strict=strict)
        else:
            fp8_blocks.load_files(target, tree, files, blocks, strict=strict)

    _dist.run_collectively(f"loading pretrained weights from {folder}", load)
    if is_peft:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(model, {key_prefix + model_keys[f]: v for f, v in target.items()},
                             options=StateDictOptions(strict=False))
    else:
        state.load_state_dict(target)
    if _dist.rank() == 0:
        log.info("Loaded pretrained weights from %s (%d tensors, %d file(s))", folder, len(target), len(files))

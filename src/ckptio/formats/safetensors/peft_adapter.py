"""PEFT adapter folders: what ``peft.AutoPeftModelForCausalLM.from_pretrained(dir)`` reads.

::

    adapter_config.json          # the PeftConfig, base_model_name_or_path made absolute
    adapter_model.safetensors    # adapter weights only, keyed as peft keys them (no adapter name)
    tokenizer files              # when a tokenizer is given

Adapters are small, so the folder is always consolidated: every rank takes part in gathering the
full adapter tensors, and rank 0 writes the folder. Loading reads, on each rank, only the slices of
each adapter tensor that the rank holds (resharding as the sharded safetensors format does).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ...errors import CheckpointError, CheckpointNotFoundError
from ...storage.confined import Folder
from . import sharded as safetensors_sharded
from ...storage.parse import json_object
from ..registry import Format, Opened, register

if TYPE_CHECKING:
    from ...storage.base import FolderWriter
    from ..registry import ShardContext

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def adapter_name(model: torch.nn.Module) -> str:
    """The active adapter of a peft model (``default`` when it does not say)."""
    name = getattr(model, "active_adapter", None)
    if isinstance(name, (list, tuple)):
        name = name[0] if name else None
    return name if isinstance(name, str) else "default"


def to_peft_key(fqn: str, adapter: str) -> str:
    """``…q_proj.lora_A.default.weight`` -> ``…q_proj.lora_A.weight``, as ``get_peft_model_state_dict`` does."""
    return fqn.replace(f".{adapter}.", ".") if f".{adapter}." in fqn else fqn


def resolve_base_path(model: torch.nn.Module, adapter: str, base_model_path: str | os.PathLike | None) -> str | None:
    """An absolute base model path for adapter_config.json, or ``None`` when none is known.

    ``peft`` loads the base model from this path; offline, a null or relative one cannot be loaded.
    """
    config: Any = model.peft_config[adapter]  # type: ignore[index]
    candidate = base_model_path if base_model_path is not None else config.base_model_name_or_path
    if candidate is None or candidate == "":
        return None
    path = Path(candidate).expanduser()
    if path.exists():
        return str(path.resolve())
    return str(candidate)  # a hub id: kept as the user gave it


def save(folder: str | Path, model: torch.nn.Module, adapter_weights: dict[str, torch.Tensor],
         *, base_model_path: str | os.PathLike | None = None, tokenizer: Any | None = None) -> list[str]:
    """Write the adapter folder into the local folder ``folder`` (rank 0 only; a writer's local path, made
    durable when the step is committed). Returns warnings to log, if any."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    adapter = adapter_name(model)
    warnings: list[str] = []
    base = resolve_base_path(model, adapter, base_model_path)
    config: Any = model.peft_config[adapter]  # type: ignore[index]
    saved_base = config.base_model_name_or_path
    try:
        config.base_model_name_or_path = base
        config.save_pretrained(str(folder))
    finally:
        config.base_model_name_or_path = saved_base
    if base is None:
        warnings.append(
            f"{folder / ADAPTER_CONFIG}: base_model_name_or_path is null, so peft cannot load this adapter by itself; "
            "pass base_model_path= to the CheckpointManager (a local folder of the base model)"
        )
    if getattr(config, "task_type", None) is None:
        warnings.append(
            f"{folder / ADAPTER_CONFIG}: task_type is not set, so peft's AutoPeftModelFor… classes cannot tell which "
            "model class to build; set task_type (e.g. 'CAUSAL_LM') in the LoraConfig"
        )
    save_file(adapter_weights, str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save_pretrained(str(folder))
    return warnings


def load(target: dict[str, torch.Tensor], folder: "str | Path | Folder", adapter: str) -> None:
    """Fill ``target`` (model FQNs -> local tensors of the adapter parameters) from an adapter folder."""
    folder = safetensors_sharded.as_folder(folder)
    if folder.kind(ADAPTER_WEIGHTS) is None:
        raise CheckpointNotFoundError(f"{folder.path} is not a PEFT adapter folder: {ADAPTER_WEIGHTS} is missing")
    renamed = {to_peft_key(k, adapter): v for k, v in target.items()}
    if len(renamed) != len(target):
        raise CheckpointError(f"adapter keys collide after removing the adapter name {adapter!r}")
    safetensors_sharded.load_files(renamed, folder, [ADAPTER_WEIGHTS], strict=True)


def read_config(folder: "str | Path | Folder") -> dict:
    """The adapter folder's ``adapter_config.json``, parsed with a size limit."""
    folder = safetensors_sharded.as_folder(folder)
    return json_object(folder.read_bytes(ADAPTER_CONFIG, max_size=16 << 20), folder.display(ADAPTER_CONFIG))


class PeftAdapter(Format):
    """A PEFT adapter folder: ``adapter_config.json`` + ``adapter_model.safetensors`` (+ tokenizer files).

    Inside a step directory it holds the trainable (adapter) weights of a peft model, gathered whole and
    written by rank 0; ``ShardContext.extra`` carries ``model``, ``tokenizer``, ``base_model_path`` and a
    ``log`` callable for warnings on save, and ``adapter`` (the active adapter's name) on load.
    """

    name = "peft"
    summary = "PEFT adapter folder"
    priority = 40

    def detect(self, path: Path) -> bool:
        return path.is_dir() and (path / ADAPTER_CONFIG).is_file()

    def open(self, path: Path) -> "Opened":
        return Opened(self.name, safetensors_sharded.SafetensorsSource(path, [ADAPTER_WEIGHTS]), path)

    def index(self, folder: Folder) -> dict:
        return dict(safetensors_sharded._scan(folder, [ADAPTER_WEIGHTS])[1])

    def snapshot(self, state_dict: dict, model: Any) -> dict:
        from ..common import full_tensors

        adapter = adapter_name(model)
        return {to_peft_key(k, adapter): v for k, v in full_tensors(state_dict).items()}  # collective under FSDP2

    def save_shards(self, state_dict: dict, writer: "FolderWriter", rel: str, ctx: "ShardContext") -> dict[str, str]:
        from ... import _dist

        extra = ctx.extra

        def write() -> None:
            if ctx.rank == 0:
                for warning in save(writer.local_path(rel), extra["model"], state_dict,
                                    base_model_path=extra.get("base_model_path"), tokenizer=extra.get("tokenizer")):
                    extra.get("log", print)(warning)

        _dist.run_collectively("writing the PEFT adapter", write)
        return {}  # written by libraries: checksummed when the step is committed

    def load_shards(self, target: dict, folder: Folder, *, strict: bool, ctx: "ShardContext") -> None:
        from ... import _dist

        adapter = adapter_name(ctx.extra["model"])
        _dist.run_collectively("loading the PEFT adapter", lambda: load(target, folder, adapter))


register(PeftAdapter())

"""NeMo AutoModel step directories, resumed as they are: a manifest made up from their layout.

AutoModel (0.7) writes ``checkpoint_dir/epoch_{e}_step_{s}/`` with no manifest::

    model/                  shard-0000R-model-…safetensors (offsets in DCP_SHARDING_INFO), or a DCP folder
                            (.metadata + __R_0.distcp), or a PEFT adapter (adapter_model.safetensors), and
                            with save_consolidated a Hugging Face bundle in model/consolidated/
    optim/                  DCP: "optim.*" (the flattened optimizer state) and "sched.*" (the LR scheduler)
    rng/rng_global_rank_R.pt                  per global rank (StatefulRNG)
    dataloader/dataloader_dp_rank_R.pt        per data-parallel rank (StatefulDataLoader)
    step_scheduler.pt, <name>.pt              one file (the layout the NeMo docs show has rng.pt and
                                              dataloader.pt there too)
    losses.json, config.yaml                  train/val loss; the recipe's config

:func:`adopt` describes such a folder with a :class:`~ckptio.manifest.Manifest` (``foreign = "automodel"``) so
that the restore path loads it like a ckptio step: every state through its format, resharded on another
number of ranks. It has no sizes or checksums; what can be checked still is (DCP chunk coverage and the
safetensors headers, by the readers), and retention never deletes such a folder.
"""

from __future__ import annotations

import re
from .errors import CheckpointError
from .storage.parse import json_object
from .manifest import Manifest, StateEntry
from .storage.confined import Folder

__all__ = ["AdoptedManifest", "NAME", "adopt"]

NAME = re.compile(r"epoch_(\d+)_step_(\d+)")
"""AutoModel's step directory names (its recipe's only template)."""

_PER_RANK = re.compile(r"(?P<stem>[\w-]+)_(?P<kind>global|dp)_rank_(?P<rank>\d+)\.pt")
_MAX_LOSSES = 1 << 16


class AdoptedManifest(Manifest):
    """A manifest ckptio made up for a NeMo AutoModel step directory (see :func:`adopt`)."""

    foreign = "automodel"


def _model_entry(folder: Folder) -> tuple[StateEntry, str] | None:
    """The model state of an AutoModel step and its ``model_save_format``; ``None`` without one."""
    if folder.kind("model") != "dir":
        return None
    names = {e.name: e.kind for e in folder.sub("model").listdir()}
    if names.get(".metadata") == "file":
        return StateEntry("model", "dcp", "model"), "torch_save"
    if names.get("adapter_model.safetensors") == "file":
        return StateEntry("model", "peft", "model"), "safetensors"
    if any(n.endswith(".safetensors") and k == "file" for n, k in names.items()):
        return StateEntry("model", "safetensors", "model"), "safetensors"
    if names.get("consolidated") == "dir":  # only the Hugging Face bundle: whole tensors
        return StateEntry("model", "safetensors", "model/consolidated"), "safetensors"
    return None


def _small_states(folder: Folder) -> tuple[dict[str, StateEntry], int]:
    """The ``.pt`` states of an AutoModel step, and the number of ranks its per-rank states were saved on."""
    states: dict[str, StateEntry] = {}
    ranks = 1
    for entry in folder.listdir():
        name = entry.name
        if entry.kind == "file" and name.endswith(".pt") and not name.startswith("."):
            states[name[:-3]] = StateEntry("object", "pt", name)
        elif entry.kind == "dir" and name not in ("model", "optim") and not name.startswith("."):
            found: dict[str, set[int]] = {}
            for item in folder.sub(name).listdir():
                m = _PER_RANK.fullmatch(item.name)
                if item.kind == "file" and m and m.group("stem") == name:
                    found.setdefault(m.group("kind"), set()).add(int(m.group("rank")))
            if not found:
                continue
            kind = "global" if "global" in found else "dp"
            count = len(found[kind])
            if found[kind] != set(range(count)):
                raise CheckpointError(f"{folder.display(name)}: per-rank files for ranks {sorted(found[kind])}, "
                                      f"not 0..{count - 1}")
            states[name] = StateEntry("object", "pt", name, per_rank=True, rank_file=f"{name}_{kind}_rank_{{rank}}.pt")
            ranks = max(ranks, count)
    return states, ranks


def _has_key(folder: Folder, key: str) -> bool:
    """Whether the DCP folder holds values under the top-level ``key``."""
    from .formats.dcp_metadata import read_metadata

    return any(k == key or k.startswith(key + ".") for k in read_metadata(folder).state_dict_metadata)


def _losses(folder: Folder) -> dict[str, float]:
    if folder.kind("losses.json") != "file":
        return {}
    data = json_object(folder.read_bytes("losses.json", max_size=_MAX_LOSSES), folder.display("losses.json"))
    return {k: float(v) for k, v in data.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def _written_by_ckptio(folder: Folder) -> bool:
    """Whether a step directory without a manifest holds what only ckptio writes: its manifest is then lost (a
    damaged ckptio checkpoint, never adopted): ckptio's shard metadata, or the model's config.json beside its
    weights (AutoModel keeps it in .hf_metadata/ or consolidated/)."""
    from .formats._st_reader import SafetensorsFile

    if folder.kind("model") != "dir":
        return False
    model = folder.sub("model")
    entries = [e for e in model.listdir() if e.kind == "file"]
    if any(e.name == "config.json" for e in entries):
        return True
    for e in entries:
        if e.name.endswith(".safetensors") and e.name != "adapter_model.safetensors":
            with SafetensorsFile(model, e.name) as st:
                return "ckptio_format" in st.metadata
    return False


def adopt(folder: Folder, name: str) -> AdoptedManifest | None:
    """A manifest for the AutoModel step directory ``folder`` (named ``name``), or ``None`` when it is not one.

    Raises :class:`~ckptio.errors.CheckpointError` naming the file when it looks like one but is malformed."""
    match = NAME.fullmatch(name)
    if match is None:
        return None
    model = _model_entry(folder)
    has_optim = folder.kind("optim") == "dir" and folder.sub("optim").kind(".metadata") == "file"
    if model is None and not has_optim or _written_by_ckptio(folder):
        return None
    states, ranks = _small_states(folder)
    if model is not None:
        states["model"] = model[0]
    if has_optim:
        states["optim"] = StateEntry("optimizer", "dcp", "optim")
        if "lr_scheduler" not in states and _has_key(folder.sub("optim"), "sched"):
            states["lr_scheduler"] = StateEntry("object", "dcp", "optim", key="sched")  # where AutoModel keeps it
    return AdoptedManifest(name=name, step=int(match.group(2)), epoch=int(match.group(1)), world_size=ranks,
                           model_save_format=model[1] if model else "safetensors", states=states, files={},
                           metrics=_losses(folder), counters={"source_format": "automodel"},
                           is_peft=model is not None and model[0].format == "peft")

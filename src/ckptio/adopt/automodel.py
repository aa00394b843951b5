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

:func:`adopt` describes such a folder with a :class:`~ckptio.engine.manifest.Manifest` (``foreign = "automodel"``) so
that the restore path loads it like a ckptio step: every state through its format, resharded on another
number of ranks. It has no sizes or checksums; what can be checked still is (DCP chunk coverage and the
safetensors headers, by the readers), and retention never deletes such a folder.
"""

from __future__ import annotations

import re
from ..errors import CheckpointError
from ..storage.parse import as_float, as_int, json_object, parsing
from ..engine.manifest import Manifest, StateEntry
from ..storage.confined import Folder

__all__ = ["AdoptedManifest", "NAME", "adopt", "ckptio_mark"]

NAME = re.compile(r"epoch_(\d+)_step_(\d+)")
"""AutoModel's step directory names (its recipe's only template)."""

_PER_RANK = re.compile(r"(?P<stem>[\w-]+)_(?P<kind>global|dp)_rank_(?P<rank>\d+)\.pt")
_MAX_LOSSES = 1 << 16
_MAX_RANK = 1 << 24
_MAX_STEP = (1 << 63) - 1


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
                    rank = as_int(int(m.group("rank")), folder.display(f"{name}/{item.name}"), "the rank", hi=_MAX_RANK)
                    found.setdefault(m.group("kind"), set()).add(rank)
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
    from ..formats.dcp.metadata import read_metadata

    return any(k == key or k.startswith(key + ".") for k in read_metadata(folder).state_dict_metadata)


def _losses(folder: Folder) -> dict[str, float]:
    """The numbers of ``losses.json`` (others, such as a ``null`` validation loss, are left out); a number no float
    holds (a 400-digit integer) is an error naming the file."""
    if folder.kind("losses.json") != "file":
        return {}
    where = folder.display("losses.json")
    data = json_object(folder.read_bytes("losses.json", max_size=_MAX_LOSSES), where)
    return {k: as_float(v, where, repr(k)[:80]) for k, v in data.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}


_OWN_PREFIX = ".ckptio"
"""ckptio's own dot-files (the chunk index ``.ckptio-chunks``, an object store's ``.ckptio-pending``...)."""
_OWN_NAMES = {"values.json"}
"""Files only ckptio writes in a state folder (a safetensors optimizer's non-tensor values)."""


def ckptio_mark(folder: Folder) -> str | None:
    """What in the step directory ``folder`` only ckptio writes (its path relative to ``folder``), or ``None``.

    A step directory holding such a mark but no manifest is a ckptio checkpoint that lost its manifest: damaged,
    never adopted as another tool's folder. The marks: a ``.ckptio*`` file at the top or in any state folder (the
    chunk index of a DCP or safetensors folder, ``model/`` and ``optim/`` alike), ``values.json`` in ``model/`` or
    ``optim/``, safetensors metadata ``ckptio_*`` in their shards, and the model's ``config.json`` beside its
    weights (AutoModel keeps that in ``.hf_metadata/`` or ``consolidated/``). None of these is AutoModel's (0.7)."""
    top = folder.listdir()
    for entry in top:
        if entry.name.startswith(_OWN_PREFIX):
            return entry.name
    for entry in top:
        if entry.kind != "dir" or entry.name.startswith("."):
            continue
        sub = folder.sub(entry.name)
        files = sorted(e.name for e in sub.listdir() if e.kind == "file")
        own = [n for n in files if n.startswith(_OWN_PREFIX)]
        if entry.name in ("model", "optim"):
            own += [n for n in files if n in _OWN_NAMES or n == "config.json" and entry.name == "model"]
            own += [n for n in _first_shard(files) if _ckptio_metadata(sub, n)]
        if own:
            return f"{entry.name}/{own[0]}"
    return None


def _first_shard(files: list[str]) -> list[str]:
    """The first safetensors shard (not a PEFT adapter) of a sorted listing: ckptio marks every shard it writes."""
    return [n for n in files if n.endswith(".safetensors") and n != "adapter_model.safetensors"][:1]


def _ckptio_metadata(folder: Folder, name: str) -> bool:
    from ..formats.safetensors._reader import SafetensorsFile

    with SafetensorsFile(folder, name) as st:
        return any(k.startswith("ckptio_") for k in st.metadata)


def adopt(folder: Folder, name: str) -> AdoptedManifest | None:
    """A manifest for the AutoModel step directory ``folder`` (named ``name``), or ``None`` when it is not one (or
    when ckptio wrote it: see :func:`ckptio_mark`).

    Raises :class:`~ckptio.errors.CheckpointError` naming the file when it looks like one but is malformed."""
    match = NAME.fullmatch(name)
    if match is None:
        return None
    with parsing(folder.display(), "AutoModel step directory"):
        made = _adopted(folder, name, match)
    return made


def _adopted(folder: Folder, name: str, match: "re.Match[str]") -> AdoptedManifest | None:
    model = _model_entry(folder)
    has_optim = folder.kind("optim") == "dir" and folder.sub("optim").kind(".metadata") == "file"
    if model is None and not has_optim or ckptio_mark(folder) is not None:
        return None
    step = as_int(int(match.group(2)), folder.display(), "the step in its name", hi=_MAX_STEP)
    epoch = as_int(int(match.group(1)), folder.display(), "the epoch in its name", hi=_MAX_STEP)
    states, ranks = _small_states(folder)
    if model is not None:
        states["model"] = model[0]
    if has_optim:
        states["optim"] = StateEntry("optimizer", "dcp", "optim")
        if "lr_scheduler" not in states and _has_key(folder.sub("optim"), "sched"):
            states["lr_scheduler"] = StateEntry("object", "dcp", "optim", key="sched")  # where AutoModel keeps it
    return AdoptedManifest(name=name, step=step, epoch=epoch, world_size=ranks,
                           model_save_format=model[1] if model else "safetensors", states=states, files={},
                           metrics=_losses(folder), counters={"source_format": "automodel"},
                           is_peft=model is not None and model[0].format == "peft")

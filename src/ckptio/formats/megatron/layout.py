"""Where a Megatron checkpoint's parts are: its iteration folder, its layout, its rank files, its recorded args.

Shared by the reader (:mod:`ckptio.formats.megatron.format`) and the writer (:mod:`ckptio.formats.megatron.write`):
the file and folder names Megatron-LM and Megatron-Core use, how tensor-parallel ranks split each Llama-style
parameter, and the arguments a run saved with its checkpoints.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ...errors import CheckpointCorruptError, CheckpointError
from ...storage.confined import Folder

__all__ = ["ITERATION_FILE", "RANK_FILE", "GLOBAL_SPLIT", "LAYER_SPLIT", "OPTIONAL", "VOCAB_KEYS", "iteration_folder",
           "layout_of", "run_args"]

ITERATION_FILE = "latest_checkpointed_iteration.txt"
RANK_FILE = "model_optim_rng.pt"
MAX_RANK_FILE_BYTES = 1 << 40
MAX_COMMON_BYTES = 1 << 30
# Megatron-LM: mp_rank_TT[_PPP][_EEE]; NeMo 1.x archives: mp_rank_TT or tp_rank_TT_pp_rank_PPP
_RANK_DIR = re.compile(r"^(?:mp_rank_(\d{2})(?:_(\d{3}))?(_\d{3})?|tp_rank_(\d{2})_pp_rank_(\d{3}))$")
NEMO_RANK_FILE = "model_weights.ckpt"
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# legacy (local spec) names -> the names Megatron-Core's distributed checkpoints use for every spec
_RENAME = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
           "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}
# per-layer parameter -> how tensor parallelism splits it: a dim, "glu" ([gate; up] per shard), None (replicated);
# every one is in every layer but the OPTIONAL ones, present exactly when the run's argument says so
LAYER_SPLIT: dict[str, Any] = {
    "self_attention.linear_qkv.layer_norm_weight": None, "mlp.linear_fc1.layer_norm_weight": None,
    "self_attention.linear_qkv.weight": 0, "self_attention.linear_qkv.bias": 0, "self_attention.linear_proj.weight": 1,
    "self_attention.q_layernorm.weight": None, "self_attention.k_layernorm.weight": None,
    "mlp.linear_fc1.weight": "glu", "mlp.linear_fc2.weight": 1,
}
QKV_BIAS = "self_attention.linear_qkv.bias"
OPTIONAL = {QKV_BIAS: "add_qkv_bias", "self_attention.q_layernorm.weight": "qk_layernorm",
            "self_attention.k_layernorm.weight": "qk_layernorm"}
"""The per-layer parameters a run has only with an argument: the q/k/v bias (Qwen2's ``add_qkv_bias``) and the
per-head query and key norms (Qwen3's ``qk_layernorm``, each of ``kv_channels``, the same on every TP rank)."""
GLOBAL_SPLIT: dict[str, Any] = {"embedding.word_embeddings.weight": 0, "output_layer.weight": 0,
                                "decoder.final_layernorm.weight": None}
VOCAB_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight")


def iteration_folder(path: Path) -> Path:
    """The iteration folder ``path`` designates (through ``latest_checkpointed_iteration.txt`` if present)."""
    if (path / ITERATION_FILE).is_file():
        text = Folder(path).read_text(ITERATION_FILE, max_size=64).strip()
        if text == "release":
            name = "release"
        elif text.isdigit():
            name = f"iter_{int(text):07d}"
        else:
            raise CheckpointCorruptError(f"{path / ITERATION_FILE}: holds {text[:20]!r}, not an iteration or 'release'")
        if Folder(path).kind(name) != "dir":
            raise CheckpointCorruptError(f"{path / ITERATION_FILE} names {name}, which is not a folder in {path}")
        return path / name
    return path


def layout_of(folder: Path) -> str | None:
    """``"legacy"``, ``"dist"`` or ``None`` for an iteration folder (or NeMo 2.0 checkpoint folder)."""
    if not folder.is_dir():
        return None
    if any(_RANK_DIR.match(p.name) and p.is_dir() for p in folder.iterdir()):
        return "legacy"
    if (folder / "metadata.json").is_file() and (folder / "common.pt").is_file():
        return "dist"
    if (folder / "weights" / "metadata.json").is_file() and (folder / "weights" / "common.pt").is_file():
        return "dist"
    return None


def _rank_files(folder: Path) -> dict[tuple[int, int], str]:
    """``(tp, pp) -> rank file``; of expert-parallel rank 0 for a run with expert parallelism (:mod:`.moe`)."""
    from .moe import rank_dirs

    found: dict[tuple[int, int], str] = {}
    root = Folder(folder)
    experts = rank_dirs(folder, RANK_FILE)
    if experts is not None:
        for rank, dirs in experts.items():
            if root.kind(f"{dirs[0]}/{RANK_FILE}") is None:
                raise CheckpointCorruptError(f"{folder / dirs[0]}: holds no {RANK_FILE}")
            found[rank] = f"{dirs[0]}/{RANK_FILE}"
        return found
    for p in root.listdir():
        m = _RANK_DIR.match(p.name)
        if not m or p.kind != "dir":
            continue
        if m.group(3):
            raise CheckpointError(f"{folder / p.name}: expert-parallel checkpoints are not supported")
        rank = (int(m.group(1)), int(m.group(2) or 0)) if m.group(1) else (int(m.group(4)), int(m.group(5)))
        names = [n for n in (RANK_FILE, NEMO_RANK_FILE) if root.kind(f"{p.name}/{n}") is not None]
        if not names:
            raise CheckpointCorruptError(f"{folder / p.name}: holds neither {RANK_FILE} nor {NEMO_RANK_FILE}")
        found[rank] = f"{p.name}/{names[0]}"
    tp = 1 + max(t for t, _ in found)
    pp = 1 + max(s for _, s in found)
    missing = [f"mp_rank_{t:02d}" + (f"_{s:03d}" if pp > 1 else "") for t in range(tp) for s in range(pp)
               if (t, s) not in found]
    if missing:
        raise CheckpointCorruptError(f"{folder}: the rank folders for TP={tp} x PP={pp} are incomplete; missing {missing[:4]}")
    return found


def record_file(path: Path) -> tuple[str, Folder, str] | None:
    """(layout, folder, file) of where the Megatron checkpoint ``path`` (a run or an ``iter_NNNNNNN`` folder)
    records its run (``args``, ``opt_param_scheduler``): a torch_dist ``common.pt`` (``dist``) or the first rank file
    (``legacy``); ``None`` when ``path`` is neither."""
    folder = iteration_folder(path)
    layout = layout_of(folder)
    if layout == "dist":
        return layout, Folder(folder if (folder / "common.pt").is_file() else folder / "weights"), "common.pt"
    if layout == "legacy":
        return layout, Folder(folder), _rank_files(folder)[(0, 0)]
    return None


def run_args(path: Path) -> Any:
    """The Megatron-LM arguments an existing run recorded (``args`` of its newest checkpoint): its TP and PP, its
    vocabulary padding and its model sizes. Read from ``common.pt`` or the first rank file; refused when absent."""
    from .. import safe_pickle as megatron_pickle

    found = record_file(path)
    if found is None:
        raise CheckpointError(f"{path}: not a Megatron run or checkpoint folder (no mp_rank_* folders, no "
                              "metadata.json and common.pt)")
    _, root, rel = found
    obj, _ = megatron_pickle.load(root, rel, max_size=MAX_RANK_FILE_BYTES)
    args = obj.get("args") if isinstance(obj, dict) else None
    if args is None or not hasattr(args, "num_layers"):
        raise CheckpointError(f"{root.display(rel)}: records no Megatron-LM args (a checkpoint written without "
                              "them, e.g. by NeMo); give --tp, --pp and --vocab-divisible-by instead")
    return args


SIDE_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
              "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja")
"""A Hugging Face model's files besides its config and weights: kept at the top of a Megatron run folder ckptio
writes, and carried from there (or from a NeMo 2 checkpoint's ``context/``) when it is read."""


def carry_side_files(run: Path, into: Path) -> None:
    """Copy the :data:`SIDE_FILES` found in ``run`` (or its ``context/``) into ``into``, read through the confined
    folder (regular files only, bounded)."""
    for where in (run, run / "context"):
        if not where.is_dir():
            continue
        folder = Folder(where)
        for name in SIDE_FILES:
            if folder.kind(name) == "file" and not (into / name).exists():
                (into / name).write_bytes(folder.read_bytes(name, max_size=256 << 20))

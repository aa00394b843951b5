"""Mixtures of experts in Megatron checkpoints: Megatron-Core's MoE GPT layers, read and written as Hugging Face Mixtral.

A Megatron-Core MoE layer (``--num-experts E --moe-router-topk K``, SequentialMLP experts, ``moe_grouped_gemm`` off)
holds, in place of the dense ``mlp.linear_fc1``/``linear_fc2``:

* ``mlp.router.weight`` [E, hidden], the same on every tensor-parallel rank;
* each expert's SwiGLU MLP, ``[gate; up]`` in ``linear_fc1`` and ``linear_fc2``, split over tensor-parallel ranks
  as the dense ones are (expert tensor parallelism equal to TP).

Where they are: a legacy rank file (``mp_rank_TT[_PPP][_EEE]``, the expert-parallel rank last, only when EP > 1)
holds its EP rank's ``mlp.experts.local_experts.{l}.linear_fc1.weight``, expert ``e * E/EP + l`` of the model;
every EP rank repeats the rest. A torch_dist checkpoint stacks the experts after the layers:
``decoder.layers.mlp.experts.experts.linear_fc1.weight`` [layers, E, 2 ffn, hidden]. Both become
``decoder.layers.{i}.mlp.experts.{j}.linear_fc1.weight`` (global expert ``j``), which the ``megatron-to-mixtral``
naming converter makes Mixtral's ``block_sparse_moe.experts.{j}.w1``/``w3`` (gate, up) and ``w2``.

The routing is Mixtral's exactly when Megatron computes softmax over the top-k logits (``moe_router_pre_softmax``
off, ``moe_router_score_function`` softmax), which equals softmax over all experts then top-k renormalised, with no
scaling, no token dropping, no group-limited routing and no input jitter; :mod:`.fields` refuses every other value by
name. A run with a gated shared expert (and Qwen2's q/k/v biases) is a Qwen2-MoE instead (:mod:`.qwen2moe`), whose
shared expert's parameters are per layer like the router's; one with q/k norms (``qk_layernorm``) a Qwen3-MoE.
"""

from __future__ import annotations

import re
from typing import Any, Callable

import torch

from ...errors import CheckpointCorruptError, CheckpointError
from ...storage.confined import Folder
from .fields import _arg
from .qwen2moe import SHARED_MODULES, SHARED_SPLIT, qwen3, shared_of

ROUTER = "mlp.router.weight"
EXPERT_SPLIT = {"linear_fc1.weight": "glu", "linear_fc2.weight": 1}
"""How tensor parallelism splits each expert's parameters (as the dense MLP's)."""
_EXPERT = re.compile(r"^mlp\.experts\.(?:local_experts\.)?(\d+)\.(linear_fc[12]\.weight)$")
_LOCAL = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts\.local_experts\.)(\d+)(\..+)$")
_DIST = {f"mlp.experts.experts.{p}": p for p in EXPERT_SPLIT}
_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")


def experts_of(args: Any) -> int:
    """The run's number of experts (Megatron-LM's ``num_experts``, Megatron-Core's ``num_moe_experts``), 0 if dense."""
    value = _arg(args, "num_experts", None) or _arg(args, "num_moe_experts", None)
    return int(value) if isinstance(value, int) else 0


def kind(suffix: str) -> tuple[str, Any] | None:
    """(name, split) of a per-layer MoE parameter (after ``decoder.layers.{i}.``), ``None`` for another."""
    if suffix == ROUTER:
        return ROUTER, None
    if suffix in SHARED_SPLIT:  # a Qwen2-MoE's shared expert
        return suffix, SHARED_SPLIT[suffix]
    m = _EXPERT.match(suffix)
    return (f"mlp.experts.{int(m.group(1))}.{m.group(2)}", EXPERT_SPLIT[m.group(2)]) if m else None


def per_layer(suffix: str) -> bool:
    """Whether a torch_dist key (after ``decoder.layers.``) is an MoE parameter stacked over the layers only: the router
    and a shared expert's parameters."""
    return suffix == ROUTER or suffix in SHARED_SPLIT


def dist_key(suffix: str) -> str | None:
    """The expert parameter a torch_dist key (after ``decoder.layers.``) stacks over layers and experts, or ``None``."""
    return _DIST.get(suffix)


# ------------------------------------------------------------------------------------------------ legacy files
def rank_dirs(folder: Any, rank_file: str) -> dict[tuple[int, int], list[str]] | None:
    """``(tp, pp) -> [rank folder of each EP rank]`` of a legacy iteration folder saved with expert parallelism;
    ``None`` without it.

    Megatron-LM appends the EP rank to ``mp_rank_TT`` or ``mp_rank_TT_PPP``: ``mp_rank_00_001`` is EP rank 1 of a
    run without pipeline stages, or stage 1 of one without EP. The run's own arguments decide (those of
    ``mp_rank_00_000``, which both have)."""
    root = Folder(folder)
    names: dict[str, re.Match[str]] = {}
    for p in root.listdir():
        m = _DIR.match(p.name) if p.kind == "dir" else None
        if m is not None:
            names[p.name] = m
    if not names:
        return None
    three = any(m.group(3) for m in names.values())
    if not three:
        if "mp_rank_00_000" not in names or not _ep_without_pp(root, f"mp_rank_00_000/{rank_file}"):
            return None
    found: dict[tuple[int, int, int], str] = {}
    for name, m in names.items():
        if three != bool(m.group(3)) or m.group(2) is None:
            raise CheckpointCorruptError(f"{root.display(name)}: not named like the other rank folders of an "
                                         "expert-parallel run (mp_rank_TT[_PPP]_EEE)")
        t, s, e = (int(m.group(1)), int(m.group(2)), int(m.group(3))) if three else \
            (int(m.group(1)), 0, int(m.group(2)))
        found[(t, s, e)] = name
    tp, pp, ep = (1 + max(k[n] for k in found) for n in range(3))
    missing = [(t, s, e) for t in range(tp) for s in range(pp) for e in range(ep) if (t, s, e) not in found]
    if missing:
        raise CheckpointCorruptError(f"{root.display()}: the rank folders for TP={tp} x PP={pp} x EP={ep} are "
                                     f"incomplete; missing (tp, pp, ep) {missing[:4]}")
    return {(t, s): [found[(t, s, e)] for e in range(ep)] for t in range(tp) for s in range(pp)}


def _ep_without_pp(root: Folder, rel: str) -> bool:
    from .. import safe_pickle as megatron_pickle

    if root.kind(rel) is None:
        return False
    obj, _, handle = megatron_pickle.open_lazy(root, rel)
    handle.close()
    args = obj.get("args") if isinstance(obj, dict) else None
    ep, pp = _arg(args, "expert_model_parallel_size", 1), _arg(args, "pipeline_model_parallel_size", 1)
    return isinstance(ep, int) and ep > 1 and pp in (1, None)


def rank_model(root: Folder, rels: list[str], read: Callable[[Folder, str], tuple[dict[str, Any], list[str],
               dict[str, torch.Tensor]]], args_check: Callable[[Any], None] | None = None,
               held_in: dict[str, str] | None = None) -> tuple[dict[str, Any], list[str], dict[str, torch.Tensor]]:
    """One (TP, PP) rank's model over its EP ranks' files ``rels``: the shared parameters of EP rank 0, each rank's
    local experts under their global index (EP rank ``e``'s local ``l`` is ``e * local + l``); ``held_in`` gets
    the file of ``rels`` each of an expert's parameters was read from."""
    obj, placeholders, model = read(root, rels[0])
    local = _local_count(model, root.display(rels[0]))
    ep = _arg_ep(obj)
    if ep is not None and ep != len(rels):
        raise CheckpointCorruptError(f"{root.display(rels[0])}: the run's expert_model_parallel_size is {ep}, but "
                                     f"its rank folders are for {len(rels)}")
    merged = {k: v for k, v in model.items() if not _LOCAL.match(k)}
    names = set(merged)
    for e, rel in enumerate(rels):
        part = model if e == 0 else read(root, rel)[2]
        where = root.display(rel)
        if _local_count(part, where) != local:
            raise CheckpointCorruptError(f"{where}: holds another number of experts than {root.display(rels[0])}")
        shared = {k for k in part if not _LOCAL.match(k)}
        if shared != names:
            raise CheckpointCorruptError(f"{where}: holds other shared parameters than {root.display(rels[0])}: "
                                         f"{sorted(shared ^ names)[:3]}")
        for key, value in part.items():
            m = _LOCAL.match(key)
            if m:
                key = f"{m.group(1)[:-len('local_experts.')]}{e * local + int(m.group(2))}{m.group(3)}"
                merged[key] = value
                if held_in is not None:
                    held_in[key] = rel
    return obj, placeholders, merged


def rank_models(root: Folder, rels: list[str], read: Callable[[Folder, str], tuple[dict[str, Any], list[str],
                list[dict[str, torch.Tensor]]]], held_in: list[dict[str, str]] | None = None
                ) -> tuple[dict[str, Any], list[str], list[dict[str, torch.Tensor]]]:
    """:func:`rank_model` with a reader of every model chunk of a rank file: each chunk (virtual pipeline stage)
    merged over the EP ranks' files, which must hold as many chunks as EP rank 0's (each file read once): a
    Mixtral's, a Qwen2-MoE's or a Qwen3-MoE's (each tested against megatron-core), whose shared expert, biases and
    q/k norms are per layer like the router's. ``held_in`` gets each chunk's files of the experts' parameters."""
    held: dict[str, tuple[dict[str, Any], list[str], list[dict[str, torch.Tensor]]]] = {}

    def chunks(folder: Folder, rel: str) -> tuple[dict[str, Any], list[str], list[dict[str, torch.Tensor]]]:
        if rel not in held:
            held[rel] = read(folder, rel)
        return held[rel]

    obj, placeholders, first = chunks(root, rels[0])
    models = []
    for v in range(len(first)):
        def one(folder: Folder, rel: str, v: int = v) -> tuple[dict[str, Any], list[str], dict[str, torch.Tensor]]:
            got, marks, models = chunks(folder, rel)
            if len(models) != len(first):
                raise CheckpointCorruptError(f"{folder.display(rel)}: holds {len(models)} model chunk(s), "
                                             f"{folder.display(rels[0])} {len(first)}")
            return got, marks, models[v]

        if held_in is not None:
            held_in.append({})
        models.append(rank_model(root, rels, one, held_in=held_in[-1] if held_in is not None else None)[2])
    return obj, placeholders, models


def _arg_ep(obj: dict[str, Any]) -> int | None:
    value = _arg(obj.get("args"), "expert_model_parallel_size", None)
    return value if isinstance(value, int) else None


def _local_count(model: dict[str, torch.Tensor], where: object) -> int:
    held = {int(m.group(2)) for m in map(_LOCAL.match, model) if m}
    if held and held != set(range(len(held))):
        raise CheckpointCorruptError(f"{where}: its local experts are numbered {sorted(held)[:6]}, not from 0 on")
    return len(held)


# ------------------------------------------------------------------------------------------------ checks
def check(index: dict[str, Any], args: Any, layers: int, where: object) -> None:
    """Every layer holds the router and the run's every expert, and a dense run none of them (nor a dense MLP in an
    MoE run): what the run's ``num_experts`` says."""
    experts = experts_of(args)
    routers = sum(k.endswith("." + ROUTER) for k in index)
    held = {k for k in index if ".mlp.experts." in k}
    dense = sum(k.endswith(".mlp.linear_fc1.weight") for k in index)
    if experts == 0 and not (routers or held):
        return
    want = {f"decoder.layers.{i}.mlp.experts.{j}.{p}" for i in range(layers) for j in range(experts)
            for p in EXPERT_SPLIT}
    if routers != (layers if experts else 0) or held != want or dense:
        extra = sorted(held ^ want)[:3]
        raise CheckpointCorruptError(f"{where}: {routers} of its {layers} layers hold a router and {dense} a dense MLP, "
                                     f"but the run's num_experts={experts or None!r}"
                                     + (f" (expert weights missing or extra: {extra})" if extra else ""))
    shared = {k for k in index if ".mlp.shared_experts." in k}
    want = {f"decoder.layers.{i}.{p}" for i in range(layers) for p in SHARED_SPLIT} if shared_of(args) else set()
    if shared != want:
        raise CheckpointCorruptError(f"{where}: the run's moe_shared_expert_intermediate_size="
                                     f"{shared_of(args) or None!r}, but its shared-expert weights missing or extra "
                                     f"are {sorted(shared ^ want)[:3]}")


def shape_check(config: dict[str, Any]) -> None:
    """A Mixtral config's expert counts are whole numbers (the conversion builds its names from them)."""
    for name in ("num_local_experts", "num_experts_per_tok"):
        value = config.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise CheckpointError(f"config.json: {name} = {value!r}; a Mixtral needs a positive integer")
    if config["num_experts_per_tok"] > config["num_local_experts"]:
        raise CheckpointError(f"config.json: num_experts_per_tok ({config['num_experts_per_tok']}) is more than "
                              f"num_local_experts ({config['num_local_experts']})")


def hf_fields(args: Any, where: object) -> dict[str, Any]:
    """The Mixtral config fields of a Megatron MoE run: ``num_local_experts`` (``num_experts``),
    ``num_experts_per_tok`` (``moe_router_topk``), ``intermediate_size`` (each expert's: ``moe_ffn_hidden_size``,
    else ``ffn_hidden_size``), ``router_aux_loss_coef`` (``moe_aux_loss_coeff``, training only), full attention and
    no router jitter (Megatron's jitter is ``moe_input_jitter_eps``, refused)."""
    experts, topk = experts_of(args), _arg(args, "moe_router_topk", None) or 2
    if not isinstance(topk, int) or isinstance(topk, bool) or not 1 <= topk <= experts:
        raise CheckpointError(f"{where}: moe_router_topk={topk!r} for {experts} experts")
    ffn = _arg(args, "moe_ffn_hidden_size", None) or _arg(args, "ffn_hidden_size", None)
    aux = _arg(args, "moe_aux_loss_coeff", None)
    mixtral = {"num_local_experts": experts, "num_experts_per_tok": topk, "intermediate_size": ffn,
               "router_aux_loss_coef": float(aux) if isinstance(aux, (int, float)) and not isinstance(aux, bool)
               else 0.0, "output_router_logits": False, "router_jitter_noise": 0.0, "sliding_window": None}
    if shared_of(args) or qwen3(args):  # a Qwen2-/Qwen3-MoE (intermediate_size stays the run's ffn_hidden_size)
        from . import qwen2moe

        return qwen2moe.hf_fields(args, where, mixtral)
    return mixtral


def check_legacy(args: Any, tp: int, where: object) -> None:
    """A legacy MoE checkpoint is read when its experts are split over the tensor-parallel ranks as the rest is:
    expert tensor parallelism other than TP (``expert_tensor_parallel_size``, ``moe_extended_tp``) is refused."""
    if not experts_of(args):
        return
    etp = _arg(args, "expert_tensor_parallel_size", None)
    if etp not in (None, tp) or _arg(args, "moe_extended_tp", False):
        raise CheckpointError(f"{where}: expert_tensor_parallel_size={etp!r} with tensor_model_parallel_size={tp} "
                              "(expert tensor parallelism other than TP) is not read from legacy files; convert a "
                              "torch_dist checkpoint of the run instead")


# ------------------------------------------------------------------------------------------------ the writer
def megatron_args(config: dict[str, Any], tp: int) -> dict[str, Any]:
    """Megatron-LM's MoE arguments for a Mixtral ``config`` (none for a dense model): its experts, routed as Mixtral
    routes (softmax over the top-k logits, no dropping), SequentialMLP experts without expert parallelism."""
    if config.get("model_type") in ("qwen2_moe", "qwen3_moe"):
        from . import qwen2moe

        return qwen2moe.megatron_args(config, tp)
    if config.get("model_type") != "mixtral":
        return {}
    shape_check(config)
    aux = config.get("router_aux_loss_coef", 0.0)
    return {"num_experts": config["num_local_experts"], "moe_router_topk": config["num_experts_per_tok"],
            "moe_ffn_hidden_size": int(config["intermediate_size"]), "moe_layer_freq": 1, "moe_grouped_gemm": False,
            "moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": float(aux or 0.0),
            "moe_router_score_function": "softmax", "moe_router_pre_softmax": False,
            "moe_router_topk_scaling_factor": None, "moe_expert_capacity_factor": None,
            "moe_token_dispatcher_type": "allgather", "expert_model_parallel_size": 1,
            "expert_tensor_parallel_size": tp}


def suffixes(args: Any, dense: list[str]) -> list[str]:
    """The per-layer parameters besides the experts': an MoE run's router (and shared expert) in place of the dense
    MLP."""
    if not experts_of(args):
        return dense
    return [s for s in dense if s not in ("mlp.linear_fc1.weight", "mlp.linear_fc2.weight")] + [ROUTER] + (
        list(SHARED_SPLIT) if shared_of(args) else [])


def extra_state_modules(args: Any, dense: tuple[str, ...]) -> tuple[str, ...]:
    """The modules whose ``_extra_state`` every layer holds: an MoE layer has no dense MLP (its experts' are apart)."""
    if not experts_of(args):
        return dense
    return tuple(m for m in dense if not m.startswith("mlp.")) + (SHARED_MODULES if shared_of(args) else ())


def dist_experts(tensors: dict[str, torch.Tensor], args: Any) -> dict[str, Any]:
    """The experts as Megatron-Core's torch_dist stacks them: [layers, experts, ...] per parameter, and the
    ``_extra_state`` of each expert's linear layers (``shard_{layer}.{expert}_{layers}.{experts}``)."""
    experts, layers = experts_of(args), args.num_layers
    state: dict[str, Any] = {}
    if not experts:
        return state
    for part in EXPERT_SPLIT:
        state[f"decoder.layers.mlp.experts.experts.{part}"] = torch.stack([torch.stack([
            tensors[f"decoder.layers.{i}.mlp.experts.{j}.{part}"] for j in range(experts)]) for i in range(layers)])
        for i in range(layers):
            for j in range(experts):
                state[f"decoder.layers.mlp.experts.experts.{part.rsplit('.', 1)[0]}._extra_state/"
                      f"shard_{i}.{j}_{layers}.{experts}"] = [None]
    return state


def legacy_experts(shards: list[dict[str, Any]], tensors: dict[str, torch.Tensor], args: Any, i: int, local: int,
                   split: Callable[[torch.Tensor, Any, int], list[torch.Tensor]]) -> None:
    """Layer ``i``'s experts into each TP rank's legacy ``shards`` (no expert parallelism: every expert local)."""
    for j in range(experts_of(args)):
        for part, how in EXPERT_SPLIT.items():
            name = f"decoder.layers.{local}.mlp.experts.local_experts.{j}.{part}"
            for t, piece in enumerate(split(tensors[f"decoder.layers.{i}.mlp.experts.{j}.{part}"], how, len(shards))):
                shards[t][name] = piece.clone()
                shards[t][name.rsplit(".", 1)[0] + "._extra_state"] = None

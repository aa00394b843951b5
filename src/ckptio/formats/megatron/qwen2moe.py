"""Qwen2-MoE in Megatron checkpoints: Megatron-Core's MoE layer with a gated shared expert, read and written as
Hugging Face ``Qwen2MoeForCausalLM``.

A Qwen2-MoE layer is a Mixtral-style mixture of experts (:mod:`.moe`: the router, E SwiGLU experts of
``moe_intermediate_size``, K per token) plus a shared expert that every token goes through, a SwiGLU MLP of
``shared_expert_intermediate_size`` whose output is scaled by ``sigmoid(shared_expert_gate(x))``, and Qwen2's biases
on the query/key/value projection. Megatron-Core computes the same with ``--moe-shared-expert-intermediate-size S
--moe-shared-expert-gate --add-qkv-bias`` (megatron-core 0.16.1's ``SharedExpertMLP``): per layer
``mlp.shared_experts.linear_fc1.weight`` (``[gate; up]``, split over TP as a dense ``linear_fc1``),
``mlp.shared_experts.linear_fc2.weight`` (split along dim 1) and ``mlp.shared_experts.gate_weight`` [1, hidden]
(the same on every rank; it is not an expert, so each expert-parallel rank holds it). torch_dist stacks them over the
layers like the other per-layer parameters.

The routing: Qwen2-MoE takes the softmax over all experts then the top-k, renormalised only with ``norm_topk_prob``;
Megatron's ``moe_router_pre_softmax`` is that softmax before the top-k without renormalisation, and without it
Megatron takes the softmax of the top-k logits (= renormalised). So ``norm_topk_prob = not
moe_router_pre_softmax``, both ways. Every other routing argument is refused as for Mixtral (:mod:`.fields`).

Qwen3-MoE (``Qwen3MoeForCausalLM``) is the same mixture without the shared expert and without biases, with Qwen3's
RMSNorm on each query and key head: Megatron's MoE arguments with ``--qk-layernorm`` (``q_layernorm``/``k_layernorm``
per layer, as a dense Qwen3's), routed by ``norm_topk_prob`` as above. Its experts are saved under Qwen2-MoE's names,
so the ``qwen2moe-to-megatron`` naming converts both. The functions here take either family.
"""

from __future__ import annotations

from typing import Any

from ...errors import CheckpointError, ConfigError
from .fields import _arg

__all__ = ["SHARED_SPLIT", "shared_of", "qwen3", "problems", "hf_fields", "experts_field", "megatron_args",
           "shape_check"]

SHARED_SPLIT = {"mlp.shared_experts.linear_fc1.weight": "glu", "mlp.shared_experts.linear_fc2.weight": 1,
                "mlp.shared_experts.gate_weight": None}
"""The shared expert's per-layer parameters and how tensor parallelism splits each."""
SHARED_MODULES = ("mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2")
"""Its linear layers, each with an ``_extra_state`` megatron-core's strict load asks for."""


def shared_of(args: Any) -> int:
    """The size of the run's shared expert (``moe_shared_expert_intermediate_size``), 0 without one."""
    value = _arg(args, "moe_shared_expert_intermediate_size", None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def qwen3(args: Any) -> bool:
    """Whether an MoE run's ``args`` are a Qwen3-MoE's: query/key norms (``qk_layernorm``) and no shared expert."""
    return bool(_arg(args, "qk_layernorm", False)) and not shared_of(args)


def problems(args: Any, experts: int) -> list[str]:
    """What in an MoE run's ``args`` no Mixtral, Qwen2-MoE or Qwen3-MoE computes, each named by its argument: query/key
    norms with a shared expert or with q/k/v biases, Qwen2's q/k/v biases without a shared expert, a shared expert
    without Qwen2's biases or without its sigmoid gate."""
    if not experts:
        return []
    out = []
    shared, bias, norms = shared_of(args), _arg(args, "add_qkv_bias", False), _arg(args, "qk_layernorm", False)
    if norms and (shared or bias) or bias and not shared:
        out.append("experts with qk_layernorm or add_qkv_bias (a Qwen MoE: Mixtral's experts, Qwen2-MoE's with "
                   "a gated shared expert and add_qkv_bias, or Qwen3-MoE's with qk_layernorm and neither, are "
                   "mapped)")
    if shared and not bias:
        out.append(f"moe_shared_expert_intermediate_size={shared} (shared experts, a Qwen2-MoE's) without add_qkv_bias "
                   "(a Qwen2-MoE's q/k/v projections have biases)")
    gate = _arg(args, "moe_shared_expert_gate", False)
    if shared and gate is not True:
        out.append(f"moe_shared_expert_gate={gate!r} (a shared expert without Qwen2-MoE's sigmoid gate)")
    return out


def hf_fields(args: Any, where: object, moe: dict[str, Any]) -> dict[str, Any]:
    """The Qwen2-MoE config fields of a Megatron run with a gated shared expert (Qwen2's q/k/v biases), or the
    Qwen3-MoE ones of a run with q/k norms and no shared expert (no biases), from ``moe`` (the Mixtral fields
    :func:`.moe.hf_fields` gives): every layer sparse, routed by ``norm_topk_prob``."""
    pre = _arg(args, "moe_router_pre_softmax", False)
    if not isinstance(pre, bool) and pre is not None:
        raise CheckpointError(f"{where}: moe_router_pre_softmax={pre!r}, not true or false")
    family = {"shared_expert_intermediate_size": shared_of(args), "qkv_bias": True} if shared_of(args) else \
        {"attention_bias": False}
    return {"num_experts": moe["num_local_experts"], "num_experts_per_tok": moe["num_experts_per_tok"],
            "moe_intermediate_size": moe["intermediate_size"], "norm_topk_prob": not pre,
            "router_aux_loss_coef": moe["router_aux_loss_coef"], "output_router_logits": False,
            "decoder_sparse_step": 1, "mlp_only_layers": [], **family}


def experts_field(config: dict[str, Any]) -> str:
    """The field of a Qwen MoE config that counts its experts: ``num_experts``, or for a Qwen3-MoE saved by transformers
    5 (which maps that name to Mixtral's) ``num_local_experts``; a config giving both, different, is refused."""
    if config.get("model_type") != "qwen3_moe" or "num_local_experts" not in config:
        return "num_experts"
    if "num_experts" in config and config["num_experts"] != config["num_local_experts"]:
        raise CheckpointError(f"config.json: num_experts = {config['num_experts']!r} and num_local_experts = "
                              f"{config['num_local_experts']!r}; a Qwen3-MoE has one number of experts")
    return "num_local_experts"


def shape_check(config: dict[str, Any]) -> None:
    """A Qwen MoE config's expert counts and sizes are whole numbers, ``norm_topk_prob`` true or false."""
    kind = "Qwen3-MoE" if config.get("model_type") == "qwen3_moe" else "Qwen2-MoE"
    count = experts_field(config)
    for name in (count, "num_experts_per_tok", "moe_intermediate_size",
                 *(("shared_expert_intermediate_size",) if kind == "Qwen2-MoE" else ())):
        value = config.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise CheckpointError(f"config.json: {name} = {value!r}; a {kind} needs a positive integer")
    if config["num_experts_per_tok"] > config[count]:
        raise CheckpointError(f"config.json: num_experts_per_tok ({config['num_experts_per_tok']}) is more than "
                              f"{count} ({config[count]})")
    if not isinstance(config.get("norm_topk_prob", False), bool):
        raise CheckpointError(f"config.json: norm_topk_prob = {config['norm_topk_prob']!r}, not true or false")


def megatron_args(config: dict[str, Any], tp: int) -> dict[str, Any]:
    """Megatron-LM's MoE arguments for a Qwen2-MoE or Qwen3-MoE ``config``: its experts (and a Qwen2-MoE's gated shared
    expert), routed as it routes (``moe_router_pre_softmax`` = not ``norm_topk_prob``), SequentialMLP experts without
    expert parallelism."""
    shape_check(config)
    shared = config.get("model_type") != "qwen3_moe"
    sizes = {k: int(config[k]) for k in ("moe_intermediate_size", "shared_expert_intermediate_size")[:1 + shared]}
    odd = [f"{k} ({n}) is not divisible by {tp}" for k, n in sizes.items() if n % tp]
    if odd:
        raise ConfigError(f"cannot split this model for TP={tp}: " + "; ".join(odd))
    aux = config.get("router_aux_loss_coef", 0.0)
    return {"num_experts": config[experts_field(config)], "moe_router_topk": config["num_experts_per_tok"],
            "moe_ffn_hidden_size": sizes["moe_intermediate_size"], **({
                "moe_shared_expert_intermediate_size": sizes["shared_expert_intermediate_size"],
                "moe_shared_expert_gate": True} if shared else {}), "moe_layer_freq": 1, "moe_grouped_gemm": False,
            "moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": float(aux or 0.0),
            "moe_router_score_function": "softmax", "moe_router_pre_softmax": not config.get("norm_topk_prob", False),
            "moe_router_topk_scaling_factor": None, "moe_expert_capacity_factor": None,
            "moe_token_dispatcher_type": "allgather", "expert_model_parallel_size": 1,
            "expert_tensor_parallel_size": tp}

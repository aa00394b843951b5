"""The model configuration of a Megatron checkpoint: its ``args``, a NeMo config, or a Hugging Face config.

Megatron-LM checkpoints carry the run's ``args`` (an ``argparse.Namespace``). Others do not, and the
sizes are found beside the weights instead: NeMo 1.x archives in ``model_config.yaml`` (:func:`nemo_args`),
NeMo 2.0 checkpoints in ``context/model.yaml`` (the model's config under ``config:``, Megatron-Core
``TransformerConfig`` names), or a Hugging Face ``config.json``. All become Megatron-LM argument names,
and :func:`hf_config` turns those into the Hugging Face config of the converted model: a Llama, a Qwen2 when
the run has biases on its query/key/value projection only (``add_qkv_bias``), or a Qwen3 when it normalises each
query and key head (``qk_layernorm``; :func:`family`), or with experts a Mixtral, a Qwen2-MoE or a Qwen3-MoE.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ...errors import CheckpointError
from ..hf_fields import DEFAULT_THETA, MEGATRON_TYPES, Rope, dtype_name, refuse_type, rope, rope_config
from .fields import MUST, _arg, refused


FAMILIES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
            "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
"""The Hugging Face model types a Megatron GPT run converts to, with their classes."""


def family(args: Any) -> str:
    """``qwen2`` for a run with biases on the query/key/value projection (Megatron-LM's ``--add-qkv-bias``, which
    is how Megatron trains Qwen2/2.5), ``qwen3`` for one with an RMSNorm on each query and key head
    (``--qk-layernorm``, how it trains Qwen3), else ``llama``; with experts ``qwen2_moe`` when they have a shared expert
    (:mod:`.qwen2moe`), ``qwen3_moe`` with q/k norms, else ``mixtral``; what none computes is refused by
    :func:`hf_config`."""
    from .moe import experts_of
    from .qwen2moe import qwen3, shared_of

    if experts_of(args):  # a mixture of experts: a Qwen2-MoE with a (gated) shared expert, a Qwen3-MoE with q/k norms
        return "qwen2_moe" if shared_of(args) else "qwen3_moe" if qwen3(args) else "mixtral"
    if _arg(args, "qk_layernorm", False):
        return "qwen3"
    return "qwen2" if _arg(args, "add_qkv_bias", False) else "llama"


def _not_llama(args: Any) -> list[str]:
    """What in ``args`` no Hugging Face Llama, Qwen2 or Qwen3 computes, each named by its Megatron-LM argument."""
    problems = []
    if _arg(args, "normalization", "RMSNorm") != "RMSNorm":
        problems.append(f"normalization={_arg(args, 'normalization')}")
    if not _arg(args, "swiglu", True):
        problems.append("no SwiGLU")
    if _arg(args, "position_embedding_type", "rope") != "rope":
        problems.append(f"position_embedding_type={_arg(args, 'position_embedding_type')}")
    if _arg(args, "add_bias_linear", False):
        problems.append("linear biases (add_bias_linear=True)")
    if _arg(args, "qk_layernorm", False) and _arg(args, "add_qkv_bias", False):  # a Qwen3's biases are on q/k/v/o
        problems.append("qk_layernorm with add_qkv_bias (Qwen3's norms with Qwen2's biases)")
    from .moe import experts_of
    from .qwen2moe import problems as moe_problems

    problems += moe_problems(args, experts_of(args))  # q/k norms, biases without a gated shared expert...
    if _arg(args, "rotary_interleaved", False):
        problems.append("interleaved rotary embeddings")
    if _arg(args, "rotary_percent", None) not in (None, 1, 1.0):
        problems.append(f"rotary_percent={_arg(args, 'rotary_percent')} (a partial rotary embedding)")
    if _arg(args, "rotary_seq_len_interpolation_factor", None) not in (None, 1, 1.0):
        problems.append(f"rotary_seq_len_interpolation_factor={_arg(args, 'rotary_seq_len_interpolation_factor')}")
    return problems + refused(args)  # every other argument that changes the computation (.fields places them all)


# Megatron-Core's Llama 3.1 RoPE scaling (RotaryEmbedding._apply_scaling): only the factor is an argument
_MCORE_LLAMA3 = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _rope(args: Any, where: object) -> Any:
    """The rotary embedding of a Megatron run: ``rotary_base``, and a scaling given as a Hugging Face-style
    mapping (``rope_scaling``, from a NeMo config) or as Megatron-LM's ``--use-rope-scaling`` (Llama 3.1)."""
    theta = float(_arg(args, "rotary_base", None) or DEFAULT_THETA)
    scaling = _arg(args, "rope_scaling")
    if isinstance(scaling, dict) and scaling:
        kind = scaling.get("rope_type", scaling.get("type"))
        if not isinstance(kind, str):
            raise CheckpointError(f"{where}: rope_scaling {scaling!r:.120} names no rope_type")
        rest = {k: v for k, v in scaling.items() if k not in ("rope_type", "type", "rope_theta")}
        return Rope(theta=theta, kind=kind, scaling=rest)
    if scaling is True or _arg(args, "use_rope_scaling", False):
        factor = float(_arg(args, "rope_scaling_factor", None) or 8.0)
        return Rope(theta=theta, kind="llama3", scaling={"factor": factor, **_MCORE_LLAMA3})
    return Rope(theta=theta)


def hf_config(args: Any, where: object, layers: int, vocab_rows: int) -> dict[str, Any]:
    """The Hugging Face ``config.json`` of a Megatron run's ``args``, a Llama's, a Qwen2's or a Qwen3's
    (:func:`family`); refuses other models by name.

    The rotary embedding is written in both spellings (:func:`ckptio.formats.hf_fields.rope_config`), so that
    transformers 4 and 5 read the same model."""
    problems = _not_llama(args)
    if problems:
        raise CheckpointError(f"{where}: not a Llama-style model ({', '.join(problems)}); ckptio maps Megatron GPT "
                              "models with RMSNorm, SwiGLU, RoPE and no linear biases to Hugging Face Llama, and "
                              "with biases on the query/key/value projection only (add_qkv_bias) to Qwen2, with "
                              "RMSNorms on each query and key head (qk_layernorm) to Qwen3, with experts to Mixtral, "
                              "to Qwen2-MoE with a gated shared expert and add_qkv_bias, or to Qwen3-MoE with "
                              "qk_layernorm")
    hidden, heads = _arg(args, "hidden_size"), _arg(args, "num_attention_heads")
    if not isinstance(hidden, int) or not isinstance(heads, int):
        raise CheckpointError(f"{where}: the run's args are missing (hidden_size, num_attention_heads...); put the "
                              "model's Hugging Face config.json beside the checkpoint")
    groups = _arg(args, "num_query_groups") if _arg(args, "group_query_attention", False) else heads
    vocab = _arg(args, "vocab_size") or _arg(args, "padded_vocab_size") or vocab_rows
    dtype = "bfloat16" if _arg(args, "bf16", False) else "float16" if _arg(args, "fp16", False) else "float32"
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": _arg(args, "ffn_hidden_size") or 4 * hidden, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": groups or heads,
        "head_dim": _arg(args, "kv_channels") or hidden // heads, "hidden_act": "silu",
        "rms_norm_eps": float(_arg(args, "norm_epsilon", 1e-5)), **rope_config(_rope(args, where)),
        "max_position_embeddings": _arg(args, "max_position_embeddings") or 4096, "vocab_size": int(vocab),
        "tie_word_embeddings": not _arg(args, "untie_embeddings_and_output_weights", False),
        "attention_bias": False, "mlp_bias": False, "dtype": dtype, "torch_dtype": dtype,
        "attention_dropout": float(_arg(args, "attention_dropout", 0.0) or 0.0),
    }
    kind = family(args)
    if kind in ("mixtral", "qwen2_moe", "qwen3_moe"):  # no mlp_bias field (nor attention_bias but Qwen3-MoE's);
        from .moe import hf_fields as moe_fields  # the experts' sizes and routing

        del config["attention_bias"], config["mlp_bias"]
        config.update(architectures=[FAMILIES[kind]], model_type=kind, **moe_fields(args, where))
        if kind != "mixtral":  # and a Qwen's full attention (Qwen3-MoE has no layer_types)
            config.update(use_sliding_window=False, sliding_window=None, max_window_layers=layers)
        if kind == "qwen2_moe":
            config.update(layer_types=["full_attention"] * layers)
    elif kind != "llama":  # qwen2: q/k/v biases (no attention_bias field), qwen3: none; no mlp_bias; full attention
        del config["mlp_bias"]
        if kind == "qwen2":
            del config["attention_bias"]
        config.update(architectures=[FAMILIES[kind]], model_type=kind, use_sliding_window=False,
                      sliding_window=None, max_window_layers=layers, layer_types=["full_attention"] * layers)
    return config


def nemo_args(config: dict[str, Any]) -> Any:
    """Megatron arguments from a NeMo 1.x ``model_config.yaml`` of a Megatron-Core GPT model."""
    activation = str(config.get("activation", "gelu")).lower()
    return argparse.Namespace(
        **{k: v for k, v in config.items() if k in MUST},  # refused by hf_config unless off
        hidden_size=config.get("hidden_size"), num_attention_heads=config.get("num_attention_heads"),
        num_query_groups=config.get("num_query_groups"), group_query_attention=bool(config.get("num_query_groups")),
        ffn_hidden_size=config.get("ffn_hidden_size"), kv_channels=config.get("kv_channels"),
        norm_epsilon=config.get("layernorm_epsilon", 1e-5), rotary_base=config.get("rotary_base", 10000),
        rotary_percent=config.get("rotary_percentage", 1.0),
        rotary_seq_len_interpolation_factor=config.get("seq_len_interpolation_factor"),
        max_position_embeddings=config.get("max_position_embeddings") or config.get("encoder_seq_length"),
        normalization="RMSNorm" if str(config.get("normalization", "")).lower() == "rmsnorm" else config.get("normalization"),
        swiglu=activation in ("swiglu", "fast-swiglu"), position_embedding_type=config.get("position_embedding_type"),
        add_bias_linear=bool(config.get("bias", False)), add_qkv_bias=bool(config.get("qkv_bias", False)),
        qk_layernorm=bool(config.get("qk_layernorm", False)),
        vocab_size=None,
        untie_embeddings_and_output_weights=not config.get("share_embeddings_and_output_weights", True),
        tensor_model_parallel_size=config.get("tensor_model_parallel_size"),
        pipeline_model_parallel_size=config.get("pipeline_model_parallel_size"),
        bf16=str(config.get("precision", "")).startswith("bf16"))


def nemo2_args(model: dict[str, Any]) -> Any:
    """Megatron arguments from NeMo 2.0's ``context/model.yaml`` (``config:`` holds TransformerConfig fields)."""
    found = model.get("config")
    config: dict[str, Any] = found if isinstance(found, dict) else {}
    activation = config.get("activation_func")
    target = activation.get("_target_", "") if isinstance(activation, dict) else str(activation or "")
    glu = bool(config.get("gated_linear_unit")) and target.endswith("silu")
    scaling = None
    if config.get("scale_factor") is not None:  # Llama 3.1-style RoPE scaling
        scaling = {"rope_type": "llama3", "factor": config.get("scale_factor"),
                   "low_freq_factor": config.get("low_freq_factor", 1.0),
                   "high_freq_factor": config.get("high_freq_factor", 4.0),
                   "original_max_position_embeddings": config.get("old_context_len", 8192)}
    return argparse.Namespace(
        **{k: v for k, v in config.items() if k in MUST},  # refused by hf_config unless off
        hidden_size=config.get("hidden_size"), num_attention_heads=config.get("num_attention_heads"),
        num_query_groups=config.get("num_query_groups"), group_query_attention=bool(config.get("num_query_groups")),
        ffn_hidden_size=config.get("ffn_hidden_size"), kv_channels=config.get("kv_channels"),
        norm_epsilon=config.get("layernorm_epsilon", 1e-5), rotary_base=config.get("rotary_base", 10000),
        rotary_percent=config.get("rotary_percent", 1.0),
        rotary_seq_len_interpolation_factor=config.get("seq_len_interpolation_factor"),
        max_position_embeddings=config.get("seq_length"), normalization=config.get("normalization"),
        swiglu=glu, position_embedding_type=config.get("position_embedding_type", "rope"),
        add_bias_linear=bool(config.get("add_bias_linear", False)),
        add_qkv_bias=bool(config.get("add_qkv_bias", False)), qk_layernorm=bool(config.get("qk_layernorm", False)),
        vocab_size=config.get("vocab_size"),
        untie_embeddings_and_output_weights=not config.get("share_embeddings_and_output_weights", True),
        bf16=bool(config.get("bf16")), fp16=bool(config.get("fp16")), rope_scaling=scaling,
        num_moe_experts=config.get("num_moe_experts"), moe_router_topk=config.get("moe_router_topk"),
        moe_ffn_hidden_size=config.get("moe_ffn_hidden_size"), moe_layer_freq=config.get("moe_layer_freq", 1),
        moe_aux_loss_coeff=config.get("moe_aux_loss_coeff"))


def args_from_files(folder: Path, run: Path) -> Any:
    """The model's arguments from files beside a checkpoint without ``args``; ``None`` when there are none."""
    from ...storage.parse import YAML_MAX_BYTES, yaml_value
    from ...storage.confined import Folder
    from ..common import read_json

    for where in (folder, run):
        if (where / "context" / "model.yaml").is_file():
            doc = yaml_value(Folder(where / "context").read_bytes("model.yaml", max_size=YAML_MAX_BYTES),
                             where / "context" / "model.yaml")
            if isinstance(doc, dict):
                return nemo2_args(doc)
    for where in (folder, run, folder / "context"):
        cfg = where / "config.json"
        if cfg.is_file():
            return hf_args(read_json(cfg), cfg)
    return None


def hf_args(hf: dict[str, Any], where: object) -> Any:
    """Megatron arguments from a Hugging Face ``config.json`` (transformers 5 or 4 spelling) found beside a
    checkpoint that records none; its rotary embedding, scaled or not, is kept (``rope_scaling``). A model type
    Megatron does not compute (a Gemma) is refused by name, not read as a Llama."""
    refuse_type(hf, where, "Megatron", MEGATRON_TYPES)
    r = rope(hf, where)
    if r.partial != 1.0:
        raise CheckpointError(f"{where}: partial_rotary_factor = {r.partial}: ckptio maps Llama-style models, whose "
                              "rotary embedding turns whole heads")
    dtype = dtype_name(hf)
    return argparse.Namespace(
        hidden_size=hf.get("hidden_size"), num_attention_heads=hf.get("num_attention_heads"),
        num_query_groups=hf.get("num_key_value_heads"), group_query_attention=True,
        ffn_hidden_size=hf.get("intermediate_size"), kv_channels=hf.get("head_dim"),
        norm_epsilon=hf.get("rms_norm_eps", 1e-5), rotary_base=r.theta,
        max_position_embeddings=hf.get("max_position_embeddings"), vocab_size=hf.get("vocab_size"),
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        rope_scaling={"rope_type": r.kind, **r.scaling} if r.kind != "default" else None,
        add_bias_linear=bool(hf.get("attention_bias") or hf.get("mlp_bias")),
        add_qkv_bias=hf.get("model_type") in ("qwen2", "qwen2_moe"),
        qk_layernorm=hf.get("model_type") in ("qwen3", "qwen3_moe"),
        bf16=dtype == "bfloat16", fp16=dtype == "float16",
        **({"num_experts": hf.get("num_local_experts"), "moe_router_topk": hf.get("num_experts_per_tok"),
            "moe_ffn_hidden_size": hf.get("intermediate_size"), "moe_aux_loss_coeff": hf.get("router_aux_loss_coef")}
           if hf.get("model_type") == "mixtral" else {}),
        **(_qwen_moe_args(hf) if hf.get("model_type") in ("qwen2_moe", "qwen3_moe") else {}))


def _qwen_moe_args(hf: dict[str, Any]) -> dict[str, Any]:
    """The MoE arguments of a Qwen2-MoE ``config.json`` (its shared expert gated, its routing by ``norm_topk_prob``) or
    of a Qwen3-MoE one (no shared expert)."""
    from .qwen2moe import experts_field

    shared = {"moe_shared_expert_intermediate_size": hf.get("shared_expert_intermediate_size"),
              "moe_shared_expert_gate": True} if hf.get("model_type") == "qwen2_moe" else {}
    return {"num_experts": hf.get(experts_field(hf)), "moe_router_topk": hf.get("num_experts_per_tok"),
            "moe_ffn_hidden_size": hf.get("moe_intermediate_size"), "moe_aux_loss_coeff": hf.get("router_aux_loss_coef"),
            "moe_router_pre_softmax": not hf.get("norm_topk_prob", False), **shared}

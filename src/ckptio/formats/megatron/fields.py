"""Every Megatron model argument, placed: carried into the Hugging Face Llama/Qwen2/Qwen3/Mixtral/Qwen2-MoE/Qwen3-MoE
config, inert, or refused.

A Megatron run builds its model from Megatron-Core's ``TransformerConfig`` (with ``ModelParallelConfig``), whose
fields Megatron-LM fills from arguments of the same names, plus a few Megatron-LM arguments it translates
(``swiglu``, ``apply_layernorm_1p``, ``num_experts``...). A conversion to a Llama, a Qwen2 (a Llama with biases
on its query, key and value projections: ``add_qkv_bias``) or a Qwen3 (a Llama with an RMSNorm on each query and key
head: ``qk_layernorm``) decides from all of them:

* :data:`CARRIED` — read into the converted config (sizes, heads, norm epsilon, rotary base, tying, dtype);
* :data:`MUST` — a feature a Llama does not compute (a window, a 1+gamma norm, QK L2 norms, experts...): the
  argument must hold its "off" value, or the conversion is refused naming it (a Qwen2-MoE carries its shared expert
  and its pre-softmax routing: :data:`_QWEN2_MOE`; a Qwen3-MoE that routing);
* :data:`INERT` — training, performance, initialisation, parallel layout and runtime switches: what the converted
  model computes does not depend on them.

``tests/test_megatron_core.py`` checks against the installed megatron-core that every field of ``TransformerConfig``
and ``ModelParallelConfig`` is placed here, so a release that adds one fails the suite until it is. Arguments that
are neither (Megatron-LM's data, optimizer, logging and checkpointing options) do not reach the model.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CARRIED", "MUST", "INERT", "refused"]

CARRIED = frozenset({
    "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "group_query_attention", "ffn_hidden_size",
    "kv_channels", "layernorm_epsilon", "norm_epsilon", "gated_linear_unit", "activation_func", "swiglu",
    "normalization", "add_bias_linear", "add_qkv_bias", "position_embedding_type", "rotary_base", "rotary_percent",
    "rotary_seq_len_interpolation_factor", "use_rope_scaling", "rope_scaling_factor", "rope_scaling",
    "untie_embeddings_and_output_weights", "vocab_size", "padded_vocab_size", "make_vocab_size_divisible_by",
    "max_position_embeddings", "seq_length", "params_dtype", "bf16", "fp16", "use_rotary_position_embeddings",
    "qk_layernorm", "num_moe_experts", "num_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_aux_loss_coeff",
    "moe_layer_freq",
})
"""Read by :func:`ckptio.formats.megatron.config.hf_config` (the ones a Llama or a Qwen2 cannot hold otherwise refused
there: a LayerNorm, biases other than Qwen2's on the query/key/value projection, another activation or position
embedding, a partial or interpolated RoPE); ``add_qkv_bias`` and ``qk_layernorm`` decide the family (Llama, Qwen2 or
Qwen3), ``num_experts`` (``num_moe_experts``) a Mixtral with ``moe_router_topk`` experts per token of
``moe_ffn_hidden_size``, in every layer (``moe_layer_freq`` 1: dense layers between are refused by :func:`refused`).
``moe_aux_loss_coeff`` is Mixtral's ``router_aux_loss_coef``: it shapes training only, and travels both ways."""

_OFF: dict[str, tuple[tuple[Any, ...], str]] = {
    # argument: (the values under which a Llama computes the same, what it is)
    "apply_layernorm_1p": ((False, None), "norms of 1 + gamma"),
    "layernorm_zero_centered_gamma": ((False, None), "norms of 1 + gamma"),
    "apply_residual_connection_post_layernorm": ((False, None), "residuals taken after the norm"),
    "softmax_scale": ((None,), "an attention scale other than 1/sqrt(head_dim)"),
    "softmax_type": (("vanilla", None), "an attention softmax with sinks or offsets"),
    "window_size": ((None,), "sliding-window attention"),
    "window_attn_skip_freq": ((None,), "sliding-window attention"),
    "qk_l2_norm": ((False, None), "L2 norms on queries and keys"),
    "attention_output_gate": ((False, None), "a gate on the attention output"),
    "multi_latent_attention": ((False, None), "multi-latent attention"),
    "experimental_attention_variant": ((None,), "another attention"),
    "linear_attention_freq": ((None,), "linear attention layers"),
    "no_rope_freq": ((None,), "layers without RoPE"),
    "rotary_interleaved": ((False, None), "interleaved rotary embeddings"),
    "mrope_section": ((None,), "multimodal RoPE"),
    "glu_linear_offset": ((0.0, None), "an offset in the gated unit"),
    "activation_func_clamp_value": ((None,), "a clamped activation"),
    "squared_relu": ((False, None), "a squared-ReLU MLP"),
    "openai_gelu": ((False, None), "a GELU MLP"),
    # a mixture of experts routes as Mixtral exactly with these (megatron-core 0.16.1's TopKRouter): softmax over the
    # top-k logits (= softmax over all, top-k, renormalised), no scaling, no dropping, no jitter, no shared expert;
    # with a shared expert it is a Qwen2-MoE, which carries the names in _QWEN2_MOE (.qwen2moe checks the gate)
    # and with q/k norms (qk_layernorm) a Qwen3-MoE, which carries the first (its routing, norm_topk_prob)
    "moe_router_load_balancing_type": (("aux_loss", "seq_aux_loss", "global_aux_loss", "none", None),
                                       "Sinkhorn routing"),
    "moe_router_score_function": (("softmax", None), "sigmoid router scores"),
    "moe_router_pre_softmax": ((False, None), "softmax over all experts before top-k, not renormalised"),
    "moe_router_topk_scaling_factor": ((None, 1, 1.0), "scaled routing weights"),
    "moe_router_num_groups": ((None,), "group-limited routing"),
    "moe_router_group_topk": ((None,), "group-limited routing"),
    "moe_router_topk_limited_devices": ((None,), "device-limited routing"),
    "moe_router_enable_expert_bias": ((False, None), "a routing bias per expert"),
    "moe_router_force_load_balancing": ((False, None), "random router logits"),
    "moe_expert_capacity_factor": ((None,), "token dropping over an expert capacity"),
    "moe_token_dropping": ((False, None), "token dropping over an expert capacity"),
    "moe_pad_expert_input_to_capacity": ((False, None), "expert inputs padded to capacity"),
    "moe_input_jitter_eps": ((None, 0, 0.0), "jitter on the router's input (also at inference)"),
    "moe_shared_expert_intermediate_size": ((None, 0), "shared experts"),
    "moe_shared_expert_gate": ((False, None), "a gated shared expert"),
    "moe_grouped_gemm": ((False, None), "grouped-GEMM experts (GroupedMLP weight layout, not read)"),
    "moe_use_legacy_grouped_gemm": ((False, None), "grouped-GEMM experts (GroupedMLP weight layout, not read)"),
    "moe_apply_probs_on_input": ((False, None), "routing weights applied to the experts' input"),
    "moe_latent_size": ((None,), "experts in a latent space"),
    "mtp_num_layers": ((None, 0), "multi-token-prediction layers"),
    "is_hybrid_model": ((False, None), "a hybrid (Mamba) model"),
    "heterogeneous_block_specs": ((False, None), "layers of different shapes"),
    "hetereogenous_dist_checkpoint": ((False, None), "layers of different shapes"),
    "heterogeneous_layers_config_path": ((None, ""), "layers of different shapes"),
    "heterogeneous_layers_config_encoded_json": ((None, ""), "layers of different shapes"),
    "spec": ((None,), "a custom layer spec"),
    "quant_recipe": ((None,), "quantized layers"),
    "fp8_param": ((False, None), "weights kept in FP8"),
    "fp4_param": ((False, None), "weights kept in FP4"),
    "num_layers_in_first_pipeline_stage": ((None,), "uneven pipeline stages"),
    "num_layers_in_last_pipeline_stage": ((None,), "uneven pipeline stages"),
    "pipeline_model_parallel_layout": ((None,), "a custom pipeline layout"),
    "account_for_embedding_in_pipeline_split": ((False, None), "uneven pipeline stages"),
    "account_for_loss_in_pipeline_split": ((False, None), "uneven pipeline stages"),
    # NeMo 2.0's Gemma 2 config adds these to TransformerConfig (its own layers compute them; megatron-core cannot)
    "attn_logit_softcapping": ((None, 0, 0.0), "soft-capped attention logits (Gemma 2)"),
    "final_logit_softcapping": ((None, 0, 0.0), "soft-capped output logits (Gemma 2)"),
    "query_pre_attn_scalar": ((None,), "queries scaled by another number than sqrt(head_dim) (Gemma 2)"),
}
MUST = frozenset(_OFF)
_QWEN2_MOE = ("moe_router_pre_softmax", "moe_shared_expert_intermediate_size", "moe_shared_expert_gate")
"""Carried by a Qwen2-MoE (a run with experts and a shared expert): its routing (``norm_topk_prob`` is ``not
moe_router_pre_softmax``) and its shared expert, which :func:`ckptio.formats.megatron.qwen2moe.problems` requires
gated; a Qwen3-MoE (experts with ``qk_layernorm``, no shared expert) carries the routing alone."""

_INERT_NAMES = """
    mtp_loss_scaling_factor attention_backend hidden_dropout attention_dropout fp32_residual_connection
    activation_func_fp8_input_store qk_clip qk_clip_alpha qk_clip_threshold log_max_attention_logit test_mode
    calculate_per_token_loss dsa_indexer_n_heads dsa_indexer_head_dim dsa_indexer_topk dsa_indexer_loss_coeff
    dsa_indexer_use_sparse_loss linear_conv_kernel_dim linear_key_head_dim linear_value_head_dim linear_num_key_heads
    linear_num_value_heads init_method output_layer_init_method init_method_std embedding_init_method
    embedding_init_method_std init_model_with_meta_device apply_query_key_layer_scaling attention_softmax_in_fp32
    disable_bf16_reduced_precision_matmul bias_activation_fusion masked_softmax_fusion persist_layer_norm
    memory_efficient_layer_norm bias_dropout_fusion apply_rope_fusion use_fused_weighted_squared_relu
    fused_single_qkv_rope recompute_granularity recompute_method recompute_num_layers distribute_saved_activations
    recompute_modules fp8 fp8_recipe fp8_quantizer_factory fp8_margin fp8_interval fp8_amax_history_len
    fp8_amax_compute_algo fp8_wgrad fp8_dot_product_attention fp8_multi_head_attention tp_only_amax_red
    first_last_layers_bf16 num_layers_at_start_in_bf16 num_layers_at_end_in_bf16 use_kitchen use_kitchen_attention
    kitchen_attention_backend fp4 fp4_recipe fp4_quantizer_factory
    moe_shared_expert_overlap
    moe_enable_routing_replay moe_router_padding_for_quantization
    moe_router_padding_for_fp8
    moe_router_dtype
    moe_router_bias_update_rate
    moe_z_loss_coeff moe_token_dispatcher_type
    moe_enable_deepep moe_flex_dispatcher_backend moe_per_layer_logging
    moe_token_drop_policy moe_layer_recompute moe_permute_fusion moe_router_fusion
    moe_deepep_num_sms moe_hybridep_num_sms cp_comm_type enable_cuda_graph
    cuda_graph_use_single_mempool cuda_graph_retain_backward_graph cuda_graph_warmup_steps external_cuda_graph
    cuda_graph_impl cuda_graph_scope clone_scatter_output_in_embedding disable_parameter_transpose_cache
    config_logger_dir flash_decode batch_invariant_mode use_te_activation_func inference_rng_tracker
    inference_sampling_seed symmetric_ar_type use_inference_optimized_layers inference_fuse_tp_communication
    mamba_state_dim mamba_head_dim mamba_num_groups mamba_num_heads use_mamba_mem_eff_path mlp_chunks_for_prefill
    transformer_impl fine_grained_activation_offloading offload_modules min_offloaded_tensor_size onnx_safe
    mtp_standalone
"""
_PARALLEL_NAMES = """
    tensor_model_parallel_size pipeline_model_parallel_comm_backend pipeline_model_parallel_size
    virtual_pipeline_model_parallel_size sequence_parallel context_parallel_size hierarchical_context_parallel_sizes
    max_seqlen_per_dp_cp_rank hybrid_context_parallel expert_model_parallel_size expert_tensor_parallel_size
    moe_extended_tp perform_initialization use_cpu_initialization timers ep_overlap_early_attn_memory_release
    finalize_model_grads_func grad_scale_func no_sync_func grad_sync_func param_sync_func
    deterministic_mode enable_autocast autocast_dtype num_microbatches_with_partial_activation_checkpoints
    gradient_accumulation_fusion async_tensor_model_parallel_allreduce use_te_rng_tracker tp_comm_overlap
    tp_comm_bulk_wgrad tp_comm_bulk_dgrad tp_comm_overlap_ag tp_comm_overlap_rs tp_comm_overlap_rs_dgrad
    tp_comm_split_ag tp_comm_atomic_ag tp_comm_split_rs tp_comm_atomic_rs cross_entropy_loss_fusion
    cross_entropy_fusion_impl tp_comm_overlap_disable_qkv tp_comm_overlap_disable_fc1 tp_comm_bootstrap_backend
    overlap_moe_expert_parallel_comm delay_wgrad_compute pipeline_dtype variable_seq_lengths overlap_p2p_comm
    batch_p2p_comm batch_p2p_sync use_ring_exchange_p2p deallocate_pipeline_outputs defer_embedding_wgrad_compute
    wgrad_deferral_limit overlap_p2p_comm_warmup_flush microbatch_group_size_per_vp_stage cpu_offloading
    cpu_offloading_num_layers _cpu_offloading_context cpu_offloading_activations cpu_offloading_weights
    cpu_offloading_double_buffering barrier_with_L1_time
"""
INERT = frozenset(_INERT_NAMES.split()) | frozenset(_PARALLEL_NAMES.split())
"""Training, performance, initialisation, parallel layout and runtime settings."""


def _arg(args: Any, name: str, default: Any = None) -> Any:
    """The argument ``name`` of a run's ``args`` (a Namespace), ``default`` when absent."""
    return getattr(args, name, default) if args is not None else default


def _every_layer(value: Any) -> bool:
    """``moe_layer_freq`` of a run whose every layer is a mixture of experts (1, or a pattern of ones)."""
    return value in (1, None) and not isinstance(value, bool) or isinstance(value, list) and bool(value) and all(
        v == 1 and not isinstance(v, bool) for v in value)


def refused(args: Any) -> list[str]:
    """Each argument of ``args`` (a Namespace or a dict) that asks for something a Llama does not compute, as
    ``name=value (what it is)``."""
    values = args if isinstance(args, dict) else vars(args) if hasattr(args, "__dict__") else {}
    out = []
    experts, shared = values.get("num_experts") or values.get("num_moe_experts"), \
        values.get("moe_shared_expert_intermediate_size")
    carried = _QWEN2_MOE if experts and isinstance(shared, int) and not isinstance(shared, bool) and shared > 0 else \
        _QWEN2_MOE[:1] if experts and values.get("qk_layernorm") is True else ()  # a Qwen3-MoE: its routing
    if "moe_layer_freq" in values and not _every_layer(values["moe_layer_freq"]):
        out.append(f"moe_layer_freq={values['moe_layer_freq']!r} (dense layers between the mixture-of-experts layers)")
    for name, (off, what) in _OFF.items():
        if name in values and name not in carried:
            value = values[name]
            if not any(value == ok and isinstance(value, bool) == isinstance(ok, bool) for ok in off):
                out.append(f"{name}={value!r} ({what})")
    return out

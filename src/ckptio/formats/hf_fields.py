"""The fields of a Hugging Face model config that a conversion reads, in every spelling transformers uses.

transformers 5 keeps the rotary embedding's settings in one ``rope_parameters`` mapping
(``{"rope_theta": 50000, "rope_type": "default"}``, scaling parameters beside them) and the weights' dtype
in ``dtype``; transformers 4 wrote ``rope_theta`` at the top level, scaling as ``rope_scaling`` (its kind
under ``rope_type`` or the older ``type``) and ``torch_dtype``. Every converter reads these fields here, so a
config in either spelling gives the same values, with transformers' own priority: ``rope_scaling`` when
present, else ``rope_parameters``; a ``rope_theta`` inside the mapping before the top-level one; the model
type's default when neither is given (10000; a Mixtral's 1e6).

A target that cannot hold a field refuses it by name (:func:`refuse`, :class:`UnsupportedFieldError`)
instead of writing a model that computes something else.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any

from ..errors import CheckpointCorruptError, ConfigError

__all__ = ["DEFAULT_THETA", "Rope", "UnsupportedFieldError", "rope", "dtype_name", "refuse", "rope_config", "CARRIED",
           "INERT", "MODEL_FIELDS", "LLAMA_TYPES", "MEGATRON_TYPES", "DEFAULT_EPS", "unknown_fields", "class_fields",
           "refuse_type", "check_sizes"]

DEFAULT_THETA = 10000.0
_THETAS = {"mixtral": 1e6}
"""The rotary base transformers gives a model type whose config names none, where it is not :data:`DEFAULT_THETA`."""
"""transformers' (and Megatron's) rotary base when a config gives none."""
_KEYS = ("rope_theta", "rope_type", "type", "partial_rotary_factor")


class UnsupportedFieldError(ConfigError):
    """A config field the conversion's target cannot hold; ``field`` names it (dotted for nested keys)."""

    def __init__(self, where: object, name: str, value: Any, target: str, hint: str) -> None:
        self.field, self.value, self.target = name, value, target
        super().__init__(f"{where}: {name} = {value!r:.120}: a {target} checkpoint cannot hold it, so the converted "
                         f"model would compute something else; nothing was written. {hint}")


@dataclass(frozen=True)
class Rope:
    """A config's rotary embedding, whichever spelling it used."""

    theta: float
    kind: str = "default"
    """``default`` (plain RoPE), or a scaling: ``linear``, ``dynamic``, ``llama3``, ``yarn``, ``longrope``..."""
    scaling: dict[str, Any] = field(default_factory=dict)
    """The scaling's parameters (``factor``...), without the theta, the kind or ``partial_rotary_factor``."""
    partial: float = 1.0
    """The fraction of each head's dimensions that rotate (``partial_rotary_factor``)."""
    source: str = "rope_theta"
    """The field the kind was read from (``rope_parameters``, ``rope_scaling``), for messages."""


def _number(value: Any, where: object, name: str) -> float:
    ok = not isinstance(value, bool) and isinstance(value, (int, float))
    try:
        ok = ok and value > 0 and math.isfinite(float(value))
    except OverflowError:  # an integer past any float
        ok = False
    if not ok:
        raise CheckpointCorruptError(f"{where}: {name} must be a positive finite number, found {str(value):.60}")
    return float(value)


_SIZES = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
"""The sizes every Llama-style config must give (positive whole numbers)."""
_MAX_SIZE = 1 << 31


def _size(config: dict[str, Any], where: object, name: str, required: bool) -> int | None:
    value = config.get(name)
    if value is None and not required:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < _MAX_SIZE:
        raise CheckpointCorruptError(f"{where}: {name} must be a whole number from 1 to {_MAX_SIZE - 1}, found "
                                     f"{str(value):.60}" + (" (missing)" if name not in config else ""))
    return value


def check_sizes(config: dict[str, Any], where: object) -> None:
    """Refuse a config whose model sizes are not positive whole numbers that fit together (the heads divide the
    hidden size unless ``head_dim`` is given, the key/value heads divide the heads), or whose norm epsilon or
    dropout is not a number in range: what a writer builds from them is then bounded and consistent."""
    sizes = {name: _size(config, where, name, True) or 0 for name in _SIZES}  # each is checked in order
    hidden, heads = sizes["hidden_size"], sizes["num_attention_heads"]
    kv, head_dim, _ = (_size(config, where, name, False)
                       for name in ("num_key_value_heads", "head_dim", "max_position_embeddings"))
    if head_dim is None and hidden % heads:
        raise CheckpointCorruptError(f"{where}: hidden_size {hidden} is not a multiple of num_attention_heads {heads} "
                                     "(and no head_dim is given)")
    if kv is not None and heads % kv:
        raise CheckpointCorruptError(f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads "
                                     f"{kv}")
    for name, low, high in (("rms_norm_eps", 0.0, 1.0), ("attention_dropout", 0.0, 1.0)):
        value = config.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not low <= value <= high):
            raise CheckpointCorruptError(f"{where}: {name} must be a number from {low:g} to {high:g}, found "
                                         f"{str(value):.60}")
    if not isinstance(config.get("tie_word_embeddings", False), bool):
        raise CheckpointCorruptError(f"{where}: tie_word_embeddings must be true or false, found "
                                     f"{str(config['tie_word_embeddings']):.60}")


def rope(config: dict[str, Any], where: object) -> Rope:
    """The rotary embedding of a config in the transformers 5 (``rope_parameters``) or 4 (``rope_theta``,
    ``rope_scaling``) spelling; a malformed value is a :class:`~ckptio.errors.CheckpointCorruptError`."""
    source = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
    params = config.get(source) or {}
    if not isinstance(params, dict):
        raise CheckpointCorruptError(f"{where}: {source} must be a mapping, found {type(params).__name__}")
    nested = [k for k, v in params.items() if isinstance(v, dict)]
    if nested:  # one mapping per layer type (sliding and full attention layers): no single-RoPE target holds it
        raise UnsupportedFieldError(where, f"{source}.{nested[0]}", params[nested[0]], "single-RoPE",
                                    "Each layer type has its own rotary settings; ckptio converts models with one.")
    theta = params.get("rope_theta", config.get("rope_theta"))
    kind = params.get("rope_type", params.get("type", "default"))
    if not isinstance(kind, str):
        raise CheckpointCorruptError(f"{where}: {source}.rope_type must be a string, found {kind!r:.60}")
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor"))
    if theta is None:
        theta = _THETAS.get(str(config.get("model_type")), DEFAULT_THETA)
    return Rope(theta=_number(theta, where, "rope_theta"), kind=kind,
                scaling={k: v for k, v in params.items() if k not in _KEYS} if kind != "default" else {},
                partial=1.0 if partial is None else _number(partial, where, "partial_rotary_factor"),
                source=source)


def rope_config(r: Rope) -> dict[str, Any]:
    """The config fields that describe ``r`` in both spellings (``rope_parameters`` for transformers 5;
    ``rope_theta``, and ``rope_scaling`` when it scales, for transformers 4), which either version reads."""
    params: dict[str, Any] = {"rope_theta": r.theta, "rope_type": r.kind, **r.scaling}
    if r.partial != 1.0:
        params["partial_rotary_factor"] = r.partial
    out: dict[str, Any] = {"rope_theta": r.theta, "rope_parameters": params}
    if r.kind != "default":
        out["rope_scaling"] = {"rope_type": r.kind, **r.scaling}
    return out


def dtype_name(config: dict[str, Any]) -> str | None:
    """The weights' dtype a config records (``dtype`` in transformers 5, ``torch_dtype`` in 4), or ``None``."""
    for key in ("dtype", "torch_dtype"):
        value = config.get(key)
        if isinstance(value, str):
            return value.removeprefix("torch.")
    return None


# Every field of the configs of the model types ckptio maps to Llama-shaped targets (transformers 5's LlamaConfig,
# MistralConfig and Qwen2Config with PretrainedConfig's own, and transformers 4's spellings of the same), each with
# what a conversion does with it. tests/test_convert_function.py checks the lists against the installed transformers'
# classes, so a field a new release adds fails the suite until it is placed here; at run time a field of the model
# type missing from these lists is refused by name.
CARRIED = frozenset({
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "rms_norm_eps", "rope_parameters", "rope_theta", "rope_scaling", "partial_rotary_factor", "max_position_embeddings",
    "vocab_size", "tie_word_embeddings", "dtype", "torch_dtype",
})
"""Written into the target and read back the same (the rotary fields through :func:`rope`)."""
INERT = frozenset({
    "_name_or_path", "architectures", "transformers_version", "model_type", "id2label", "label2id", "problem_type",
    "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range", "use_cache", "output_attentions",
    "output_hidden_states", "return_dict", "chunk_size_feed_forward", "attention_dropout",
})
"""Names, token ids, weight initialisation, training-time dropout and runtime switches: what the model computes does
not depend on them (Megatron carries the dropout all the same)."""
_MUST: dict[str, tuple[Any, str]] = {  # field -> (the value a Llama-shaped target computes, why)
    "hidden_act": ("silu", "Only SwiGLU MLPs (hidden_act silu) are mapped."),
    "attention_bias": (False, "Attention projections with biases are not mapped; convert to hf, safetensors or nemo "
                              "instead."),
    "mlp_bias": (False, "MLP projections with biases are not mapped; convert to hf, safetensors or nemo instead."),
    "pretraining_tp": (1, "Llama's pretraining_tp splits the projections' matmuls; only 1 is mapped."),
    "sliding_window": (None, "Only full attention is carried; set sliding_window to null if the model never sees "
                             "longer sequences."),
    "use_sliding_window": (False, "Only full attention is carried; Qwen2 attends in a window of sliding_window tokens "
                                  "on the layers from max_window_layers on when this is true."),
    "is_encoder_decoder": (False, "Only decoder-only models are mapped."),
    "router_jitter_noise": (0.0, "Mixtral's router jitter is not carried (Megatron's moe_input_jitter_eps jitters at "
                                 "inference too); set it to 0.0."),
    "decoder_sparse_step": (1, "Only a Qwen MoE whose every layer is a mixture of experts is mapped (Megatron's "
                               "moe_layer_freq patterns are not)."),
    "qkv_bias": (True, "A Qwen2-MoE is mapped with its q/k/v biases (Megatron's add_qkv_bias)."),
}
MODEL_FIELDS: dict[str, frozenset[str]] = {
    "llama": CARRIED | INERT | {"hidden_act", "attention_bias", "mlp_bias", "pretraining_tp", "is_encoder_decoder"},
    "mistral": CARRIED | INERT | {"hidden_act", "sliding_window", "is_encoder_decoder"},
    "qwen2": CARRIED | INERT | {"hidden_act", "use_sliding_window", "sliding_window", "max_window_layers",
                                "layer_types", "is_encoder_decoder"},
    "qwen3": CARRIED | INERT | {"hidden_act", "attention_bias", "use_sliding_window", "sliding_window",
                                "max_window_layers", "layer_types", "is_encoder_decoder"},
    # Mixtral: the experts' count and top-k carried; router_aux_loss_coef (training only) travels as Megatron's
    # moe_aux_loss_coeff; output_router_logits only adds the router's logits to the output
    "mixtral": CARRIED | INERT | {"hidden_act", "sliding_window", "num_local_experts", "num_experts_per_tok",
                                  "router_aux_loss_coef", "output_router_logits", "router_jitter_noise",
                                  "is_encoder_decoder"},
    # Qwen2-MoE: the experts (count, top-k, size), the gated shared expert's size and the routing (norm_topk_prob)
    # carried; every layer sparse (decoder_sparse_step 1, no mlp_only_layers); intermediate_size is the dense MLP's
    "qwen2_moe": CARRIED | INERT | {"hidden_act", "use_sliding_window", "sliding_window", "max_window_layers",
                                    "layer_types", "is_encoder_decoder", "num_experts", "num_experts_per_tok",
                                    "moe_intermediate_size", "shared_expert_intermediate_size", "norm_topk_prob",
                                    "router_aux_loss_coef", "output_router_logits", "decoder_sparse_step",
                                    "mlp_only_layers", "qkv_bias"},
    # Qwen3-MoE: Qwen2-MoE's experts and routing without the shared expert, Qwen3's q/k norms, no biases; transformers
    # 5 saves the expert count as num_local_experts (num_experts maps to it), the Hub's configs as num_experts;
    # max_window_layers is transformers 4's (no layer_types: neither reads one)
    "qwen3_moe": CARRIED | INERT | {"hidden_act", "attention_bias", "use_sliding_window", "sliding_window",
                                    "max_window_layers", "is_encoder_decoder", "num_experts",
                                    "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
                                    "norm_topk_prob", "router_aux_loss_coef", "output_router_logits",
                                    "decoder_sparse_step", "mlp_only_layers"},
}
"""The fields each model type reads (anything else in its config.json, a stray field of another type, it ignores)."""
_SWITCHED = {kind: frozenset({"sliding_window", "max_window_layers"})
             for kind in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")}
"""Fields a model type reads only when a switch in :data:`_MUST` is on (Qwen2's and Qwen3's window, with
``use_sliding_window``): Qwen2.5's own configs hold ``sliding_window: 131072`` with the switch off, which computes
full attention."""
LLAMA_TYPES = ("llama", "mistral")
"""The model types every Llama-shaped target holds."""
MEGATRON_TYPES = (*LLAMA_TYPES, "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe")
"""The model types Megatron holds: also ``qwen2`` (its ``add_qkv_bias``), ``qwen3`` (its ``qk_layernorm``),
``mixtral`` (its ``num_experts``), ``qwen2_moe`` (experts with a gated shared expert) and ``qwen3_moe`` (experts with
``qk_layernorm``)."""
DEFAULT_EPS = {"llama": 1e-6, "mistral": 1e-6, "qwen2": 1e-6, "qwen3": 1e-6, "mixtral": 1e-5, "qwen2_moe": 1e-6,
               "qwen3_moe": 1e-6}
"""transformers' ``rms_norm_eps`` when a config of the type gives none (the same in transformers 4 and 5); each of
:data:`MEGATRON_TYPES` has its own, so that a config leaving it out is exported as transformers reads it."""


_GEMMA = (" megatron-core (0.16) builds no Gemma: it has no logit soft-capping (Gemma 2's attention and final logits), "
          "no post-attention and post-MLP norms (Gemma's four norms per layer), no embedding scaled by "
          "sqrt(hidden_size) and one rotary base for all layers (Gemma 3 has two); its window alternation, "
          "softmax scale, GeGLU and (with Transformer Engine) 1 + weight norms would not make up for them, and NeMo "
          "trains Gemma with layers of its own. Convert to hf or safetensors instead.")
_WHY_NOT = {"gemma2": _GEMMA, "gemma3": _GEMMA, "gemma3_text": _GEMMA}
"""Why Megatron holds no model of these types, beyond their names (issue 69: checked against megatron-core 0.16.1)."""


def _placed(config: dict[str, Any]) -> frozenset[str]:
    """The fields the config's model type reads (a config without ``model_type`` is read as a Llama's)."""
    kind = config.get("model_type")
    return MODEL_FIELDS.get(kind if isinstance(kind, str) else "llama", MODEL_FIELDS["llama"])


def _llama_checks(config: dict[str, Any], r: Rope, types: tuple[str, ...]) -> list[tuple[str, Any, bool, str]]:
    """What a field must be for a target that cannot hold any other value: (dotted name, the value, allowed, hint),
    each field read as the config's model type reads it; ``types``: the model types the target holds."""
    kind = config.get("model_type")
    checks = [("model_type", kind, kind in (*types, None),
               f"ckptio maps Llama-style decoders (RMSNorm, SwiGLU, RoPE) of the model types {', '.join(types)} to "
               "this target (mistral without a sliding window; qwen2, whose q/k/v projections have biases, "
               "qwen3, whose queries and keys are normalised per head, and mixtral's, qwen2_moe's and qwen3_moe's "
               "experts, to Megatron only).")]
    reads = _placed(config) - _SWITCHED.get(kind if isinstance(kind, str) else "", frozenset())
    for name in sorted(_MUST):
        if name in reads:
            want, hint = _MUST[name]
            value = config.get(name, want)  # transformers' default for each is the value a Llama computes
            checks.append((name, value, value == want and isinstance(value, bool) == isinstance(want, bool), hint))
    if "mlp_only_layers" in reads:  # a Qwen MoE's dense layers ([] or null: none)
        value = config.get("mlp_only_layers")
        checks.append(("mlp_only_layers", value, value in (None, []), "Only a Qwen MoE whose every layer is a "
                       "mixture of experts is mapped (Megatron's moe_layer_freq patterns are not)."))
    if "layer_types" in reads:  # transformers 5 writes each layer's attention; older configs leave it out
        value = config.get("layer_types")
        checks.append(("layer_types", value, value is None or (isinstance(value, list) and all(
            t == "full_attention" for t in value)), "Only full attention is carried (every layer full_attention)."))
    checks += [
        (f"{r.source}.rope_type", r.kind, r.kind == "default",
         "Only plain RoPE (rope_type default, any rope_theta) is carried; a scaled RoPE (linear, dynamic, llama3, "
         "yarn...) would be dropped. Convert to hf, safetensors or nemo to keep it."),
        ("partial_rotary_factor", r.partial, r.partial == 1.0, "Only a rotary embedding over whole heads is carried."),
    ]
    return checks


def unknown_fields(config: dict[str, Any], known: "frozenset[str] | set[str]") -> list[str]:
    """The fields of ``config`` its model type reads (``known``: from transformers' config class, when installed) that
    the lists above do not place: nothing says whether they change what the model computes."""
    placed = _placed(config)
    return sorted(name for name in known if name in config and name not in placed)


def refuse_type(config: dict[str, Any], where: object, target: str, types: tuple[str, ...] = LLAMA_TYPES) -> None:
    """Raise :class:`UnsupportedFieldError` on a ``model_type`` other than ``types`` (saying, for Megatron, why it
    holds no Gemma)."""
    kind = config.get("model_type")
    if kind not in (*types, None):
        _, _, _, hint = _llama_checks(config, Rope(theta=DEFAULT_THETA), types)[0]
        raise UnsupportedFieldError(where, "model_type", kind, target,
                                    hint + (_WHY_NOT.get(str(kind), "") if target == "Megatron" else ""))


def refuse(config: dict[str, Any], where: object, target: str, *, holds: tuple[str, ...] = (),
           types: tuple[str, ...] = LLAMA_TYPES) -> Rope:
    """Check that a ``target`` checkpoint of a Llama-style model (of the model ``types`` it holds) can hold every
    field of ``config`` that shapes its computation, except those named in ``holds`` (which the target carries);
    raise :class:`UnsupportedFieldError` naming the first that it cannot. Returns the config's rotary embedding."""
    kind = config.get("model_type")
    refuse_type(config, where, target, types)  # before the rotary embedding: Gemma 3's (one per layer type) is none
    check_sizes(config, where)
    r = rope(config, where)
    for name, value, ok, hint in _llama_checks(config, r, types):
        if not ok and name.rpartition(".")[2] not in holds and name not in holds:
            raise UnsupportedFieldError(where, name, value, target, hint)
    for name in unknown_fields(config, class_fields(kind if isinstance(kind, str) else "llama")):
        raise UnsupportedFieldError(where, name, config[name], target,
                                    f"ckptio does not know whether this field of a {kind or 'llama'} config changes "
                                    "what the model computes (a transformers release newer than its lists); convert "
                                    "to hf, safetensors or nemo, which keep the config whole.")
    return r


@functools.lru_cache(maxsize=None)
def class_fields(kind: str) -> frozenset[str]:
    """Every field transformers' config class for ``kind`` has (its own and PretrainedConfig's); empty without
    transformers (then the lists above alone decide)."""
    try:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    except ImportError:
        return frozenset()
    if kind not in CONFIG_MAPPING:
        return frozenset()
    return frozenset(CONFIG_MAPPING[kind]().to_dict())

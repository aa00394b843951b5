"""Model naming converters, declared as data: key patterns plus tensor transforms, invertible by construction.

A :class:`Converter` is a list of :class:`Rule`. Each rule maps one or more source keys to one target
key with a transform; ``{i}`` in a pattern stands for a layer index. Every transform has an inverse
(``fuse_qkv`` ↔ ``split_qkv``, ``concat`` ↔ ``split``, ``transpose`` ↔ ``transpose``, ``rename`` ↔
``rename``), so :meth:`Converter.inverse` derives the reverse converter, and :func:`check_invertible`
proves on real tensors that forward-then-inverse gives back every key, bit for bit. A conversion fails
with the key's name if a source key is matched by no rule, so nothing is dropped silently.

Built in: ``llama-to-megatron`` and its inverse ``megatron-to-llama``: Hugging Face Llama naming (also
Mistral's, Qwen2's and Qwen3's) ↔ Megatron-Core GPT naming, with ``linear_qkv`` fused the way Megatron-Core lays
out grouped-query attention (for each KV group: that group's query heads, then its key head, then its value head;
Qwen2's q/k/v biases fused the same way into ``linear_qkv.bias``), Qwen3's ``q_norm``/``k_norm`` as
``q_layernorm``/``k_layernorm`` and ``linear_fc1`` holding ``[gate; up]``. See ``docs/converters.md`` for adding
a family.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointCorruptError, CheckpointError, ConfigError
from .common import TensorInfo, dtype_name, read_json, torch_dtype

__all__ = ["Rule", "Converter", "CONVERTERS", "register", "get_converter", "apply", "check_invertible",
           "renamed_source"]

_INVERSE = {"rename": "rename", "fuse_qkv": "split_qkv", "split_qkv": "fuse_qkv", "concat": "split",
            "split": "concat", "transpose": "transpose"}


@dataclass(frozen=True)
class Rule:
    """``sources`` (one or more key patterns) become ``target`` through ``transform``.

    Transforms: ``rename`` (1→1), ``transpose`` (1→1, 2-D), ``concat`` (n→1 along dim 0, equal parts),
    ``fuse_qkv`` (q, k, v → one tensor in Megatron's grouped layout); and their inverses ``split`` and
    ``split_qkv`` (1→n), for which ``target`` lists several patterns and ``sources`` one.
    """

    sources: tuple[str, ...]
    target: tuple[str, ...]
    transform: str = "rename"

    def inverse(self) -> "Rule":
        return Rule(self.target, self.sources, _INVERSE[self.transform])


@dataclass(frozen=True)
class Converter:
    """A named set of renaming (and reshaping) rules between two checkpoint namings, with its inverse."""
    name: str
    rules: tuple[Rule, ...]
    needs: tuple[str, ...] = ()
    """config.json fields the transforms use (e.g. head counts)."""
    inverse_name: str = ""
    doc: str = ""

    def inverse(self) -> "Converter":
        return Converter(self.inverse_name or f"inverse-of-{self.name}", tuple(r.inverse() for r in self.rules),
                         self.needs, self.name, f"inverse of {self.name}")


CONVERTERS: dict[str, Converter] = {}


def register(converter: Converter) -> None:
    """Add a converter and its inverse to the registry."""
    for c in (converter, converter.inverse()):
        if c.name in CONVERTERS:
            raise ConfigError(f"a converter named {c.name!r} is already registered")
    CONVERTERS[converter.name] = converter
    CONVERTERS[converter.inverse().name] = converter.inverse()


def get_converter(name: str) -> Converter:
    """The registered converter called ``name``; a :class:`~ckptio.errors.ConfigError` listing them otherwise."""
    if name not in CONVERTERS:
        raise ConfigError(f"unknown naming converter {name!r}; registered: {sorted(CONVERTERS)}")
    return CONVERTERS[name]


# ------------------------------------------------------------------------------------------ transforms
def _qkv_dims(config: dict[str, Any]) -> tuple[int, int, int]:
    heads = int(config["num_attention_heads"])
    kv = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    return heads, kv, head_dim


def _rows(t: torch.Tensor, want: int, what: str, config: dict[str, Any]) -> None:
    """Refuse a projection whose rows are not what the config's head counts give (it would be cut into other
    heads)."""
    if t.dim() < 1 or t.shape[0] != want:
        heads, kv, hd = _qkv_dims(config)
        raise CheckpointCorruptError(f"the {what} has shape {tuple(t.shape)}, but the config's {heads} attention "
                                     f"heads, {kv} key/value heads and head size {hd} give {want} rows")


def _fuse_qkv(parts: list[torch.Tensor], config: dict[str, Any]) -> torch.Tensor:
    q, k, v = parts
    heads, kv, hd = _qkv_dims(config)
    per = heads // kv
    for t, want, what in ((q, heads * hd, "query projection"), (k, kv * hd, "key projection"),
                          (v, kv * hd, "value projection")):
        _rows(t, want, what, config)
    rest = q.shape[1:]
    groups = [q.reshape(kv, per * hd, *rest), k.reshape(kv, hd, *rest), v.reshape(kv, hd, *rest)]
    return torch.cat(groups, dim=1).reshape(kv * (per + 2) * hd, *rest)


def _split_qkv(t: torch.Tensor, config: dict[str, Any]) -> list[torch.Tensor]:
    heads, kv, hd = _qkv_dims(config)
    per = heads // kv
    _rows(t, kv * (per + 2) * hd, "fused query/key/value projection", config)
    rest = t.shape[1:]
    g = t.reshape(kv, (per + 2) * hd, *rest)
    q, k, v = g.split([per * hd, hd, hd], dim=1)
    return [q.reshape(heads * hd, *rest), k.reshape(kv * hd, *rest), v.reshape(kv * hd, *rest)]


def _forward(rule: Rule, parts: list[torch.Tensor], config: dict[str, Any]) -> list[torch.Tensor]:
    t = rule.transform
    if t == "rename":
        return [parts[0]]
    if t == "transpose":
        return [parts[0].t().contiguous()]
    if t == "concat":
        return [torch.cat(parts, dim=0)]
    if t == "split":
        return list(parts[0].chunk(len(rule.target), dim=0))
    if t == "fuse_qkv":
        return [_fuse_qkv(parts, config)]
    if t == "split_qkv":
        return _split_qkv(parts[0], config)
    raise ConfigError(f"unknown transform {t!r}")


def _pattern(p: str) -> re.Pattern:
    """``{i}`` (a layer index) and ``{j}`` (an expert index) stand for numbers."""
    return re.compile("^" + re.escape(p).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{j\}", r"(?P<j>\d+)") + "$")


@dataclass
class _Plan:
    """Target key -> (rule, bound source keys, index of this target among the rule's outputs)."""

    outputs: dict[str, tuple[Rule, list[str], int]] = field(default_factory=dict)


def plan(converter: Converter, keys: list[str]) -> _Plan:
    """Match every source key to a rule; raise naming any key no rule accounts for."""
    result = _Plan()
    used: set[str] = set()
    keyset = set(keys)
    for rule in converter.rules:
        first = _pattern(rule.sources[0])
        for key in keys:
            m = first.match(key)
            if not m:
                continue
            found = {k: v for k, v in m.groupdict().items() if v is not None}

            def fill(p: str, found: dict[str, str] = found) -> str:
                for name, number in found.items():
                    p = p.replace("{" + name + "}", number)
                return p
            srcs = [fill(p) for p in rule.sources]
            missing = [s for s in srcs if s not in keyset]
            if missing:
                raise CheckpointError(f"converter {converter.name!r}: {key!r} needs {missing} as well, which are absent")
            for n, tgt in enumerate(rule.target):
                result.outputs[fill(tgt)] = (rule, srcs, n)
            used.update(srcs)
    left = sorted(set(keys) - used)
    if left:
        raise CheckpointError(f"converter {converter.name!r} has no rule for {len(left)} key(s), e.g. {left[:3]}")
    return result


def apply(converter: Converter, state_dict: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Convert a whole state dict in memory."""
    p = plan(converter, list(state_dict))
    return {tgt: _forward(rule, [state_dict[s] for s in srcs], config)[n] for tgt, (rule, srcs, n) in p.outputs.items()}


def check_invertible(converter: Converter, state_dict: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    """Raise unless converting and converting back returns every key and every bit of ``state_dict``."""
    there = apply(converter, state_dict, config)
    back = apply(converter.inverse(), there, config)
    if set(back) != set(state_dict):
        raise AssertionError(f"{converter.name}: keys changed in the round trip: "
                             f"{sorted(set(back) ^ set(state_dict))[:5]}")
    for k, v in state_dict.items():
        if back[k].dtype != v.dtype or not torch.equal(back[k], v):
            raise AssertionError(f"{converter.name}: {k!r} is not bitwise identical after the round trip")


class _RenamedSource:
    """A tensor source seen through a converter; each output tensor is computed when read."""

    def __init__(self, source: Any, converter: Converter, config: dict[str, Any]) -> None:
        self.source, self.converter, self.config, self.folder = source, converter, config, source.folder
        self._index = source.index()
        self._plan = plan(converter, list(self._index))
        self._infos: dict[str, TensorInfo] = {}
        for tgt, (rule, srcs, n) in self._plan.outputs.items():  # shapes from metadata, via meta tensors
            metas = [torch.empty(self._index[s].shape, dtype=torch_dtype(self._index[s].dtype), device="meta") for s in srcs]
            try:
                out = _forward(rule, metas, config)[n]
            except CheckpointCorruptError as e:
                raise CheckpointCorruptError(f"{getattr(source, 'folder', 'the source')}: {', '.join(srcs)}: {e}") \
                    from None
            except (RuntimeError, ValueError) as exc:  # shapes the config's sizes cannot split or fuse
                shapes = {s: list(self._index[s].shape) for s in srcs}
                raise CheckpointCorruptError(f"{getattr(source, 'folder', '')}: {shapes} cannot become {tgt!r} "
                                             f"({rule.transform} with the config's sizes): {exc}") from exc
            self._infos[tgt] = TensorInfo(tuple(out.shape), dtype_name(out.dtype))

    def index(self) -> dict[str, TensorInfo]:
        return dict(self._infos)

    def read(self, key: str) -> torch.Tensor:
        rule, srcs, n = self._plan.outputs[key]
        return _forward(rule, [self.source.read(s) for s in srcs], self.config)[n]

    def close(self) -> None:
        close = getattr(self.source, "close", None)
        if callable(close):
            close()


def renamed_source(source: Any, name: str, extras: Path | None) -> _RenamedSource:
    """``source`` seen through the converter ``name`` (its config fields read from ``extras/config.json``)."""
    converter = get_converter(name)
    config: dict[str, Any] = {}
    if converter.needs:
        cfg_path = None if extras is None else extras / "config.json"
        if cfg_path is None or not cfg_path.is_file():
            raise CheckpointError(f"converter {name!r} needs config.json ({', '.join(converter.needs)}) beside the weights")
        config = read_json(cfg_path)
        missing = [k for k in converter.needs if k not in config]
        if missing:
            raise CheckpointError(f"{cfg_path}: converter {name!r} needs {missing}")
    return _RenamedSource(source, converter, config)


# ------------------------------------------------------------------------------------------ built in
_L = "model.layers.{i}."
_M = "decoder.layers.{i}."
LLAMA_TO_MEGATRON = Converter(
    name="llama-to-megatron",
    inverse_name="megatron-to-llama",
    needs=("num_attention_heads", "hidden_size"),
    doc="Hugging Face Llama/Qwen2/Qwen3 -> Megatron-Core GPT (fused linear_qkv with grouped-query layout, its bias "
        "too; Qwen3's q/k norms; fc1 = [gate; up])",
    rules=(
        Rule(("model.embed_tokens.weight",), ("embedding.word_embeddings.weight",)),
        Rule((_L + "input_layernorm.weight",), (_M + "self_attention.linear_qkv.layer_norm_weight",)),
        Rule((_L + "self_attn.q_proj.weight", _L + "self_attn.k_proj.weight", _L + "self_attn.v_proj.weight"),
             (_M + "self_attention.linear_qkv.weight",), "fuse_qkv"),
        Rule((_L + "self_attn.q_proj.bias", _L + "self_attn.k_proj.bias", _L + "self_attn.v_proj.bias"),
             (_M + "self_attention.linear_qkv.bias",), "fuse_qkv"),  # Qwen2 (Megatron's add_qkv_bias)
        Rule((_L + "self_attn.q_norm.weight",), (_M + "self_attention.q_layernorm.weight",)),  # Qwen3 (qk_layernorm)
        Rule((_L + "self_attn.k_norm.weight",), (_M + "self_attention.k_layernorm.weight",)),
        Rule((_L + "self_attn.o_proj.weight",), (_M + "self_attention.linear_proj.weight",)),
        Rule((_L + "post_attention_layernorm.weight",), (_M + "mlp.linear_fc1.layer_norm_weight",)),
        Rule((_L + "mlp.gate_proj.weight", _L + "mlp.up_proj.weight"), (_M + "mlp.linear_fc1.weight",), "concat"),
        Rule((_L + "mlp.down_proj.weight",), (_M + "mlp.linear_fc2.weight",)),
        Rule(("model.norm.weight",), ("decoder.final_layernorm.weight",)),
        Rule(("lm_head.weight",), ("output_layer.weight",)),
    ),
)
register(LLAMA_TO_MEGATRON)

_E = "block_sparse_moe."
MIXTRAL_TO_MEGATRON = Converter(
    name="mixtral-to-megatron",
    inverse_name="megatron-to-mixtral",
    needs=("num_attention_heads", "hidden_size"),
    doc="Hugging Face Mixtral -> Megatron-Core MoE GPT (the attention as llama-to-megatron; the router; each expert's "
        "fc1 = [w1 (gate); w3 (up)], fc2 = w2)",
    rules=tuple(r for r in LLAMA_TO_MEGATRON.rules if ".mlp." not in r.sources[0]) + (
        Rule((_L + _E + "gate.weight",), (_M + "mlp.router.weight",)),
        Rule((_L + _E + "experts.{j}.w1.weight", _L + _E + "experts.{j}.w3.weight"),
             (_M + "mlp.experts.{j}.linear_fc1.weight",), "concat"),
        Rule((_L + _E + "experts.{j}.w2.weight",), (_M + "mlp.experts.{j}.linear_fc2.weight",)),
    ),
)
register(MIXTRAL_TO_MEGATRON)

QWEN2MOE_TO_MEGATRON = Converter(
    name="qwen2moe-to-megatron",
    inverse_name="megatron-to-qwen2moe",
    needs=("num_attention_heads", "hidden_size"),
    doc="Hugging Face Qwen2-MoE -> Megatron-Core MoE GPT with a shared expert (the attention and its q/k/v biases as "
        "llama-to-megatron; the router; each expert's and the shared expert's fc1 = [gate_proj; up_proj], fc2 = "
        "down_proj; the shared expert's sigmoid gate as its gate_weight); also Qwen3-MoE, the same without the shared "
        "expert, its q/k norms as llama-to-megatron's",
    rules=tuple(r for r in LLAMA_TO_MEGATRON.rules if ".mlp." not in r.sources[0]) + (
        Rule((_L + "mlp.gate.weight",), (_M + "mlp.router.weight",)),
        Rule((_L + "mlp.experts.{j}.gate_proj.weight", _L + "mlp.experts.{j}.up_proj.weight"),
             (_M + "mlp.experts.{j}.linear_fc1.weight",), "concat"),
        Rule((_L + "mlp.experts.{j}.down_proj.weight",), (_M + "mlp.experts.{j}.linear_fc2.weight",)),
        Rule((_L + "mlp.shared_expert.gate_proj.weight", _L + "mlp.shared_expert.up_proj.weight"),
             (_M + "mlp.shared_experts.linear_fc1.weight",), "concat"),
        Rule((_L + "mlp.shared_expert.down_proj.weight",), (_M + "mlp.shared_experts.linear_fc2.weight",)),
        Rule((_L + "mlp.shared_expert_gate.weight",), (_M + "mlp.shared_experts.gate_weight",)),
    ),
)
register(QWEN2MOE_TO_MEGATRON)


def describe() -> list[dict[str, Any]]:
    """Registered converters, for ``ckptio convert --list-namings``."""
    return [{"name": c.name, "rules": len(c.rules), "needs": list(c.needs), "doc": c.doc} for c in CONVERTERS.values()]


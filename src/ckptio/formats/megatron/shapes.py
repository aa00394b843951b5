"""What a Megatron checkpoint's tensors must be, from the run's arguments: checked when it is read, before anything is
written or loaded.

A conversion writes the Hugging Face ``config.json`` made of the run's ``args`` (:func:`.config.hf_config`) beside
the weights: it must describe them. So each tensor, its tensor-parallel shards merged and its experts gathered, must
have the shape the sizes in the config give, or the read is refused naming the tensor, where it was read, its shape,
the expected one and the arguments giving that:

* ``hidden_size`` every norm, the embedding's and output layer's columns, every projection's input or output;
* ``num_attention_heads``, ``num_query_groups`` (with ``group_query_attention``) and ``kv_channels`` the fused
  ``linear_qkv`` (``(heads + 2 groups) x kv_channels`` rows, its bias as many), ``linear_proj``'s columns and the
  q/k norms (``kv_channels``);
* ``ffn_hidden_size`` a dense MLP (``[gate; up]``: twice as many rows in ``linear_fc1``), ``moe_ffn_hidden_size``
  each expert's, ``moe_shared_expert_intermediate_size`` the shared expert's, ``num_experts`` the router's rows;
* ``padded_vocab_size`` (when recorded) the embedding's and output layer's rows, at least ``vocab_size``;
* ``num_layers`` (when recorded) the number of layers held.

Which tensors there are (every layer's router and experts, Qwen2's biases, Qwen3's norms: exactly what the
arguments say) is checked first, by name (:func:`check`).
"""

from __future__ import annotations

from typing import Any, Callable

from ...errors import CheckpointCorruptError
from .fields import _arg
from .layout import _LAYER, OPTIONAL, VOCAB_KEYS

__all__ = ["check"]

_Size = tuple[int, str]
"""A size and the arguments that give it (``"hidden_size=64"``)."""


def check(index: dict[str, Any], args: Any, config: dict[str, Any], layers: int, where: object,
          origin: Callable[[str], str] | None = None) -> None:
    """``index`` (canonical Megatron-Core names -> ``.shape``, vocabulary padding not yet cut) holds what the run's
    ``args`` say, each tensor of the shape ``config`` (the Hugging Face config made of ``args``) gives; a
    :class:`~ckptio.errors.CheckpointCorruptError` naming the tensor (and where it was read, ``origin``), its shape,
    the expected one and the argument that disagrees otherwise."""
    from . import moe

    for suffix, switch in OPTIONAL.items():  # Qwen2's biases, Qwen3's q/k norms: in every layer exactly then
        held = sum(k.endswith(suffix) for k in index)
        if held != (layers if _arg(args, switch, False) else 0):
            raise CheckpointCorruptError(f"{where}: {held} of its {layers} layers hold {suffix}, but the run's "
                                         f"{switch}={_arg(args, switch)!r}")
    moe.check(index, args, layers, where)
    recorded = _arg(args, "num_layers", None)
    if type(recorded) is int and recorded != layers and index:  # (none: a torch_dist save without optimizer state)
        raise CheckpointCorruptError(f"{where}: holds {layers} layers, but the run's num_layers={recorded}")
    sizes = _sizes(args, config, where)
    for name, info in index.items():
        want = _want(name, sizes)
        found = tuple(info.shape)
        if want is None or len(found) == len(want) and all(map(_fits, found, want)):
            continue
        bad = [w for f, w in zip(found, want) if not _fits(f, w)] if len(found) == len(want) else want
        says = "; ".join(dict.fromkeys(w[1] for w in bad))
        shape = [w[0] if w[0] > 0 else f"at least {-w[0]}" for w in want]
        at = f" ({origin(name)})" if origin is not None else ""
        raise CheckpointCorruptError(f"{where}: {name}{at} has shape {list(found)}, not the {shape} of the run's "
                                     f"{says}: its args disagree with its weights")


def _fits(found: int, want: _Size) -> bool:
    """A dimension is the size wanted (at least ``-size`` for a negative one: rows of a vocabulary padded by a
    divisor the run did not record)."""
    return found == want[0] or want[0] < 0 and found >= -want[0]


def _sizes(args: Any, config: dict[str, Any], where: object) -> dict[str, _Size]:
    """The sizes the config gives, each with the argument(s) it comes from; refuses one that is no positive whole
    number."""
    def said(*names: str) -> str:
        return ", ".join(f"{n}={_arg(args, n)!r}" for n in names)

    experts_arg = "num_moe_experts" if _arg(args, "num_experts", None) is None and \
        _arg(args, "num_moe_experts", None) is not None else "num_experts"
    moe_ffn = "moe_ffn_hidden_size" if _arg(args, "moe_ffn_hidden_size", None) else "ffn_hidden_size"
    groups = ("num_query_groups", "group_query_attention") if _arg(args, "group_query_attention", False) else \
        ("num_attention_heads", "group_query_attention")
    head = ("kv_channels",) if _arg(args, "kv_channels", None) else ("kv_channels", "hidden_size",
                                                                      "num_attention_heads")
    fields: dict[str, tuple[Any, str]] = {
        "hidden": (config.get("hidden_size"), said("hidden_size")),
        "heads": (config.get("num_attention_heads"), said("num_attention_heads")),
        "groups": (config.get("num_key_value_heads"), said(*groups)),
        "head": (config.get("head_dim"), said(*head))}
    moe = "num_local_experts" in config or "num_experts" in config
    if not moe:
        fields["ffn"] = (config.get("intermediate_size"), said("ffn_hidden_size"))
    else:
        fields["experts"] = (config.get("num_local_experts", config.get("num_experts")), said(experts_arg))
        fields["expert_ffn"] = (config.get("moe_intermediate_size", config.get("intermediate_size")), said(moe_ffn))
        if "shared_expert_intermediate_size" in config:
            fields["shared"] = (config["shared_expert_intermediate_size"],
                                said("moe_shared_expert_intermediate_size"))
    padded = _arg(args, "padded_vocab_size", None)
    fields["vocab"] = (padded, said("padded_vocab_size")) if type(padded) is int else \
        (config.get("vocab_size"), f"{said('vocab_size')} (padded)")
    for value, label in fields.values():
        if type(value) is not int or value < 1:
            raise CheckpointCorruptError(f"{where}: the run's {label} gives a size of {value!r}, not a positive whole "
                                         "number")
    sizes = {k: (v, label) for k, (v, label) in fields.items()}
    if type(padded) is int and padded < config["vocab_size"]:
        raise CheckpointCorruptError(f"{where}: the run's {said('padded_vocab_size', 'vocab_size')}: the padded "
                                     "vocabulary is smaller than the vocabulary")
    if type(padded) is not int:
        sizes["vocab"] = (-sizes["vocab"][0], sizes["vocab"][1])
    (heads, _), (kv, _) = sizes["heads"], sizes["groups"]
    if heads % kv:
        raise CheckpointCorruptError(f"{where}: the run's {sizes['heads'][1]} and {sizes['groups'][1]}: query heads "
                                     f"{heads} do not divide into {kv} groups")
    attention = said(*dict.fromkeys(("num_attention_heads", *groups, *head)))
    sizes["qkv"] = ((heads + 2 * kv) * sizes["head"][0], attention)
    sizes["attn"] = (heads * sizes["head"][0], said(*dict.fromkeys(("num_attention_heads", *head))))
    return sizes


def _twice(size: _Size) -> _Size:
    return 2 * size[0], f"{size[1]} ([gate; up]: twice)"


_GLOBAL = {"decoder.final_layernorm.weight": ("hidden",), **{k: ("vocab", "hidden") for k in VOCAB_KEYS}}
_PER_LAYER = {
    "self_attention.linear_qkv.layer_norm_weight": ("hidden",), "mlp.linear_fc1.layer_norm_weight": ("hidden",),
    "self_attention.linear_qkv.weight": ("qkv", "hidden"), "self_attention.linear_qkv.bias": ("qkv",),
    "self_attention.linear_proj.weight": ("hidden", "attn"), "self_attention.q_layernorm.weight": ("head",),
    "self_attention.k_layernorm.weight": ("head",), "mlp.linear_fc1.weight": ("2ffn", "hidden"),
    "mlp.linear_fc2.weight": ("hidden", "ffn"), "mlp.router.weight": ("experts", "hidden"),
    "mlp.shared_experts.linear_fc1.weight": ("2shared", "hidden"),
    "mlp.shared_experts.linear_fc2.weight": ("hidden", "shared"), "mlp.shared_experts.gate_weight": ("one", "hidden"),
    "linear_fc1.weight": ("2expert_ffn", "hidden"), "linear_fc2.weight": ("hidden", "expert_ffn"),
}
"""Each parameter's dimensions, by size (``2x``: a ``[gate; up]`` pair); an expert's by the name after its number."""


def _want(name: str, sizes: dict[str, _Size]) -> list[_Size] | None:
    """The shape of parameter ``name`` (each dimension with the arguments giving it); ``None`` for one not known."""
    m = _LAYER.match(name)
    dims = _GLOBAL.get(name) if m is None else _PER_LAYER.get(
        m.group(2).split(".", 3)[-1] if m.group(2).startswith("mlp.experts.") else m.group(2))
    if dims is None:
        return None
    if not all(d.removeprefix("2") in sizes for d in dims if d != "one"):
        return None  # an MLP of a kind the run does not have: refused by name first
    out = []
    for d in dims:
        if d == "one":
            out.append((1, "shared expert's gate (one row)"))
        elif d.startswith("2"):
            out.append(_twice(sizes[d[1:]]))
        else:
            out.append(sizes[d])
    return out

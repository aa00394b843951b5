"""Naming converters: invertible to the bit, and a converted Llama runs to the same logits in Megatron layout."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from ckptio import CheckpointError
from ckptio.convert import CONVERTERS, check_invertible, get_converter
from ckptio.formats.naming import apply
from cli_here import ckptio_here


def _llama(tied: bool):
    from toy import make_model

    return make_model(seed=21, tie_word_embeddings=tied, num_attention_heads=4, num_key_value_heads=2).eval()


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def megatron_gpt_logits(sd: dict[str, torch.Tensor], cfg, ids: torch.Tensor) -> torch.Tensor:
    """An independent forward pass of a Megatron-Core-style GPT (SwiGLU, RMSNorm, RoPE, grouped-query)."""
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    hd = cfg.hidden_size // heads
    per = heads // kv
    eps = cfg.rms_norm_eps
    theta = getattr(cfg, "rope_theta", None) or (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    b, t = ids.shape
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    freqs = torch.outer(torch.arange(t, dtype=torch.float32), inv)
    cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()
    h = sd["embedding.word_embeddings.weight"][ids]
    mask = torch.full((t, t), float("-inf")).triu(1)
    for i in range(cfg.num_hidden_layers):
        p = f"decoder.layers.{i}."
        x = _rms(h, sd[p + "self_attention.linear_qkv.layer_norm_weight"], eps)
        qkv = (x @ sd[p + "self_attention.linear_qkv.weight"].T).view(b, t, kv, (per + 2) * hd)
        q, k, v = qkv.split([per * hd, hd, hd], dim=-1)
        q = q.reshape(b, t, heads, hd).transpose(1, 2)
        k = k.transpose(1, 2).repeat_interleave(per, dim=1)
        v = v.transpose(1, 2).repeat_interleave(per, dim=1)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd) + mask, dim=-1) @ v
        h = h + att.transpose(1, 2).reshape(b, t, heads * hd) @ sd[p + "self_attention.linear_proj.weight"].T
        x = _rms(h, sd[p + "mlp.linear_fc1.layer_norm_weight"], eps)
        gate, up = (x @ sd[p + "mlp.linear_fc1.weight"].T).chunk(2, dim=-1)
        h = h + (F.silu(gate) * up) @ sd[p + "mlp.linear_fc2.weight"].T
    h = _rms(h, sd["decoder.final_layernorm.weight"], eps)
    return h @ sd.get("output_layer.weight", sd["embedding.word_embeddings.weight"]).T


@pytest.mark.parametrize("tied", [False, True])
def test_llama_to_megatron_gives_the_same_logits_and_round_trips_bitwise(tied):
    model = _llama(tied)
    sd = {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    config = model.config.to_dict()
    conv = get_converter("llama-to-megatron")
    check_invertible(conv, sd, config)
    mega = apply(conv, sd, config)
    assert mega["decoder.layers.0.self_attention.linear_qkv.weight"].shape == (
        (model.config.num_attention_heads + 2 * model.config.num_key_value_heads) * 8, model.config.hidden_size)
    ids = torch.randint(4, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        got = megatron_gpt_logits(mega, model.config, ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _mixtral_files(folder, kind: str = "mixtral") -> tuple[dict, dict]:
    """A tiny Mixtral's (or Qwen2-MoE's) tensors as transformers saves them (each expert's w1/w2/w3, gate_proj/
    up_proj/down_proj, not the fused 3-D experts it holds in memory) and its config."""
    from safetensors.torch import load_file
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(0)
    sizes = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 num_experts_per_tok=2)
    if kind == "qwen2moe":
        Qwen2MoeForCausalLM(Qwen2MoeConfig(**sizes, intermediate_size=32, moe_intermediate_size=16, num_experts=3,
                                           shared_expert_intermediate_size=24)).save_pretrained(folder)
    else:
        MixtralForCausalLM(MixtralConfig(**sizes, intermediate_size=16, num_local_experts=3)).save_pretrained(folder)
    sd = {}
    for f in sorted(folder.glob("*.safetensors")):
        sd.update(load_file(f))
    return sd, json.loads((folder / "config.json").read_text())


def test_every_registered_converter_is_invertible(tmp_path):
    """The test every converter must pass (docs/converters.md): forward then inverse is the identity."""
    model = _llama(False)
    models = {"llama": (model.state_dict(), model.config.to_dict()), "mixtral": _mixtral_files(tmp_path / "m"),
              "qwen2moe": _mixtral_files(tmp_path / "q", "qwen2moe")}
    for name, conv in CONVERTERS.items():
        sd, config = models[next((k for k in ("mixtral", "qwen2moe") if k in name), "llama")]
        if name.startswith(("llama-to", "mixtral-to", "qwen2moe-to")):
            check_invertible(conv, sd, config)
        else:
            check_invertible(conv, apply(conv.inverse(), sd, config), config)


def test_mixtral_to_megatron_fuses_each_experts_gate_and_up(tmp_path):
    """Mixtral's w1 (gate) and w3 (up) become Megatron's [gate; up] in the expert's linear_fc1, w2 its linear_fc2,
    the gate Megatron's router: each expert by its own index."""
    sd, config = _mixtral_files(tmp_path)
    mega = apply(get_converter("mixtral-to-megatron"), sd, config)
    e = "model.layers.1.block_sparse_moe."
    assert torch.equal(mega["decoder.layers.1.mlp.experts.2.linear_fc1.weight"],
                       torch.cat([sd[e + "experts.2.w1.weight"], sd[e + "experts.2.w3.weight"]]))
    assert torch.equal(mega["decoder.layers.1.mlp.experts.2.linear_fc2.weight"], sd[e + "experts.2.w2.weight"])
    assert torch.equal(mega["decoder.layers.1.mlp.router.weight"], sd[e + "gate.weight"])
    assert not any(k.endswith((".mlp.linear_fc1.weight", ".mlp.linear_fc2.weight")) for k in mega)


def test_qwen2moe_to_megatron_maps_the_shared_expert_and_its_gate(tmp_path):
    """Qwen2-MoE's shared expert becomes megatron-core's shared_experts ([gate_proj; up_proj] in linear_fc1), its
    sigmoid gate shared_experts.gate_weight; each expert and the router as Mixtral's, under Qwen2-MoE's names."""
    sd, config = _mixtral_files(tmp_path, "qwen2moe")
    mega = apply(get_converter("qwen2moe-to-megatron"), sd, config)
    e, m = "model.layers.1.mlp.", "decoder.layers.1.mlp."
    assert torch.equal(mega[m + "shared_experts.linear_fc1.weight"],
                       torch.cat([sd[e + "shared_expert.gate_proj.weight"], sd[e + "shared_expert.up_proj.weight"]]))
    assert torch.equal(mega[m + "shared_experts.linear_fc2.weight"], sd[e + "shared_expert.down_proj.weight"])
    assert torch.equal(mega[m + "shared_experts.gate_weight"], sd[e + "shared_expert_gate.weight"])
    assert torch.equal(mega[m + "experts.2.linear_fc1.weight"],
                       torch.cat([sd[e + "experts.2.gate_proj.weight"], sd[e + "experts.2.up_proj.weight"]]))
    assert torch.equal(mega[m + "router.weight"], sd[e + "gate.weight"])
    assert mega["decoder.layers.1.self_attention.linear_qkv.bias"].shape == (64,)


def test_unmatched_keys_are_refused_by_name():
    model = _llama(False)
    sd = dict(model.state_dict())
    sd["model.layers.0.extra_adapter.weight"] = torch.zeros(2)
    with pytest.raises(CheckpointError, match="extra_adapter"):
        apply(get_converter("llama-to-megatron"), sd, model.config.to_dict())
    del sd["model.layers.0.extra_adapter.weight"], sd["model.layers.1.self_attn.k_proj.weight"]
    with pytest.raises(CheckpointError, match="k_proj"):
        apply(get_converter("llama-to-megatron"), sd, model.config.to_dict())


def test_cli_converts_a_hf_folder_to_megatron_naming_and_back(tmp_path):
    from transformers import AutoModelForCausalLM

    model = _llama(False)
    model.save_pretrained(tmp_path / "hf")
    run = lambda *a: ckptio_here("convert", *a, "--no-progress")  # noqa: E731
    out = run(str(tmp_path / "hf"), str(tmp_path / "mega"), "--to", "safetensors", "--naming", "llama-to-megatron")
    assert out.returncode == 0, out.stderr
    from ckptio.formats.safetensors.sharded import read_index

    assert "decoder.layers.1.mlp.linear_fc1.weight" in read_index(tmp_path / "mega")
    out = run(str(tmp_path / "mega"), str(tmp_path / "back"), "--to", "hf", "--naming", "megatron-to-llama")
    assert out.returncode == 0, out.stderr
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "back")
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    assert json.loads((tmp_path / "back" / "config.json").read_text())["model_type"] == "llama"

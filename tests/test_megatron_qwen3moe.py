"""The Qwen3-MoE family in Megatron checkpoints, both ways: experts routed by ``norm_topk_prob``, q/k norms, no biases.

Megatron-LM trains a Qwen3-MoE as a GPT model with Mixtral's MoE arguments (``--num-experts E --moe-router-topk K
--moe-ffn-hidden-size F``, no shared expert) and ``--qk-layernorm`` (an RMSNorm on each query and key head, as a dense
Qwen3's), routed with ``--moe-router-pre-softmax`` as ``norm_topk_prob=False`` or without it as ``norm_topk_prob=True``
(Qwen3's own models). Hugging Face holds it as ``Qwen3MoeForCausalLM``, saved per expert under Qwen2-MoE's names
(transformers 5 fuses them in memory and writes the expert count as ``num_local_experts``; the Hub's configs say
``num_experts``). In: megatron-core itself (``megatron_fixture.py --family qwen3moe``) builds, saves and runs a tiny
Qwen3-MoE at TP=2 EP=2, and ``ckptio convert`` gives a Qwen3-MoE with Megatron's logits from both layouts, on tokens
routed to every expert; a resume brings its Adam moments onto the Hugging Face model. Out: a Qwen3-MoE written with
``--to megatron`` loads in megatron-core (strict) at EP=2 with the same logits, and comes back bitwise. What it does
not compute (dense layers between, a window, biases, a shared expert...) is refused by name, nothing written.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch

from ckptio.convert.formats import convert
from ckptio.errors import CheckpointError
from ckptio.formats.hf_fields import UnsupportedFieldError
from fixture_cache import built
from megatron_shared import config_of, respelled, routed_logits, run_fixture, same_weights, with_args

# the fixture's tiny model (megatron_fixture.py --family qwen3moe): 4 experts of 32, 2 per token
SIZES = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-6,
             tie_word_embeddings=False, num_experts_per_tok=2, moe_intermediate_size=32)
THETA = 1000000.0
IDS = (torch.arange(48).reshape(2, 24) * 7) % 128


def _run(hf: Path, ids: torch.Tensor) -> tuple[torch.Tensor, list[set[int]]]:
    from transformers import Qwen3MoeForCausalLM

    return routed_logits(hf, ids, Qwen3MoeForCausalLM)


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> Path:
    """A Qwen3MoeForCausalLM routed as Qwen3's own models (norm_topk_prob=True), its router and q/k norms made to
    matter, saved by transformers."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(3)
    config = Qwen3MoeConfig(**SIZES, num_experts=4, norm_topk_prob=True,
                            rope_parameters={"rope_theta": THETA, "rope_type": "default"})
    model = Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 0.5)
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    folder = tmp_path_factory.mktemp("qwen3moe") / "model"
    model.save_pretrained(folder)
    return folder


# ------------------------------------------------------------------------------------------- out and back
@pytest.mark.parametrize("layout,tp,pp,norm", [("dist", 2, 2, True), ("legacy", 1, 1, False)])
def test_qwen3moe_to_megatron_and_back_is_bitwise(hf, tmp_path, layout, tp, pp, norm):
    """Out at TP=2 PP=2 (transformers 5's num_local_experts) or routed the other way with the Hub's spelling
    (num_experts), and back: every tensor bitwise, the config the same, the same logits."""
    from ckptio.formats.megatron.format import MegatronSource
    from ckptio.formats.megatron.layout import run_args

    src = hf
    if not norm:  # the Hub's spelling of the expert count, routed without renormalising
        src = respelled(Path(shutil.copytree(hf, tmp_path / "src")), norm_topk_prob=False, num_local_experts=None,
                        num_experts=4)
    assert "num_local_experts" in config_of(src) or "num_experts" in config_of(src)
    out = convert(src, tmp_path / "mg", "megatron", options={"tp": tp, "pp": pp, "layout": layout})
    args = run_args(out)
    assert (args.num_experts, args.moe_router_topk, args.moe_ffn_hidden_size) == (4, 2, 32)
    assert args.qk_layernorm is True and args.add_qkv_bias is False and args.moe_router_pre_softmax is not norm
    assert getattr(args, "moe_shared_expert_intermediate_size", None) is None
    index = MegatronSource(out).index()
    assert index["decoder.layers.3.self_attention.q_layernorm.weight"].shape == (16,)
    assert not any("shared_experts" in k or k.endswith(".bias") for k in index)
    back = convert(out, tmp_path / "back", "hf")
    same_weights(src, back)
    config = config_of(back)
    assert config["model_type"] == "qwen3_moe" and config["architectures"] == ["Qwen3MoeForCausalLM"]
    assert {k: config[k] for k in SIZES} == SIZES and config["num_experts"] == 4 and config["norm_topk_prob"] is norm
    assert (config["decoder_sparse_step"], config["mlp_only_layers"], config["attention_bias"]) == (1, [], False)
    assert config["use_sliding_window"] is False and config["sliding_window"] is None
    (want, routed), (got, _) = _run(src, IDS), _run(back, IDS)
    assert all(r == {0, 1, 2, 3} for r in routed), routed
    assert torch.equal(got, want)


def test_a_qwen3moe_config_json_beside_a_checkpoint_without_args_gives_its_family(hf, tmp_path):
    out = convert(hf, tmp_path / "mg", "megatron", options={"layout": "dist"})
    torch.save({}, out / "iter_0000000" / "common.pt")
    shutil.copy(hf / "config.json", out / "config.json")
    back = convert(out, tmp_path / "back", "hf")
    same_weights(hf, back)
    assert config_of(back)["model_type"] == "qwen3_moe" and config_of(back)["norm_topk_prob"] is True


# ------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("changes,field,value", [
    ({"decoder_sparse_step": 2}, "decoder_sparse_step", 2),
    ({"mlp_only_layers": [1]}, "mlp_only_layers", [1]),
    ({"use_sliding_window": True, "sliding_window": 8}, "use_sliding_window", True),
    ({"attention_bias": True}, "attention_bias", True),
    ({"hidden_act": "gelu"}, "hidden_act", "gelu"),
])
def test_qwen3moe_fields_megatron_does_not_carry_are_refused_by_name(hf, tmp_path, changes, field, value):
    src = respelled(Path(shutil.copytree(hf, tmp_path / "src")), **changes)
    with pytest.raises(UnsupportedFieldError) as err:
        convert(src, tmp_path / "mg", "megatron")
    assert err.value.field == field and err.value.value == value
    assert not (tmp_path / "mg").exists()


def test_two_different_expert_counts_are_refused(hf, tmp_path):
    src = respelled(Path(shutil.copytree(hf, tmp_path / "src")), num_experts=8)
    with pytest.raises(CheckpointError, match="num_experts = 8 and num_local_experts = 4"):
        convert(src, tmp_path / "mg", "megatron")
    assert not (tmp_path / "mg").exists()


@pytest.mark.parametrize("changes,says", [
    ({"add_qkv_bias": True}, "qk_layernorm with add_qkv_bias"),
    ({"moe_shared_expert_intermediate_size": 48, "moe_shared_expert_gate": True}, "experts with qk_layernorm or"),
    ({"moe_router_pre_softmax": 1}, "moe_router_pre_softmax=1, not true or false"),
    ({"moe_layer_freq": [1, 0, 1, 0]}, "moe_layer_freq=[1, 0, 1, 0] (dense layers between"),
    ({"moe_router_topk_scaling_factor": 2.5}, "moe_router_topk_scaling_factor=2.5 (scaled routing weights)"),
])
def test_megatron_arguments_a_qwen3moe_does_not_compute_are_refused_by_name(hf, tmp_path, changes, says):
    """Q/k norms come without biases and without a shared expert (that would be neither Qwen MoE); Mixtral's other
    refusals (dense layers between, scaled routing) stay."""
    out = with_args(hf, tmp_path, **changes)
    with pytest.raises(CheckpointError, match=re.escape(says)):
        convert(out, tmp_path / "back", "hf")
    assert not (tmp_path / "back").exists()


# ------------------------------------------------------------------------------------------- megatron-core
@pytest.fixture(scope="module")
def made() -> Path:
    """One megatron-core run at TP=2 EP=2 (four gloo ranks), routed as norm_topk_prob=False, in both layouts."""
    pytest.importorskip("megatron.core")
    return built("megatron_fixture.py", "--family", "qwen3moe", "--tp", "2", "--ep", "2")


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["torch_dist", "legacy"])
def test_megatron_qwen3moe_converts_to_a_qwen3moe_with_megatrons_logits(made, tmp_path, layout):
    ref = torch.load(made / "reference.pt")
    back = convert(made / layout, tmp_path / "hf", "hf")
    config = config_of(back)
    assert config["model_type"] == "qwen3_moe" and config["norm_topk_prob"] is False
    assert (config["num_experts"], config["router_aux_loss_coef"], config["rms_norm_eps"]) == (4, 0.02, 1e-6)
    got, routed = _run(back, ref["input_ids"])
    assert all(r == {0, 1, 2, 3} for r in routed), f"not every expert got tokens: {routed}"
    assert torch.allclose(got, ref["logits"], atol=1e-5, rtol=0), (got - ref["logits"]).abs().max()


@pytest.mark.slow
def test_megatron_core_loads_a_qwen3moe_ckptio_exports_at_another_expert_parallelism(hf, tmp_path):
    """The Qwen3MoeForCausalLM (norm_topk_prob=True) -> ``--to megatron`` at TP=2 -> megatron-core's strict loader into
    a TP=1 EP=2 model routed without pre-softmax -> the logits transformers gives."""
    pytest.importorskip("megatron.core")
    out = convert(hf, tmp_path / "mg", "megatron", options={"tp": 2})
    run_fixture("--family", "qwen3moe", "--norm-topk", "--ep", "2", "--load", str(out / "iter_0000000"),
                "--out", str(tmp_path / "logits.pt"))
    got = torch.load(tmp_path / "logits.pt")
    want, routed = _run(hf, got["input_ids"])
    assert all(r == {0, 1, 2, 3} for r in routed), routed
    assert torch.allclose(got["logits"], want, atol=1e-5, rtol=0), (got["logits"] - want).abs().max()


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_restore_from_megatron_brings_a_qwen3moe_its_experts_norms_and_their_moments(made, tmp_path, world):
    """A plain Qwen3MoeForCausalLM (its experts fused in memory) with AdamW, on 1 rank and under FSDP2 on 2 (the
    DTensors gathered whole), restored from the torch_dist run: every weight and Adam moment is Megatron's, bit for
    bit, the experts', the router's and the q/k norms' included, every parameter holds the fixture's one Adam step,
    and it trains on."""
    from distributed import run_ranks
    from megatron_shared import holds_megatrons_state, restore_with_adam

    src = made / "torch_dist"
    got = run_ranks(world, restore_with_adam, source=str(src), config=str(convert(src, tmp_path / "hf", "hf")),
                    train=True)[0]
    assert bool(torch.isfinite(got.pop("loss"))) and bool((got.pop("steps_after") == 2).all())
    holds_megatrons_state(got, src / "iter_0000002", params=47)


@pytest.mark.parametrize("layout,tp,arg,value,says", [
    ("dist", 1, "moe_ffn_hidden_size", 16, r"decoder\.layers\.\d\.mlp\.experts\.\d\.linear_fc[12]\.weight \(torch_dist "
     r"tensor decoder\.layers\.mlp\.experts\.experts\.linear_fc[12]\.weight\[\d, \d\]\) has shape .* of the run's "
     r"moe_ffn_hidden_size=16"),
    ("legacy", 2, "hidden_size", 128, r"has shape \[.*64.*\], not the \[.*128.*\] of the run's hidden_size=128"),
])
def test_args_that_disagree_with_the_weights_are_refused_by_name(hf, tmp_path, layout, tp, arg, value, says):
    """Issue 69: each expert's size is the run's moe_ffn_hidden_size (config.json's moe_intermediate_size), every
    projection's the run's hidden_size."""
    out = with_args(hf, tmp_path, layout=layout, tp=tp, **{arg: value})
    with pytest.raises(CheckpointError, match=says):
        convert(out, tmp_path / "back", "hf")
    assert not (tmp_path / "back").exists()

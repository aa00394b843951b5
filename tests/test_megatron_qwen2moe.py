"""The Qwen2-MoE family in Megatron checkpoints, both ways: experts, a sigmoid-gated shared expert, q/k/v biases.

Megatron-LM trains a Qwen2-MoE as a GPT model with ``--num-experts E --moe-router-topk K --moe-ffn-hidden-size F
--moe-shared-expert-intermediate-size S --moe-shared-expert-gate --add-qkv-bias`` (megatron-core's ``SharedExpertMLP``
with its ``gate_weight``), routed with ``--moe-router-pre-softmax`` as Qwen2-MoE's ``norm_topk_prob=False`` (softmax
over every expert, top-k, not renormalised) or without it as ``norm_topk_prob=True``. Hugging Face holds it as
``Qwen2MoeForCausalLM``, saved per expert (``mlp.experts.{j}.gate_proj``...; transformers 5 fuses them in memory).
In: megatron-core itself (``megatron_fixture.py --family qwen2moe``) builds, saves and runs a tiny Qwen2-MoE at TP=2
EP=2, and ``ckptio convert`` gives a Qwen2-MoE with Megatron's logits from both layouts, on tokens routed to every
expert. Out: a Qwen2-MoE (``norm_topk_prob=True``, the other routing) written with ``--to megatron`` loads in
megatron-core (strict) at EP=2 with the same logits, and comes back bitwise. What neither family computes (dense layers
between, an ungated shared expert, a Qwen2-MoE without its biases...) is refused by name, nothing written.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from ckptio.convert.formats import convert
from ckptio.errors import CheckpointError
from ckptio.formats.hf_fields import UnsupportedFieldError
from cli_here import ckptio_here
from fixture_cache import built
from megatron_shared import config_of, respelled, routed_logits, run_fixture, same_weights, with_args

# the fixture's tiny model (megatron_fixture.py --family qwen2moe): 4 experts of 32, 2 per token, a shared one of 48
SIZES = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-6,
             tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
             shared_expert_intermediate_size=48)
THETA = 1000000.0
IDS = (torch.arange(48).reshape(2, 24) * 7) % 128


def _qwen2moe(folder: Path, *, seed: int = 3, **extra) -> Path:
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen2MoeConfig(**{**SIZES, **extra}, rope_parameters={"rope_theta": THETA, "rope_type": "default"})
    model = Qwen2MoeForCausalLM(config).eval()
    with torch.no_grad():  # a router that tells the experts apart, biases and a gate that matter
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 0.5)
            layer.mlp.shared_expert_gate.weight.normal_(0.0, 0.5)
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0.0, 0.1)
    model.save_pretrained(folder)
    return folder


def _run(hf: Path, ids: torch.Tensor) -> tuple[torch.Tensor, list[set[int]]]:
    from transformers import Qwen2MoeForCausalLM

    return routed_logits(hf, ids, Qwen2MoeForCausalLM)


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> Path:
    return _qwen2moe(tmp_path_factory.mktemp("qwen2moe") / "model")


# ------------------------------------------------------------------------------------------- out and back
@pytest.mark.parametrize("layout,tp,pp,norm,ep", [("dist", 2, 2, False, None), ("legacy", 2, 2, False, None),
                                                  ("legacy", 1, 1, True, None), ("legacy", 2, 2, False, 2)])
def test_qwen2moe_to_megatron_and_back_is_bitwise(hf, tmp_path, layout, tp, pp, norm, ep):
    from ckptio.formats.megatron.format import MegatronSource
    from ckptio.formats.megatron.layout import run_args

    src = respelled(Path(shutil.copytree(hf, tmp_path / "src")), norm_topk_prob=True) if norm else hf
    out = convert(src, tmp_path / "mg", "megatron", options={"tp": tp, "pp": pp, "layout": layout, "ep": ep})
    args = run_args(out)
    if ep:  # mp_rank_TT_PPP_EEE: each EP rank two of the experts, the shared expert in every one
        assert len(list((out / "iter_0000000").glob("mp_rank_0?_00?_00?"))) == tp * pp * ep
    assert (args.num_experts, args.moe_router_topk, args.moe_ffn_hidden_size) == (4, 2, 32)
    assert (args.moe_shared_expert_intermediate_size, args.moe_shared_expert_gate, args.add_qkv_bias) == (48, True, True)
    assert args.moe_router_pre_softmax is not norm and args.ffn_hidden_size == 128
    index = MegatronSource(out).index()
    assert index["decoder.layers.3.mlp.shared_experts.linear_fc1.weight"].shape == (96, 64)
    assert index["decoder.layers.3.mlp.shared_experts.gate_weight"].shape == (1, 64)
    assert index["decoder.layers.3.self_attention.linear_qkv.bias"].shape == (128,)
    back = convert(out, tmp_path / "back", "hf")
    same_weights(src, back)
    config = config_of(back)
    assert config["model_type"] == "qwen2_moe" and config["architectures"] == ["Qwen2MoeForCausalLM"]
    assert {k: config[k] for k in SIZES} == SIZES and config["norm_topk_prob"] is norm
    assert config["decoder_sparse_step"] == 1 and config["mlp_only_layers"] == [] and config["qkv_bias"] is True
    (want, routed), (got, _) = _run(src, IDS), _run(back, IDS)
    assert all(r == {0, 1, 2, 3} for r in routed), routed
    assert torch.equal(got, want)


def test_a_qwen2moe_config_json_beside_a_checkpoint_without_args_gives_its_family(hf, tmp_path):
    out = convert(hf, tmp_path / "mg", "megatron", options={"layout": "dist"})
    torch.save({}, out / "iter_0000000" / "common.pt")
    shutil.copy(hf / "config.json", out / "config.json")
    back = convert(out, tmp_path / "back", "hf")
    same_weights(hf, back)
    assert config_of(back)["model_type"] == "qwen2_moe" and config_of(back)["norm_topk_prob"] is False


# ------------------------------------------------------------------------------------------- refusals

@pytest.mark.parametrize("changes,field,value", [
    ({"decoder_sparse_step": 2}, "decoder_sparse_step", 2),
    ({"mlp_only_layers": [1]}, "mlp_only_layers", [1]),
    ({"qkv_bias": False}, "qkv_bias", False),
    ({"use_sliding_window": True, "sliding_window": 8}, "use_sliding_window", True),
    ({"hidden_act": "gelu"}, "hidden_act", "gelu"),
])
def test_qwen2moe_fields_megatron_does_not_carry_are_refused_by_name(hf, tmp_path, changes, field, value):
    src = respelled(Path(shutil.copytree(hf, tmp_path / "src")), **changes)
    with pytest.raises(UnsupportedFieldError) as err:
        convert(src, tmp_path / "mg", "megatron")
    assert err.value.field == field and err.value.value == value
    assert not (tmp_path / "mg").exists()


@pytest.mark.parametrize("changes,says", [
    ({"moe_shared_expert_gate": False}, "moe_shared_expert_gate=False (a shared expert without Qwen2-MoE's sigmoid"),
    ({"add_qkv_bias": False}, "moe_shared_expert_intermediate_size=48 (shared experts, a Qwen2-MoE's) without add_qkv"),
    ({"qk_layernorm": True}, "experts with qk_layernorm or add_qkv_bias"),
    ({"moe_shared_expert_intermediate_size": None}, "experts with qk_layernorm or add_qkv_bias"),
    ({"moe_router_topk_scaling_factor": 2.5}, "moe_router_topk_scaling_factor=2.5 (scaled routing weights)"),
    ({"moe_router_score_function": "sigmoid"}, "moe_router_score_function='sigmoid' (sigmoid router scores)"),
    ({"moe_layer_freq": [1, 0, 1, 0]}, "moe_layer_freq=[1, 0, 1, 0] (dense layers between"),
    ({"moe_router_pre_softmax": 1}, "moe_router_pre_softmax=1, not true or false"),
])
def test_megatron_arguments_a_qwen2moe_does_not_compute_are_refused_by_name(hf, tmp_path, changes, says):
    """A shared expert must be gated (Qwen2-MoE's sigmoid gate) and come with Qwen2's q/k/v biases; without a shared
    expert the biases make no Mixtral; Mixtral's other refusals (scaling, sigmoid scores, dense layers) stay."""
    out = with_args(hf, tmp_path, **changes)
    run = ckptio_here("convert", str(out), str(tmp_path / "back"), "--to", "hf", "--no-progress")
    assert run.returncode == 2 and says in run.stderr, run.stderr
    assert not (tmp_path / "back").exists()


def test_a_layer_without_its_shared_expert_gate_is_refused(hf, tmp_path):
    out = convert(hf, tmp_path / "mg", "megatron", options={"tp": 2, "layout": "legacy"})
    for f in (out / "iter_0000000").glob("mp_rank_*/model_optim_rng.pt"):
        state = torch.load(f, weights_only=False)
        del state["model"]["decoder.layers.1.mlp.shared_experts.gate_weight"]
        torch.save(state, f)
    with pytest.raises(CheckpointError, match=r"moe_shared_expert_intermediate_size=48.*layers.1.mlp.shared_experts"):
        convert(out, tmp_path / "back", "hf")
    assert not (tmp_path / "back").exists()


# ------------------------------------------------------------------------------------------- megatron-core
TP, EP = 2, 2


@pytest.fixture(scope="module")
def made() -> Path:
    """One megatron-core run at TP=2 EP=2 (four gloo ranks), routed as norm_topk_prob=False, in both layouts."""
    pytest.importorskip("megatron.core")
    return built("megatron_fixture.py", "--family", "qwen2moe", "--tp", str(TP), "--ep", str(EP))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["torch_dist", "legacy"])
def test_megatron_qwen2moe_converts_to_a_qwen2moe_with_megatrons_logits(made, tmp_path, layout):
    ref = torch.load(made / "reference.pt")
    if layout == "legacy":  # Megatron-LM's names: the expert-parallel rank after the tensor-parallel one
        assert sorted(p.name for p in (made / layout / "iter_0000002").iterdir()) == [
            "mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    run = ckptio_here("convert", str(made / layout), str(tmp_path / "hf"), "--to", "hf", "--no-progress")
    assert run.returncode == 0, run.stderr
    config = config_of(tmp_path / "hf")
    assert config["model_type"] == "qwen2_moe" and config["norm_topk_prob"] is False
    assert (config["shared_expert_intermediate_size"], config["router_aux_loss_coef"]) == (48, 0.02)
    got, routed = _run(tmp_path / "hf", ref["input_ids"])
    assert all(r == {0, 1, 2, 3} for r in routed), f"not every expert got tokens: {routed}"
    assert torch.allclose(got, ref["logits"], atol=1e-5, rtol=0), (got - ref["logits"]).abs().max()


@pytest.mark.slow
def test_megatron_core_loads_a_qwen2moe_ckptio_exports_at_another_expert_parallelism(tmp_path):
    """A Qwen2MoeForCausalLM with norm_topk_prob=True made by transformers -> ``--to megatron`` at TP=2 -> megatron-core's
    strict loader into a TP=1 EP=2 model routed without pre-softmax -> the logits transformers gives."""
    pytest.importorskip("megatron.core")
    src = _qwen2moe(tmp_path / "hf", seed=1, norm_topk_prob=True)
    run = ckptio_here("convert", str(src), str(tmp_path / "mg"), "--to", "megatron", "--tp", "2", "--no-progress")
    assert run.returncode == 0, run.stderr
    run_fixture("--family", "qwen2moe", "--norm-topk", "--ep", "2", "--load", str(tmp_path / "mg" / "iter_0000000"),
                "--out", str(tmp_path / "logits.pt"))
    got = torch.load(tmp_path / "logits.pt")
    want, routed = _run(src, got["input_ids"])
    assert all(r == {0, 1, 2, 3} for r in routed), routed
    assert torch.allclose(got["logits"], want, atol=1e-5, rtol=0), (got["logits"] - want).abs().max()


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_restore_from_megatron_brings_a_qwen2moe_its_experts_and_their_moments(made, tmp_path, world):
    """A plain Qwen2MoeForCausalLM (its experts fused into gate_up_proj and down_proj in memory) with AdamW, on 1 rank
    and under FSDP2 on 2 (the DTensors gathered whole; the shared expert's [1, 64] gate split 1 row and 0),
    restored from the torch_dist run: every weight and Adam moment is Megatron's, bit for bit, the experts', the
    shared expert's and the biases' included, every parameter holds Megatron's one Adam step, and it trains on."""
    from distributed import run_ranks
    from megatron_shared import holds_megatrons_state, restore_with_adam

    src = made / "torch_dist"
    hf = convert(src, tmp_path / "hf", "hf")
    got = run_ranks(world, restore_with_adam, source=str(src), config=str(hf), train=True)[0]
    assert bool(torch.isfinite(got.pop("loss"))) and bool((got.pop("steps_after") == 2).all())
    holds_megatrons_state(got, src / "iter_0000002", params=67)


@pytest.mark.slow
def test_fuzz_family_smoke(made):
    """A CI-sized run of the megatron_qwen2moe fuzz family (the long run: ``tools/fuzz_readers.py --family
    megatron_qwen2moe --inputs 100000``, on a TP1 PP2 EP2 run of its own): every damaged folder of a megatron-core
    Qwen2-MoE ends in a right read or a ckptio error. Here on this file's TP2 EP2 run, put where the family keeps its
    run so that it is not built twice."""
    import sys

    from megatron_shared import fuzz_smoke

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    from fuzz_frameworks import _fixed_dir

    for layout in ("torch_dist", "legacy"):
        if not (_fixed_dir("megatron-qwen2moe") / layout).exists():
            shutil.copytree(made / layout, _fixed_dir("megatron-qwen2moe") / layout)
    fuzz_smoke("megatron_qwen2moe", 30)


@pytest.mark.parametrize("layout,tp,arg,value,says", [
    ("dist", 1, "moe_shared_expert_intermediate_size", 24, r"decoder\.layers\.\d\.mlp\.shared_experts\.linear_fc[12]"
     r"\.weight \(torch_dist tensor decoder\.layers\.mlp\.shared_experts\.linear_fc[12]\.weight\[\d\]\) has shape "
     r"\[(96, 64|64, 48)\], not the \[(48, 64|64, 24)\] of the run's moe_shared_expert_intermediate_size=24"),
    ("legacy", 2, "moe_shared_expert_intermediate_size", 24, r"mlp\.shared_experts\.linear_fc[12]\.weight \(read "
     r"from iter_0000000/mp_rank_00/model_optim_rng\.pt, merged with .*\(TP=2\)\) has shape .* of the run's "
     r"moe_shared_expert_intermediate_size=24"),
    ("legacy", 2, "moe_ffn_hidden_size", 64, r"mlp\.experts\.\d\.linear_fc[12]\.weight .* of the run's "
     r"moe_ffn_hidden_size=64"),
])
def test_args_that_disagree_with_the_weights_are_refused_by_name(hf, tmp_path, layout, tp, arg, value, says):
    """Issue 69: a shared expert of 48 saved with moe_shared_expert_intermediate_size=24 gave a config.json of 24
    beside weights of 48; each tensor now has the shape the run's args give, or the read is refused by name."""
    out = with_args(hf, tmp_path, layout=layout, tp=tp, **{arg: value})
    with pytest.raises(CheckpointError, match=says):
        convert(out, tmp_path / "back", "hf")
    assert not (tmp_path / "back").exists()


@pytest.mark.parametrize("folder,local,name", [
    ("mp_rank_00_001_001", "decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight",
     r"decoder\.layers\.3\.mlp\.experts\.3\.linear_fc2\.weight"),
    ("mp_rank_00_001_000", "decoder.layers.0.mlp.shared_experts.linear_fc2.weight",
     r"decoder\.layers\.3\.mlp\.shared_experts\.linear_fc2\.weight")], ids=["expert", "shared"])
def test_a_legacy_tensor_of_a_shape_the_args_disagree_with_is_refused_naming_its_rank_file(hf, tmp_path, folder, local,
                                                                                            name):
    """At PP=2 x VPP=2 x EP=2 the read names the rank file and model chunk holding the tensor of the wrong shape: an
    expert's, in the file of the EP rank that holds it (EP rank 1's local expert 1 is expert 3), or a shared
    parameter's (EP rank 0's file is read for it)."""
    out = convert(hf, tmp_path / "mg", "megatron", options={"layout": "legacy", "pp": 2, "vpp": 2, "ep": 2})
    rank_file = out / "iter_0000000" / folder / "model_optim_rng.pt"
    obj = torch.load(rank_file, weights_only=False)
    obj["model1"][local] = obj["model1"][local][:, :16].clone()
    torch.save(obj, rank_file)
    with pytest.raises(CheckpointError, match=rf"{name} \(read from iter_0000000/{folder}/model_optim_rng\.pt's "
                                              r"model1\) has shape \[64, 16\]"):
        convert(out, tmp_path / "back", "hf")
    assert not (tmp_path / "back").exists()


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["torch_dist", "legacy"])
def test_megatron_cores_run_with_a_shared_expert_size_its_weights_do_not_have_is_refused(made, tmp_path, layout):
    """Issue 69 on megatron-core's own run (TP=2 EP=2, shared expert of 48): its saved args changed to
    moe_shared_expert_intermediate_size=24 are refused by name, nothing written."""
    from megatron_shared import rewrite_args

    run = Path(shutil.copytree(made / layout, tmp_path / "run"))  # the fixture is shared: a copy
    rewrite_args(run / "iter_0000002", moe_shared_expert_intermediate_size=24)
    with pytest.raises(CheckpointError, match=r"mlp\.shared_experts\.linear_fc[12]\.weight \(.*\) has shape "
                       r"\[(96, 64|64, 48)\], not the \[(48, 64|64, 24)\] of the run's "
                       r"moe_shared_expert_intermediate_size=24"):
        convert(run, tmp_path / "back", "hf")
    assert not (tmp_path / "back").exists()

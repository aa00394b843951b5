"""The Mixtral family in Megatron checkpoints, both ways: a mixture of experts in every layer.

Megatron-LM trains Mixtral as a GPT model with ``--num-experts E --moe-router-topk K`` (Megatron-Core's MoE layer:
a router ``mlp.router.weight`` and E SwiGLU experts, SequentialMLP without grouped GEMM), RMSNorm, RoPE, no biases;
its TopKRouter takes the softmax of the top-k logits, which is Mixtral's softmax over all experts, top-k,
renormalised. Hugging Face holds it as ``MixtralForCausalLM``, saved per expert (``block_sparse_moe.experts.{j}.w1``,
``w2``, ``w3``; transformers 5 fuses them into 3-D tensors in memory only). In: megatron-core itself
(``megatron_fixture.py --family mixtral``) builds, saves and runs a tiny Mixtral with expert parallelism (EP=2, the
legacy rank folders ``mp_rank_TT[_PPP]_EEE``) and tensor or pipeline parallelism, and ``ckptio convert`` gives a
Mixtral with Megatron's logits, on tokens routed to every expert. Out: a Mixtral written with ``--to megatron`` loads
in megatron-core (strict) at EP=2 with the same logits, and comes back bitwise. Every Megatron MoE argument that
routes otherwise (Sinkhorn, sigmoid scores, pre-softmax top-k, scaling, token dropping, jitter, shared experts, grouped
GEMM...) and every Mixtral field Megatron does not hold is refused by name, nothing written.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckptio.convert.formats import convert
from ckptio.errors import CheckpointError, ConfigError
from ckptio.formats.hf_fields import UnsupportedFieldError
from ckptio.formats.safetensors.sharded import SafetensorsSource
from cli_here import ckptio_here
from fixture_cache import built
from megatron_shared import config_of, respelled, routed_logits, same_weights, with_args

FIXTURE = Path(__file__).with_name("megatron_fixture.py")
# the fixture's tiny model (megatron_fixture.py --family mixtral): 4 experts of 32, 2 per token
SIZES = dict(vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-5,
             tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2)
THETA = 1000000.0
IDS = (torch.arange(48).reshape(2, 24) * 7) % 128


def _mixtral(folder: Path, *, seed: int = 0, **extra) -> Path:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    config = MixtralConfig(**{**SIZES, **extra}, rope_parameters={"rope_theta": THETA, "rope_type": "default"})
    model = MixtralForCausalLM(config).eval()
    with torch.no_grad():  # a router that tells the experts apart (transformers initialises it near zero)
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 0.5)
    model.save_pretrained(folder)
    return folder


def _run(hf: Path, ids: torch.Tensor) -> tuple[torch.Tensor, list[set[int]]]:
    from transformers import MixtralForCausalLM

    return routed_logits(hf, ids, MixtralForCausalLM)


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> Path:
    return _mixtral(tmp_path_factory.mktemp("mixtral") / "model")


# ------------------------------------------------------------------------------------------- out and back
@pytest.mark.parametrize("layout", ["dist", "legacy"])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 2)])
def test_mixtral_to_megatron_and_back_is_bitwise(hf, tmp_path, layout, tp, pp):
    from ckptio.formats.megatron.format import MegatronSource
    from ckptio.formats.megatron.layout import run_args

    assert "model.layers.0.block_sparse_moe.experts.3.w3.weight" in SafetensorsSource(hf).index()
    out = convert(hf, tmp_path / "mg", "megatron", options={"tp": tp, "pp": pp, "layout": layout})
    args = run_args(out)
    assert (args.num_experts, args.moe_router_topk, args.moe_ffn_hidden_size) == (4, 2, 32)
    assert args.moe_grouped_gemm is False and args.moe_router_pre_softmax is False
    assert args.moe_router_score_function == "softmax" and args.moe_expert_capacity_factor is None
    index = MegatronSource(out).index()
    assert index["decoder.layers.3.mlp.router.weight"].shape == (4, 64)
    assert index["decoder.layers.3.mlp.experts.3.linear_fc1.weight"].shape == (64, 64)
    assert not any(k.endswith(".mlp.linear_fc1.weight") for k in index)
    back = convert(out, tmp_path / "back", "hf")
    same_weights(hf, back)
    config = config_of(back)
    assert config["model_type"] == "mixtral" and config["architectures"] == ["MixtralForCausalLM"]
    assert (config["num_local_experts"], config["num_experts_per_tok"], config["intermediate_size"]) == (4, 2, 32)
    assert config["sliding_window"] is None and config["rope_parameters"]["rope_theta"] == THETA
    (want, routed), (got, _) = _run(hf, IDS), _run(back, IDS)
    assert all(r == {0, 1, 2, 3} for r in routed), routed
    assert torch.equal(got, want)


def test_router_aux_loss_coef_travels_as_moe_aux_loss_coeff(tmp_path):
    """Training only (the weight of the load-balancing loss), kept both ways all the same."""
    from ckptio.formats.megatron.layout import run_args

    src = _mixtral(tmp_path / "src", router_aux_loss_coef=0.05, output_router_logits=True)
    out = convert(src, tmp_path / "mg", "megatron", options={"layout": "legacy"})
    assert run_args(out).moe_aux_loss_coeff == 0.05
    back = convert(out, tmp_path / "back", "hf")
    assert config_of(back)["router_aux_loss_coef"] == 0.05
    same_weights(src, back)


def test_a_tied_mixtral_travels(tmp_path):
    src = _mixtral(tmp_path / "tied", tie_word_embeddings=True)
    back = convert(convert(src, tmp_path / "mg", "megatron", options={"tp": 2, "pp": 2}), tmp_path / "back", "hf")
    same_weights(src, back)
    assert config_of(back)["tie_word_embeddings"] is True


# ------------------------------------------------------------------------------------------- refusals

@pytest.mark.parametrize("changes,field,value", [
    ({"sliding_window": 8}, "sliding_window", 8),
    ({"router_jitter_noise": 0.1}, "router_jitter_noise", 0.1),
    ({"hidden_act": "gelu"}, "hidden_act", "gelu"),
    ({"rope_parameters": {"rope_theta": THETA, "rope_type": "yarn", "factor": 4.0,
                          "original_max_position_embeddings": 16}}, "rope_parameters.rope_type", "yarn"),
])
def test_mixtral_fields_megatron_does_not_carry_are_refused_by_name(hf, tmp_path, changes, field, value):
    src = respelled(Path(shutil.copytree(hf, tmp_path / "src")), **changes)
    with pytest.raises(UnsupportedFieldError) as err:
        convert(src, tmp_path / "mg", "megatron")
    assert err.value.field == field and err.value.value == value
    assert not (tmp_path / "mg").exists()


@pytest.mark.parametrize("arg,value,says", [
    ("moe_router_load_balancing_type", "sinkhorn", "Sinkhorn routing"),
    ("moe_router_score_function", "sigmoid", "sigmoid router scores"),
    ("moe_router_pre_softmax", True, "before top-k, not renormalised"),
    ("moe_router_topk_scaling_factor", 2.5, "scaled routing weights"),
    ("moe_router_num_groups", 2, "group-limited routing"),
    ("moe_router_group_topk", 1, "group-limited routing"),
    ("moe_router_topk_limited_devices", 2, "device-limited routing"),
    ("moe_router_enable_expert_bias", True, "a routing bias per expert"),
    ("moe_router_force_load_balancing", True, "random router logits"),
    ("moe_expert_capacity_factor", 1.0, "token dropping"),
    ("moe_token_dropping", True, "token dropping"),
    ("moe_pad_expert_input_to_capacity", True, "padded to capacity"),
    ("moe_input_jitter_eps", 0.01, "jitter on the router's input"),
    ("moe_shared_expert_intermediate_size", 64, "shared experts"),
    ("moe_shared_expert_gate", True, "a gated shared expert"),
    ("moe_grouped_gemm", True, "grouped-GEMM experts"),
    ("moe_use_legacy_grouped_gemm", True, "grouped-GEMM experts"),
    ("moe_apply_probs_on_input", True, "applied to the experts' input"),
    ("moe_latent_size", 16, "experts in a latent space"),
    ("moe_layer_freq", [1, 0, 1, 0], "dense layers between"),
    ("qk_layernorm", True, "hold self_attention.q_layernorm.weight, but the run's qk_layernorm=True"),  # Qwen3-MoE's
    ("add_qkv_bias", True, "experts with qk_layernorm or add_qkv_bias"),
])
def test_megatron_moe_arguments_mixtral_does_not_compute_are_refused_by_name(hf, tmp_path, arg, value, says):
    out = with_args(hf, tmp_path, **{arg: value})
    run = ckptio_here("convert", str(out), str(tmp_path / "back"), "--to", "hf", "--no-progress")
    assert run.returncode == 2 and says in run.stderr, run.stderr
    if arg not in ("qk_layernorm", "add_qkv_bias"):
        assert f"{arg}={value!r}" in run.stderr, run.stderr
    assert not (tmp_path / "back").exists()


@pytest.mark.parametrize("arg,value", [("moe_router_dtype", "fp32"), ("moe_token_dispatcher_type", "alltoall"),
                                       ("moe_z_loss_coeff", 1e-3), ("moe_router_load_balancing_type", "seq_aux_loss"),
                                       ("moe_layer_freq", [1, 1, 1, 1]), ("moe_permute_fusion", True)])
def test_megatron_moe_arguments_that_route_the_same_are_inert(hf, tmp_path, arg, value):
    """The router's precision, how tokens travel between ranks, the training losses and fusions: what the converted
    model computes does not depend on them."""
    back = convert(with_args(hf, tmp_path, **{arg: value}), tmp_path / "back", "hf")
    same_weights(hf, back)


def test_a_run_whose_args_and_tensors_disagree_about_the_experts_is_refused(hf, tmp_path):
    out = with_args(hf, tmp_path, num_experts=8)
    with pytest.raises(CheckpointError, match=r"num_experts=8.*expert weights missing"):
        convert(out, tmp_path / "back", "hf")
    assert not (tmp_path / "back").exists()


def test_legacy_experts_split_otherwise_than_the_rest_are_refused(hf, tmp_path):
    """Expert tensor parallelism other than TP shards the experts over other ranks: not read from legacy files."""
    out = convert(hf, tmp_path / "mg", "megatron", options={"tp": 2, "layout": "legacy"})
    for f in (out / "iter_0000000").glob("mp_rank_*/model_optim_rng.pt"):
        state = torch.load(f, weights_only=False)
        state["args"].expert_tensor_parallel_size = 1
        torch.save(state, f)
    with pytest.raises(CheckpointError, match=r"expert_tensor_parallel_size=1 with tensor_model_parallel_size=2"):
        convert(out, tmp_path / "back", "hf")


def test_a_mixtral_config_json_beside_a_checkpoint_without_args_gives_its_family(hf, tmp_path):
    out = convert(hf, tmp_path / "mg", "megatron", options={"layout": "dist"})
    torch.save({}, out / "iter_0000000" / "common.pt")
    shutil.copy(hf / "config.json", out / "config.json")
    back = convert(out, tmp_path / "back", "hf")
    same_weights(hf, back)
    assert config_of(back)["model_type"] == "mixtral"


# ------------------------------------------------------------------------------------------- megatron-core
def _megatron(*args: str) -> None:
    run = subprocess.run([sys.executable, str(FIXTURE), "--family", "mixtral", *args], capture_output=True,
                         text=True, timeout=300, start_new_session=True)
    assert run.returncode == 0, f"megatron-core run {args} failed:\n{run.stderr[-3000:]}"


LAYOUTS = [(1, 1, 2), (2, 1, 1), (1, 2, 2)]  # TP, PP, EP


@pytest.fixture(scope="module")
def made() -> dict[tuple[int, int, int], Path]:
    """The runs (shared, read-only: ``fixture_cache.built``; the megatron_mixtral fuzz family's is TP=1 PP=2 EP=2)."""
    pytest.importorskip("megatron.core")
    return {(tp, pp, ep): built(FIXTURE.name, "--family", "mixtral", "--tp", str(tp), "--pp", str(pp), "--ep", str(ep))
            for tp, pp, ep in LAYOUTS}


@pytest.mark.slow
def test_megatron_names_its_expert_parallel_rank_folders_as_read(made):
    """Megatron-LM appends the expert-parallel rank: mp_rank_TT_EEE without pipeline stages (the same shape as
    mp_rank_TT_PPP: the run's args tell them apart), mp_rank_TT_PPP_EEE with them."""
    names = {k: sorted(p.name for p in (made[k] / "legacy" / "iter_0000002").iterdir()) for k in made}
    assert names[(1, 1, 2)] == ["mp_rank_00_000", "mp_rank_00_001"]
    assert names[(1, 2, 2)] == ["mp_rank_00_000_000", "mp_rank_00_000_001", "mp_rank_00_001_000", "mp_rank_00_001_001"]
    assert names[(2, 1, 1)] == ["mp_rank_00", "mp_rank_01"]


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp,ep", LAYOUTS)
@pytest.mark.parametrize("layout", ["torch_dist", "legacy"])
def test_megatron_mixtral_converts_to_a_mixtral_with_megatrons_logits(made, tmp_path, tp, pp, ep, layout):
    ref = torch.load(made[(tp, pp, ep)] / "reference.pt")
    run = ckptio_here("convert", str(made[(tp, pp, ep)] / layout), str(tmp_path / "hf"), "--to", "hf",
                      "--no-progress")
    assert run.returncode == 0, run.stderr
    config = config_of(tmp_path / "hf")
    assert config["model_type"] == "mixtral" and config["router_aux_loss_coef"] == 0.02
    got, routed = _run(tmp_path / "hf", ref["input_ids"])
    assert all(r == {0, 1, 2, 3} for r in routed), f"not every expert got tokens: {routed}"
    assert got.shape == ref["logits"].shape
    assert torch.allclose(got, ref["logits"], atol=1e-5, rtol=0), (got - ref["logits"]).abs().max()


@pytest.mark.slow
def test_a_missing_expert_parallel_rank_folder_is_refused(made, tmp_path):
    run = Path(shutil.copytree(made[(1, 1, 2)] / "legacy", tmp_path / "run"))
    shutil.rmtree(run / "iter_0000002" / "mp_rank_00_001")
    with pytest.raises(CheckpointError, match=r"expert_model_parallel_size is 2, but its rank folders are for 1"):
        convert(run, tmp_path / "back", "hf")
    assert not (tmp_path / "back").exists()


@pytest.mark.slow
def test_megatron_core_loads_a_mixtral_ckptio_exports_at_another_expert_parallelism(tmp_path):
    """A MixtralForCausalLM made by transformers -> ``--to megatron`` at TP=2 PP=2 -> megatron-core's strict loader
    into a TP=1 EP=2 model (each rank two of the four experts) -> the logits transformers gives."""
    pytest.importorskip("megatron.core")
    src = _mixtral(tmp_path / "hf", seed=3)
    run = ckptio_here("convert", str(src), str(tmp_path / "mg"), "--to", "megatron", "--tp", "2", "--pp", "2",
                      "--no-progress")
    assert run.returncode == 0, run.stderr
    _megatron("--tp", "1", "--pp", "1", "--ep", "2", "--load", str(tmp_path / "mg" / "iter_0000000"),
              "--out", str(tmp_path / "logits.pt"))
    got = torch.load(tmp_path / "logits.pt")
    want, routed = _run(src, got["input_ids"])
    assert all(r == {0, 1, 2, 3} for r in routed), routed
    assert torch.allclose(got["logits"], want, atol=1e-5, rtol=0), (got["logits"] - want).abs().max()


@pytest.mark.parametrize("options,says", [
    ({"ep": 2}, "applies to the legacy layout"), ({"ep": 3, "layout": "legacy"}, "cannot split the model's 4 experts"),
    ({"ep": 2, "layout": "legacy", "pp": 2, "vpp": 4}, "cannot split 4 layers into PP=2 x 4 virtual pipeline")])
def test_expert_parallel_rank_folders_that_cannot_be_written_are_refused_by_name(hf, tmp_path, options, says):
    with pytest.raises(ConfigError, match=says):
        convert(hf, tmp_path / "mg", "megatron", options=options)
    assert not (tmp_path / "mg").exists()


@pytest.mark.slow
def test_megatron_core_loads_a_mixtrals_legacy_export_split_over_expert_parallel_ranks(tmp_path):
    """A MixtralForCausalLM -> ``--megatron-layout legacy --ep 2`` (``mp_rank_00_000``, ``mp_rank_00_001``: each EP
    rank's two experts as its local experts 0 and 1, the rest repeated) -> each megatron-core rank of a TP=1 EP=2
    model loads its own file strictly -> the logits transformers gives; and ckptio reads the folders back bitwise."""
    pytest.importorskip("megatron.core")
    src = _mixtral(tmp_path / "hf", seed=3)
    run = ckptio_here("convert", str(src), str(tmp_path / "mg"), "--to", "megatron", "--megatron-layout", "legacy",
                      "--ep", "2", "--no-progress")
    assert run.returncode == 0, run.stderr
    out = tmp_path / "mg"
    folder = out / "iter_0000000"
    assert sorted(p.name for p in folder.iterdir()) == ["mp_rank_00_000", "mp_rank_00_001"]
    _megatron("--tp", "1", "--pp", "1", "--ep", "2", "--load", str(folder), "--out", str(tmp_path / "logits.pt"))
    got = torch.load(tmp_path / "logits.pt")
    want, routed = _run(src, got["input_ids"])
    assert all(r == {0, 1, 2, 3} for r in routed), routed
    assert torch.allclose(got["logits"], want, atol=1e-5, rtol=0), (got["logits"] - want).abs().max()
    same_weights(src, convert(out, tmp_path / "back", "hf"))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["torch_dist", "legacy"])
def test_restore_from_megatron_brings_a_mixtral_its_experts_and_their_moments(made, tmp_path, layout):
    """A plain MixtralForCausalLM (transformers 5 fuses each layer's experts into gate_up_proj and down_proj in
    memory) with AdamW, restored from the EP=2 run: every expert's weights are Megatron's, bit for bit, and from
    torch_dist so are Adam's moments (the legacy files of a run without the distributed optimizer carry no moments
    ckptio maps: the weights only)."""
    from ckptio.formats.dcp.format import load_all
    from distributed import run_ranks
    from megatron_shared import restore_with_adam

    src = made[(1, 1, 2)] / layout
    hf = convert(src, tmp_path / "hf", "hf")
    got = run_ranks(1, restore_with_adam, source=str(src), config=str(hf))[0] if layout == "torch_dist" else None
    if got is None:  # weights only: AdamW's moments start fresh
        from ckptio import CheckpointConfig, CheckpointManager
        from transformers import AutoConfig, AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(hf)).float()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        with CheckpointManager(CheckpointConfig(checkpoint_dir=str(tmp_path / "run")), model=model, optimizer=opt,
                               rng=False) as mgr:
            mgr.restore(str(src))
        got = {f"model/{k}": v for k, v in model.state_dict().items()}
    mega = load_all(made[(1, 1, 2)] / "torch_dist" / "iter_0000002")
    moe = "decoder.layers.mlp.experts.experts."
    for i in range(4):
        p = f"model.layers.{i}.mlp."
        assert torch.equal(got[f"model/{p}gate.weight"], mega["decoder.layers.mlp.router.weight"][i])
        assert torch.equal(got[f"model/{p}experts.gate_up_proj"], mega[moe + "linear_fc1.weight"][i])
        assert torch.equal(got[f"model/{p}experts.down_proj"], mega[moe + "linear_fc2.weight"][i])
        if layout == "legacy":
            continue
        for m in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(got[f"optim/state.{p}experts.gate_up_proj.{m}"],
                               mega[f"optimizer.state.{m}.{moe}linear_fc1.weight"][i])
            assert torch.equal(got[f"optim/state.{p}experts.down_proj.{m}"],
                               mega[f"optimizer.state.{m}.{moe}linear_fc2.weight"][i])
            assert torch.equal(got[f"optim/state.{p}gate.weight.{m}"],
                               mega[f"optimizer.state.{m}.decoder.layers.mlp.router.weight"][i])
    if layout == "torch_dist":
        steps = got.pop("steps")
        params = [k.removeprefix("model/") for k in got if k.startswith("model/")]
        assert len(params) == steps.numel() == 39 and bool((steps == 1).all()), steps
        for name in params:  # Megatron's one Adam step (megatron_fixture.py): every element, the experts' included
            g = got[f"optim/state.{name}.exp_avg"] / 0.1
            assert torch.allclose(got[f"optim/state.{name}.exp_avg_sq"], 0.05 * g * g, rtol=1e-4, atol=1e-9), name


# ------------------------------------------------------------------------------------------- found by the fuzzer
def _rewrite_rank(out: Path, rank: str, change) -> None:
    f = out / "iter_0000000" / rank / "model_optim_rng.pt"
    state = torch.load(f, weights_only=False)
    change(state["model"])
    torch.save(state, f)


@pytest.mark.parametrize("key,value,says", [
    ("decoder.layers.0.self_attention.linear_proj.weight", torch.zeros(64), r"has 1 dimension\(s\).*dimension 1"),
    ("decoder.layers.0.self_attention.linear_qkv.weight", torch.zeros(0),
     r"linear_qkv\.weight \(.*\) has shape \[0\], not the \[128, 64\] of the run's num_attention_heads=4"),
])
def test_rank_files_whose_shapes_cannot_be_merged_or_split_are_refused_by_name(hf, tmp_path, key, value, says):
    """Two inputs of the megatron_mixtral fuzz family (tools/fuzz_megatron.py), which met the dense readers too:
    a row-parallel weight saved 1-D (an IndexError), a q/k/v weight of no rows (a RuntimeError of a reshape)."""
    out = convert(hf, tmp_path / "mg", "megatron", options={"tp": 2, "layout": "legacy"})
    for rank in ("mp_rank_00", "mp_rank_01"):
        _rewrite_rank(out, rank, lambda model: model.update({key: value}))
    with pytest.raises(CheckpointError, match=says):
        convert(out, tmp_path / "back", "hf")
    assert not (tmp_path / "back").exists()


@pytest.mark.slow
def test_an_optimizer_step_that_is_no_number_is_refused_by_name(made, tmp_path):
    """An input of the fuzz family: common.pt's optimizer step replaced by a dict (a TypeError before)."""
    from ckptio.formats.megatron.format import MegatronFormat

    run = Path(shutil.copytree(made[(1, 1, 2)] / "torch_dist", tmp_path / "run"))
    common = run / "iter_0000002" / "common.pt"
    state = torch.load(common, weights_only=False)
    state["optimizer"]["state"]["common_step"] = {}
    torch.save(state, common)
    with pytest.raises(CheckpointError, match=r"records the optimizer's step as dict|common_step is '\{\}', not a step"):
        MegatronFormat().open_adam(run)


@pytest.mark.slow
def test_fuzz_family_smoke():
    """A CI-sized run of the megatron_mixtral fuzz family (the long run: ``tools/fuzz_readers.py --family
    megatron_mixtral --inputs 100000``; EP=2 runs, and a PP=2 x VPP=2 x EP=2 one's legacy and torch_dist files):
    every damaged folder ends in a right read or a ckptio error."""
    from megatron_shared import fuzz_smoke

    fuzz_smoke("megatron_mixtral", 60)


def test_args_that_are_no_namespace_are_refused_by_name(hf, tmp_path):
    """An input of the fuzz family: common.pt's ``args`` replaced by a number (a TypeError of vars() before)."""
    out = convert(hf, tmp_path / "mg", "megatron", options={"layout": "dist"})
    common = out / "iter_0000000" / "common.pt"
    state = torch.load(common, weights_only=False)
    state["args"] = 7
    torch.save(state, common)
    with pytest.raises(CheckpointError, match=r"the run's args are missing|its args are a int, not the run's arguments"):
        convert(out, tmp_path / "back", "hf")
    assert not (tmp_path / "back").exists()


@pytest.mark.parametrize("layout,tp,arg,value,says", [
    ("dist", 1, "moe_ffn_hidden_size", 16, r"decoder\.layers\.\d\.mlp\.experts\.\d\.linear_fc[12]\.weight \(torch_dist "
     r"tensor decoder\.layers\.mlp\.experts\.experts\.linear_fc[12]\.weight\[\d, \d\]\) has shape .* of the run's "
     r"moe_ffn_hidden_size=16"),
    ("legacy", 2, "moe_ffn_hidden_size", 16, r"mlp\.experts\.\d\.linear_fc[12]\.weight \(read from iter_0000000/"
     r"mp_rank_00/model_optim_rng\.pt, merged with its tensor-parallel shards in the other TP ranks' files \(TP=2\)\) "
     r"has shape .* of the run's moe_ffn_hidden_size=16"),
    ("legacy", 2, "num_layers", 5, r"holds 4 layers, but the run's num_layers=5"),
])
def test_args_that_disagree_with_the_weights_are_refused_by_name(hf, tmp_path, layout, tp, arg, value, says):
    """Issue 69: each expert's size is the run's moe_ffn_hidden_size (config.json's intermediate_size)."""
    out = with_args(hf, tmp_path, layout=layout, tp=tp, **{arg: value})
    with pytest.raises(CheckpointError, match=says):
        convert(out, tmp_path / "back", "hf")
    assert not (tmp_path / "back").exists()

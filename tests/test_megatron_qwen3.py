"""The Qwen3 family in Megatron checkpoints, both ways: RMSNorms on each head's query and key.

Megatron-LM trains Qwen3 (dense) as a GPT model with ``--qk-layernorm`` (Megatron-Core ``qk_layernorm``: an RMSNorm
of ``kv_channels`` over each query and key head, before RoPE, with the run's ``layernorm_epsilon``), RMSNorm, SwiGLU
and RoPE, no biases; Hugging Face holds it as ``Qwen3ForCausalLM``, whose ``q_norm``/``k_norm`` are the same norms.
In: megatron-core itself (``megatron_fixture.py --family qwen3``) builds, saves and runs a tiny Qwen3 at TP=2 (PP 1
and 2), and ``ckptio convert`` gives a Hugging Face Qwen3 with Megatron's logits. Out: a tiny ``Qwen3ForCausalLM``
written with ``--to megatron`` loads in megatron-core (strict) with the same logits, and comes back bitwise. What a
Qwen3 config or a Megatron run asks for that neither side carries (a window, biases, a scaled RoPE, Qwen2's biases
with Qwen3's norms) is refused by name, nothing written.

Gemma 2 and 3 are refused by name both ways: the installed megatron-core builds no Gemma (no logit soft-capping, no
norms after the attention and the MLP, no embedding scaling), so there is no Megatron checkpoint that computes one.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckptio.convert.formats import convert
from ckptio.errors import CheckpointError
from ckptio.formats.hf_fields import UnsupportedFieldError
from ckptio.formats.safetensors.sharded import SafetensorsSource
from cli_here import ckptio_here
from fixture_cache import built
from megatron_shared import config_of, respelled, restore_with_adam, same_weights, with_args

FIXTURE = Path(__file__).with_name("megatron_fixture.py")
# the fixture's tiny model (megatron_fixture.py, --family qwen3); Qwen3's head_dim is its own field (16 here)
SIZES = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-6,
             tie_word_embeddings=False)
THETA = 1000000.0


def _qwen3(folder: Path, *, seed: int = 0, **extra) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(**{**SIZES, **extra}, rope_parameters={"rope_theta": THETA, "rope_type": "default"})
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():  # transformers initialises the norms to one: make the q/k norms matter
        for layer in model.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.weight.normal_(1.0, 0.3)
    model.save_pretrained(folder)
    return folder


def _logits(hf: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM, Qwen3ForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf).eval()
    assert isinstance(model, Qwen3ForCausalLM)
    with torch.no_grad():
        return model(ids).logits


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> Path:
    return _qwen3(tmp_path_factory.mktemp("qwen3") / "model")


# ------------------------------------------------------------------------------------------- out and back
@pytest.mark.parametrize("layout", ["dist", "legacy"])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 2)])
def test_qwen3_to_megatron_and_back_is_bitwise(hf, tmp_path, layout, tp, pp):
    from ckptio.formats.megatron.format import MegatronSource
    from ckptio.formats.megatron.layout import run_args

    assert any(k.endswith("self_attn.q_norm.weight") for k in SafetensorsSource(hf).index())
    out = convert(hf, tmp_path / "mg", "megatron", options={"tp": tp, "pp": pp, "layout": layout})
    args = run_args(out)
    assert args.qk_layernorm is True and args.add_qkv_bias is False and args.add_bias_linear is False
    assert args.kv_channels == 16 and args.norm_epsilon == 1e-6 and args.rotary_base == THETA
    index = MegatronSource(out).index()
    assert index["decoder.layers.3.self_attention.q_layernorm.weight"].shape == (16,)
    assert index["decoder.layers.3.self_attention.k_layernorm.weight"].shape == (16,)
    back = convert(out, tmp_path / "back", "hf")
    same_weights(hf, back)
    config = config_of(back)
    assert config["model_type"] == "qwen3" and config["architectures"] == ["Qwen3ForCausalLM"]
    assert config["use_sliding_window"] is False and config["attention_bias"] is False
    assert config["rms_norm_eps"] == 1e-6 and config["head_dim"] == 16
    ids = (torch.arange(24).reshape(2, 12) * 5) % 128
    assert torch.equal(_logits(back, ids), _logits(hf, ids))


def test_a_tied_qwen3_travels_as_megatron_shares_it(tmp_path):
    """Qwen3-0.6B to 4B tie their embeddings: Megatron holds no output layer, and the way back ties again."""
    from ckptio.formats.megatron.format import MegatronSource

    src = _qwen3(tmp_path / "tied", tie_word_embeddings=True)
    out = convert(src, tmp_path / "mg", "megatron", options={"tp": 2, "pp": 2, "layout": "legacy"})
    assert "output_layer.weight" not in MegatronSource(out).index()
    back = convert(out, tmp_path / "back", "hf")
    same_weights(src, back)
    assert config_of(back)["tie_word_embeddings"] is True


def test_a_qwen3_head_dim_other_than_hidden_over_heads_travels(tmp_path):
    """Qwen3's heads are wider than hidden_size / num_attention_heads (128 x 32 heads for a 2560-wide 4B): the q/k
    norms and the fused projection take head_dim (Megatron's kv_channels), not the quotient."""
    src = _qwen3(tmp_path / "wide", head_dim=32)
    back = convert(convert(src, tmp_path / "mg", "megatron", options={"tp": 2}), tmp_path / "back", "hf")
    same_weights(src, back)
    ids = (torch.arange(24).reshape(2, 12) * 7) % 128
    assert torch.equal(_logits(back, ids), _logits(src, ids))


def test_a_nemo2_qwen3_reads_its_family_from_context(hf, tmp_path):
    """NeMo 2.0 keeps Megatron-Core's TransformerConfig in ``context/model.yaml`` (its Qwen3Config sets
    ``qk_layernorm: true``); ``weights/`` is a torch_dist checkpoint with ``module.`` keys."""
    from megatron_shared import nemo2_folder

    out = convert(hf, tmp_path / "mg", "megatron")
    nemo2_folder(out / "iter_0000000", tmp_path / "nemo2", [
        "_target_: nemo.collections.llm.gpt.model.qwen3.Qwen3Model", "config:",
        "  _target_: nemo.collections.llm.gpt.model.qwen3.Qwen3Config",
        "  activation_func:", "    _call_: false", "    _target_: torch.nn.functional.silu",
        "  add_bias_linear: false", "  add_qkv_bias: false", "  qk_layernorm: true", "  ffn_hidden_size: 128",
        "  gated_linear_unit: true", "  hidden_size: 64", "  kv_channels: 16", "  layernorm_epsilon: 1.0e-06",
        "  normalization: RMSNorm", "  num_attention_heads: 4", "  num_layers: 4", "  num_query_groups: 2",
        "  position_embedding_type: rope", "  rotary_base: 1000000.0", "  seq_length: 64",
        "  share_embeddings_and_output_weights: false", "  vocab_size: 128", ""])
    back = convert(tmp_path / "nemo2", tmp_path / "back", "hf")
    same_weights(hf, back)
    assert config_of(back)["model_type"] == "qwen3"


# ------------------------------------------------------------------------------------------- refusals

@pytest.mark.parametrize("changes,field,value", [
    ({"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2, "layer_types": None},
     "use_sliding_window", True),
    ({"layer_types": ["full_attention", "full_attention", "sliding_attention", "sliding_attention"]},
     "layer_types", ["full_attention", "full_attention", "sliding_attention", "sliding_attention"]),
    ({"attention_bias": True}, "attention_bias", True),
    ({"rope_parameters": {"rope_theta": THETA, "rope_type": "yarn", "factor": 4.0,
                          "original_max_position_embeddings": 16}}, "rope_parameters.rope_type", "yarn"),
    ({"hidden_act": "gelu"}, "hidden_act", "gelu"),
])
def test_qwen3_fields_megatron_does_not_carry_are_refused_by_name(hf, tmp_path, changes, field, value):
    src = respelled(Path(shutil.copytree(hf, tmp_path / "src")), **changes)
    with pytest.raises(UnsupportedFieldError) as err:
        convert(src, tmp_path / "mg", "megatron")
    assert err.value.field == field and err.value.value == value
    assert not (tmp_path / "mg").exists()


def test_a_qwen3_window_that_is_off_is_not_refused(hf, tmp_path):
    """Qwen3's own configs say ``sliding_window: null, use_sliding_window: false, max_window_layers: 28``."""
    src = respelled(Path(shutil.copytree(hf, tmp_path / "src")), sliding_window=4096, max_window_layers=2)
    back = convert(convert(src, tmp_path / "mg", "megatron"), tmp_path / "back", "hf")
    same_weights(src, back)


@pytest.mark.parametrize("arg,value,says", [
    ("add_qkv_bias", True, "qk_layernorm with add_qkv_bias"),  # Qwen2's biases with Qwen3's norms: neither family
    ("qk_l2_norm", True, "qk_l2_norm=True"),  # Llama 4's L2 norms, not Qwen3's RMSNorms
    ("normalization", "LayerNorm", "normalization=LayerNorm"),  # the q/k norms would be LayerNorms too
])
def test_megatron_runs_with_qk_norms_no_qwen3_computes_are_refused_by_the_cli(hf, tmp_path, arg, value, says):
    out = with_args(hf, tmp_path, **{arg: value})
    run = ckptio_here("convert", str(out), str(tmp_path / "back"), "--to", "hf", "--no-progress")
    assert run.returncode == 2 and says in run.stderr, run.stderr
    assert not (tmp_path / "back").exists()


def test_a_run_whose_args_and_tensors_disagree_about_the_qk_norms_is_refused(hf, tmp_path):
    out = with_args(hf, tmp_path, qk_layernorm=False)
    with pytest.raises(CheckpointError, match=r"q_layernorm\.weight.*qk_layernorm=False"):
        convert(out, tmp_path / "back", "hf")
    assert not (tmp_path / "back").exists()


def test_a_qwen3_without_its_qk_norms_is_refused_before_writing(hf, tmp_path):
    from safetensors.torch import load_file, save_file

    src = Path(shutil.copytree(hf, tmp_path / "src"))
    (weights,) = src.glob("*.safetensors")
    save_file({k: v for k, v in load_file(weights).items() if not k.endswith(("q_norm.weight", "k_norm.weight"))},
              weights, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"0 of its 4 layers have q_norm weights, but its config is a qwen3's"):
        convert(src, tmp_path / "mg", "megatron")
    assert not (tmp_path / "mg").exists()


def test_qnemo_still_refuses_a_qwen3(hf, tmp_path):
    run = ckptio_here("quantize", str(hf), str(tmp_path / "q"), "--check", "0")
    assert run.returncode == 2 and "needs a transformers Llama model" in run.stderr, run.stderr
    assert not (tmp_path / "q").exists()


# ------------------------------------------------------------------------------------------- Gemma: refused
def _gemma(folder: Path, kind: str) -> Path:
    from transformers import Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig

    sizes = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=64, sliding_window=8)
    config_cls, model_cls = {"gemma2": (Gemma2Config, Gemma2ForCausalLM),
                             "gemma3_text": (Gemma3TextConfig, Gemma3ForCausalLM)}[kind]
    torch.manual_seed(0)
    model_cls(config_cls(**sizes)).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("kind", ["gemma2", "gemma3_text"])
def test_a_gemma_is_refused_by_name_megatron_core_builds_none(tmp_path, kind):
    """megatron-core (0.16) has no soft-capped logits, no norms after the attention and the MLP and no scaled
    embedding: a Gemma written as a Megatron GPT checkpoint would compute something else, so it is refused by its
    model_type with what is missing, nothing written."""
    src = _gemma(tmp_path / "src", kind)
    with pytest.raises(UnsupportedFieldError) as err:
        convert(src, tmp_path / "mg", "megatron")
    assert err.value.field == "model_type" and err.value.value == kind
    for missing in ("soft-capping", "post-attention and post-MLP norms", "embedding scaled by sqrt(hidden_size)"):
        assert missing in str(err.value), str(err.value)
    assert not (tmp_path / "mg").exists()


def test_a_nemo2_gemma2_config_is_refused_naming_each_feature(hf, tmp_path):
    """NeMo 2.0 trains Gemma 2 with its own layer spec and config fields beyond Megatron-Core's (soft-capping, a
    query scale); a context/model.yaml with them is refused naming them, not read as a Llama."""
    out = convert(hf, tmp_path / "mg", "megatron")
    weights = out / "iter_0000000"
    (weights / "context").mkdir()
    (weights / "context" / "model.yaml").write_text("\n".join([
        "_target_: nemo.collections.llm.gpt.model.gemma2.Gemma2Model", "config:",
        "  _target_: nemo.collections.llm.gpt.model.gemma2.Gemma2Config",
        "  activation_func:", "    _call_: false", "    _target_: torch.nn.functional.silu",
        "  gated_linear_unit: true", "  add_bias_linear: false", "  hidden_size: 64", "  kv_channels: 16",
        "  ffn_hidden_size: 128", "  num_attention_heads: 4", "  num_layers: 4", "  num_query_groups: 2",
        "  normalization: RMSNorm", "  layernorm_epsilon: 1.0e-06", "  rotary_base: 1000000.0",
        "  attn_logit_softcapping: 50.0", "  final_logit_softcapping: 30.0", "  query_pre_attn_scalar: 224",
        "  share_embeddings_and_output_weights: false", "  vocab_size: 128", ""]))
    torch.save({}, weights / "common.pt")  # no args: the model's config is read from context/model.yaml
    run = ckptio_here("convert", str(out), str(tmp_path / "back"), "--to", "hf", "--no-progress")
    assert run.returncode == 2, run.stderr
    for name in ("attn_logit_softcapping=50.0", "final_logit_softcapping=30.0", "query_pre_attn_scalar=224"):
        assert name in run.stderr, run.stderr
    assert not (tmp_path / "back").exists()


# ------------------------------------------------------------------------------------------- megatron-core
def _megatron(*args: str) -> None:
    run = subprocess.run([sys.executable, str(FIXTURE), "--family", "qwen3", *args], capture_output=True, text=True,
                         timeout=300, start_new_session=True)
    assert run.returncode == 0, f"megatron-core run {args} failed:\n{run.stderr[-3000:]}"


LAYOUTS = [(2, 1), (2, 2)]


@pytest.fixture(scope="module")
def made() -> dict[tuple[int, int], Path]:
    pytest.importorskip("megatron.core")
    return {(tp, pp): built(FIXTURE.name, "--family", "qwen3", "--tp", str(tp), "--pp", str(pp)) for tp, pp in LAYOUTS}


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", LAYOUTS)
@pytest.mark.parametrize("layout", ["torch_dist", "legacy"])
def test_megatron_qwen3_converts_to_a_qwen3_with_megatrons_logits(made, tmp_path, tp, pp, layout):
    ref = torch.load(made[(tp, pp)] / "reference.pt")
    run = ckptio_here("convert", str(made[(tp, pp)] / layout), str(tmp_path / "hf"), "--to", "hf", "--no-progress")
    assert run.returncode == 0, run.stderr
    config = config_of(tmp_path / "hf")
    assert config["model_type"] == "qwen3" and config["rope_parameters"]["rope_theta"] == THETA
    got = _logits(tmp_path / "hf", ref["input_ids"])
    assert got.shape == ref["logits"].shape
    assert torch.allclose(got, ref["logits"], atol=1e-5, rtol=0), (got - ref["logits"]).abs().max()


@pytest.mark.slow
def test_megatron_core_loads_a_qwen3_ckptio_exports(tmp_path):
    """A Qwen3ForCausalLM made by transformers -> ``--to megatron`` at TP=2 PP=2 -> megatron-core's strict loader
    into a TP=2 model -> the logits transformers gives."""
    pytest.importorskip("megatron.core")
    src = _qwen3(tmp_path / "hf", seed=3)
    run = ckptio_here("convert", str(src), str(tmp_path / "mg"), "--to", "megatron", "--tp", "2", "--pp", "2",
                      "--no-progress")
    assert run.returncode == 0, run.stderr
    _megatron("--tp", "2", "--pp", "1", "--load", str(tmp_path / "mg" / "iter_0000000"),
              "--out", str(tmp_path / "logits.pt"))
    got = torch.load(tmp_path / "logits.pt")
    want = _logits(src, got["input_ids"])
    assert torch.allclose(got["logits"], want, atol=1e-5, rtol=0), (got["logits"] - want).abs().max()


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_restore_from_megatron_brings_a_qwen3_its_qk_norms_and_their_moments(made, tmp_path, world):
    """Megatron took one Adam step (lr 1e-3, betas 0.9/0.95) with gradient g = 0.5 w0 + 0.25 on every element
    (megatron_fixture.py), so every element, the q/k norms' included, must satisfy exp_avg = 0.1 g,
    exp_avg_sq = 0.05 g^2 and w = 2g - 0.5 - 1e-3 sign(g): a moment on the wrong element breaks it."""
    from distributed import run_ranks

    src = made[(2, 2)] / "torch_dist"
    hf = convert(src, tmp_path / "hf", "hf")
    got = run_ranks(world, restore_with_adam, source=str(src), config=str(hf))[0]
    steps = got.pop("steps")
    params = [k.removeprefix("model/") for k in got if k.startswith("model/")]
    assert len(params) == steps.numel() == 47 and bool((steps == 1).all()), steps
    assert sum(p.endswith(("q_norm.weight", "k_norm.weight")) for p in params) == 8
    for name in params:
        g = got[f"optim/state.{name}.exp_avg"] / 0.1
        assert torch.allclose(got[f"optim/state.{name}.exp_avg_sq"], 0.05 * g * g, rtol=1e-4, atol=1e-9), name
        assert torch.allclose(got[f"model/{name}"], 2 * g - 0.5 - 1e-3 * torch.sign(g), atol=2e-6, rtol=0), name


def _without_args(hf: Path, tmp_path: Path) -> Path:
    """A torch_dist checkpoint whose common.pt records no args: its model is read from a config.json beside it."""
    out = convert(hf, tmp_path / "mg", "megatron", options={"layout": "dist"})
    torch.save({}, out / "iter_0000000" / "common.pt")
    return out


def test_a_qwen3_config_json_beside_a_checkpoint_without_args_gives_its_family(hf, tmp_path):
    out = _without_args(hf, tmp_path)
    shutil.copy(hf / "config.json", out / "config.json")
    back = convert(out, tmp_path / "back", "hf")
    same_weights(hf, back)
    assert config_of(back)["model_type"] == "qwen3"


def test_a_gemma_config_json_beside_a_checkpoint_without_args_is_refused(hf, tmp_path):
    """A config.json stands for the run's args only for a model Megatron computes; a Gemma's is not read as a
    Llama's (its soft-capping, post-norms and scaled embedding dropped)."""
    out = _without_args(hf, tmp_path)
    gemma = {**config_of(hf), "model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"],
             "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}
    (out / "config.json").write_text(json.dumps(gemma))
    with pytest.raises(UnsupportedFieldError) as err:
        convert(out, tmp_path / "back", "hf")
    assert err.value.field == "model_type" and err.value.value == "gemma2" and "soft-capping" in str(err.value)
    assert not (tmp_path / "back").exists()

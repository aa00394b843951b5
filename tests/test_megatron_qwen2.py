"""The Qwen2/2.5 family in Megatron checkpoints, both ways: biases on the fused query/key/value projection.

Megatron-LM trains Qwen2 as a GPT model with ``--add-qkv-bias`` (Megatron-Core ``add_qkv_bias``), RMSNorm, SwiGLU
and RoPE; Hugging Face holds it as ``Qwen2ForCausalLM``, whose q/k/v projections carry biases split the way the
fused ``linear_qkv`` weight is (per query group: its queries, its key, its value). In: megatron-core itself
(``megatron_fixture.py --family qwen2``) builds, saves and runs a tiny Qwen2 at TP=2 (PP 1 and 2), and ``ckptio
convert`` gives a Hugging Face Qwen2 with Megatron's logits. Out: a tiny ``Qwen2ForCausalLM`` written with ``--to
megatron`` loads in megatron-core (strict) with the same logits, and comes back bitwise. What a Qwen2 config or a
Megatron run asks for that neither side carries (a sliding window, a scaled RoPE, biases elsewhere) is refused by
name, nothing written.
"""

from __future__ import annotations

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
from megatron_shared import config_of, respelled, restore_with_adam, same_weights

FIXTURE = Path(__file__).with_name("megatron_fixture.py")
# the fixture's tiny model (megatron_fixture.py, --family qwen2)
SIZES = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False)
THETA = 1000000.0


def _qwen2(folder: Path, *, seed: int = 0, **extra) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(**{**SIZES, **extra}, rope_parameters={"rope_theta": THETA, "rope_type": "default"})
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # transformers initialises biases to zero: make them matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0.0, 0.5)
    model.save_pretrained(folder)
    return folder


def _logits(hf: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM, Qwen2ForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf).eval()
    assert isinstance(model, Qwen2ForCausalLM)
    with torch.no_grad():
        return model(ids).logits


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> Path:
    return _qwen2(tmp_path_factory.mktemp("qwen2") / "model")


# ------------------------------------------------------------------------------------------- out and back
@pytest.mark.parametrize("layout", ["dist", "legacy"])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 2)])
def test_qwen2_to_megatron_and_back_is_bitwise(hf, tmp_path, layout, tp, pp):
    from ckptio.formats.megatron.layout import run_args

    assert any(k.endswith("q_proj.bias") for k in SafetensorsSource(hf).index())
    out = convert(hf, tmp_path / "mg", "megatron", options={"tp": tp, "pp": pp, "layout": layout})
    args = run_args(out)
    assert args.add_qkv_bias is True and args.add_bias_linear is False and args.rotary_base == THETA
    back = convert(out, tmp_path / "back", "hf")
    same_weights(hf, back)
    config = config_of(back)
    assert config["model_type"] == "qwen2" and config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["use_sliding_window"] is False and config["rms_norm_eps"] == 1e-6
    ids = (torch.arange(24).reshape(2, 12) * 5) % 128
    assert torch.equal(_logits(back, ids), _logits(hf, ids))


def test_a_tied_qwen2_travels_as_megatron_shares_it(tmp_path):
    """Qwen2-0.5B and 1.5B tie their embeddings: Megatron holds no output layer, and the way back ties again."""
    from ckptio.formats.megatron.format import MegatronSource

    src = _qwen2(tmp_path / "tied", tie_word_embeddings=True)
    out = convert(src, tmp_path / "mg", "megatron", options={"tp": 2, "pp": 2, "layout": "legacy"})
    assert "output_layer.weight" not in MegatronSource(out).index()
    back = convert(out, tmp_path / "back", "hf")
    same_weights(src, back)
    assert config_of(back)["tie_word_embeddings"] is True


def test_a_nemo2_qwen2_reads_its_family_from_context(hf, tmp_path):
    """NeMo 2.0 keeps Megatron-Core's TransformerConfig in ``context/model.yaml`` (its Qwen2Config sets
    ``add_qkv_bias: true``); ``weights/`` is a torch_dist checkpoint with ``module.`` keys."""
    from megatron_shared import nemo2_folder

    out = convert(hf, tmp_path / "mg", "megatron")
    nemo2_folder(out / "iter_0000000", tmp_path / "nemo2", [
        "_target_: nemo.collections.llm.gpt.model.qwen2.Qwen2Model", "config:",
        "  _target_: nemo.collections.llm.gpt.model.qwen2.Qwen2Config",
        "  activation_func:", "    _call_: false", "    _target_: torch.nn.functional.silu",
        "  add_bias_linear: false", "  add_qkv_bias: true", "  ffn_hidden_size: 128", "  gated_linear_unit: true",
        "  hidden_size: 64", "  kv_channels: 16", "  layernorm_epsilon: 1.0e-06", "  normalization: RMSNorm",
        "  num_attention_heads: 4", "  num_layers: 4", "  num_query_groups: 2", "  position_embedding_type: rope",
        "  rotary_base: 1000000.0", "  seq_length: 64", "  share_embeddings_and_output_weights: false",
        "  vocab_size: 128", ""])
    back = convert(tmp_path / "nemo2", tmp_path / "back", "hf")
    same_weights(hf, back)
    assert config_of(back)["model_type"] == "qwen2"


# ------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("changes,field,value", [
    ({"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2, "layer_types": None},
     "use_sliding_window", True),
    ({"layer_types": ["full_attention", "full_attention", "sliding_attention", "sliding_attention"]},
     "layer_types", ["full_attention", "full_attention", "sliding_attention", "sliding_attention"]),
    ({"rope_parameters": {"rope_theta": THETA, "rope_type": "yarn", "factor": 4.0,
                          "original_max_position_embeddings": 16}}, "rope_parameters.rope_type", "yarn"),
    ({"rope_parameters": None, "rope_theta": THETA, "rope_scaling": {"type": "dynamic", "factor": 2.0}},
     "rope_scaling.rope_type", "dynamic"),
    ({"hidden_act": "gelu"}, "hidden_act", "gelu"),
])
def test_qwen2_fields_megatron_does_not_carry_are_refused_by_name(hf, tmp_path, changes, field, value):
    import shutil

    src = respelled(Path(shutil.copytree(hf, tmp_path / "src")), **changes)
    with pytest.raises(UnsupportedFieldError) as err:
        convert(src, tmp_path / "mg", "megatron")
    assert err.value.field == field and err.value.value == value
    assert not (tmp_path / "mg").exists()


def test_a_qwen2_window_that_is_off_is_not_refused(hf, tmp_path):
    """Qwen2.5's own configs say ``sliding_window: 131072, use_sliding_window: false``: the window is never used."""
    import shutil

    src = respelled(Path(shutil.copytree(hf, tmp_path / "src")), sliding_window=131072, max_window_layers=2)
    back = convert(convert(src, tmp_path / "mg", "megatron"), tmp_path / "back", "hf")
    same_weights(src, back)


def test_qwen2_biases_elsewhere_are_refused_by_the_cli(hf, tmp_path):
    """A Megatron run with biases on every linear layer (``add_bias_linear``) is no Qwen2: refused by name."""
    out = convert(hf, tmp_path / "mg", "megatron", options={"layout": "dist"})
    common = out / "iter_0000000" / "common.pt"
    state = torch.load(common, weights_only=False)
    state["args"].add_bias_linear = True
    torch.save(state, common)
    run = ckptio_here("convert", str(out), str(tmp_path / "back"), "--to", "hf", "--no-progress")
    assert run.returncode == 2 and "linear biases" in run.stderr, run.stderr
    assert not (tmp_path / "back").exists()


def test_a_run_whose_args_and_tensors_disagree_about_the_biases_is_refused(hf, tmp_path):
    out = convert(hf, tmp_path / "mg", "megatron", options={"layout": "dist"})
    common = out / "iter_0000000" / "common.pt"
    state = torch.load(common, weights_only=False)
    state["args"].add_qkv_bias = False
    torch.save(state, common)
    with pytest.raises(CheckpointError, match=r"linear_qkv\.bias.*add_qkv_bias"):
        convert(out, tmp_path / "back", "hf")
    assert not (tmp_path / "back").exists()


# ------------------------------------------------------------------------------------------- megatron-core
def _megatron(*args: str) -> None:
    run = subprocess.run([sys.executable, str(FIXTURE), "--family", "qwen2", *args], capture_output=True, text=True,
                         timeout=300, start_new_session=True)
    assert run.returncode == 0, f"megatron-core run {args} failed:\n{run.stderr[-3000:]}"


LAYOUTS = [(2, 1), (2, 2)]


@pytest.fixture(scope="module")
def made() -> dict[tuple[int, int], Path]:
    pytest.importorskip("megatron.core")
    return {(tp, pp): built(FIXTURE.name, "--family", "qwen2", "--tp", str(tp), "--pp", str(pp)) for tp, pp in LAYOUTS}


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", LAYOUTS)
@pytest.mark.parametrize("layout", ["torch_dist", "legacy"])
def test_megatron_qwen2_converts_to_a_qwen2_with_megatrons_logits(made, tmp_path, tp, pp, layout):
    ref = torch.load(made[(tp, pp)] / "reference.pt")
    run = ckptio_here("convert", str(made[(tp, pp)] / layout), str(tmp_path / "hf"), "--to", "hf", "--no-progress")
    assert run.returncode == 0, run.stderr
    config = config_of(tmp_path / "hf")
    assert config["model_type"] == "qwen2" and config["rope_parameters"]["rope_theta"] == THETA
    got = _logits(tmp_path / "hf", ref["input_ids"])
    assert got.shape == ref["logits"].shape
    assert torch.allclose(got, ref["logits"], atol=1e-5, rtol=0), (got - ref["logits"]).abs().max()


@pytest.mark.slow
def test_megatron_core_loads_a_qwen2_ckptio_exports(tmp_path):
    """A Qwen2ForCausalLM made by transformers -> ``--to megatron`` at TP=2 PP=2 -> megatron-core's strict loader
    into a TP=2 model -> the logits transformers gives."""
    pytest.importorskip("megatron.core")
    src = _qwen2(tmp_path / "hf", seed=3)
    run = ckptio_here("convert", str(src), str(tmp_path / "mg"), "--to", "megatron", "--tp", "2", "--pp", "2",
                      "--no-progress")
    assert run.returncode == 0, run.stderr
    _megatron("--tp", "2", "--pp", "1", "--load", str(tmp_path / "mg" / "iter_0000000"),
              "--out", str(tmp_path / "logits.pt"))
    got = torch.load(tmp_path / "logits.pt")
    want = _logits(src, got["input_ids"])
    assert torch.allclose(got["logits"], want, atol=1e-5, rtol=0), (got["logits"] - want).abs().max()


def test_a_qwen2_without_its_biases_is_refused_before_writing(hf, tmp_path):
    """A qwen2 config over weights without q/k/v biases (or a llama config over weights with them) would be exported
    with args that do not match its tensors: refused, naming the count."""
    import shutil

    from safetensors.torch import load_file, save_file

    src = Path(shutil.copytree(hf, tmp_path / "src"))
    (weights,) = src.glob("*.safetensors")
    save_file({k: v for k, v in load_file(weights).items() if not k.endswith("_proj.bias")}, weights,
              metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"0 of its 4 layers have q_proj biases, but its config is a qwen2's"):
        convert(src, tmp_path / "mg", "megatron")
    assert not (tmp_path / "mg").exists()


def test_qnemo_still_refuses_a_qwen2(hf, tmp_path):
    """Megatron holds a Qwen2's q/k/v biases; the TensorRT-LLM export (qnemo), which shares the field lists, does
    not: a qwen2 stays refused there."""
    run = ckptio_here("quantize", str(hf), str(tmp_path / "q"), "--check", "0")
    assert run.returncode == 2 and "needs a transformers Llama model" in run.stderr, run.stderr
    assert not (tmp_path / "q").exists()




@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_restore_from_megatron_brings_a_qwen2_its_biases_and_their_moments(made, tmp_path, world):
    """Megatron took one Adam step (lr 1e-3, betas 0.9/0.95) with gradient g = 0.5 w0 + 0.25 on every element
    (megatron_fixture.py), so every element, the q/k/v biases' included, must satisfy exp_avg = 0.1 g,
    exp_avg_sq = 0.05 g^2 and w = 2g - 0.5 - 1e-3 sign(g): a moment on the wrong element breaks it."""
    from distributed import run_ranks

    src = made[(2, 2)] / "torch_dist"
    hf = convert(src, tmp_path / "hf", "hf")
    got = run_ranks(world, restore_with_adam, source=str(src), config=str(hf))[0]
    steps = got.pop("steps")
    params = [k.removeprefix("model/") for k in got if k.startswith("model/")]
    assert len(params) == steps.numel() == 51 and bool((steps == 1).all()), steps
    assert sum(p.endswith("_proj.bias") for p in params) == 12
    for name in params:
        g = got[f"optim/state.{name}.exp_avg"] / 0.1
        assert torch.allclose(got[f"optim/state.{name}.exp_avg_sq"], 0.05 * g * g, rtol=1e-4, atol=1e-9), name
        assert torch.allclose(got[f"model/{name}"], 2 * g - 0.5 - 1e-3 * torch.sign(g), atol=2e-6, rtol=0), name

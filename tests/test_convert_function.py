"""``ckptio convert --to X`` and back to Hugging Face keeps the model's function, not only its tensors.

The source is a tiny transformers-5 ``LlamaForCausalLM`` written by ``save_pretrained``: its config holds the
rotary base in transformers 5's spelling (``"rope_parameters": {"rope_theta": 50000, ...}``), grouped-query
attention (2 KV heads for 4 query heads), tied or untied embeddings. Each target is written with the real
command line (``ckptio.cli.main``), converted back to ``hf``, loaded with ``AutoModelForCausalLM`` and run on a
fixed input: logits equal the source's and every weight is bitwise the same. A config field a target cannot
hold (a scaled RoPE, biases) is refused by name, in either spelling, and nothing is written.

Targets without a place for the config (``torch``, ``lightning``: weights only, docs/converters.md) come back
without ``config.json``; there the source's config is put beside the weights, which proves the weights. The
``qnemo`` export is quantized (int8) and only read back by :func:`ckptio.formats.nemo.qnemo.load_qnemo`: its
TensorRT-LLM config carries the rotary base and scaling, and the model it rebuilds predicts like the source.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from ckptio.cli import main
from ckptio.convert import convert
from ckptio.errors import ConfigError
from ckptio.formats.hf_fields import UnsupportedFieldError

THETA = 50000.0
SUFFIX = {"torch": ".pt", "nemo": ".nemo", "lightning": ".ckpt"}
NO_CONFIG = ("torch", "lightning")  # formats that hold the weights only
INPUT = (torch.arange(48).reshape(2, 24) * 7) % 96


def _llama(folder: Path, *, tied: bool, seed: int = 0, **extra) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=tied, initializer_range=0.2, rope_theta=THETA, **extra)
    LlamaForCausalLM(config).eval().save_pretrained(folder)
    return folder


def _config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def _respell_4x(folder: Path, **rope_scaling) -> Path:
    """The same model with its config in transformers 4's spelling (``rope_theta``, ``rope_scaling``)."""
    config = _config(folder)
    params = config.pop("rope_parameters")
    config["rope_theta"] = params["rope_theta"]
    if rope_scaling:
        config["rope_scaling"] = rope_scaling
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def source(request, tmp_path_factory) -> Path:
    src = _llama(tmp_path_factory.mktemp("src") / "llama", tied=request.param)
    assert _config(src)["rope_parameters"]["rope_theta"] == THETA and "rope_theta" not in _config(src)  # 5.x spelling
    return src


def _cli(*argv: str) -> None:
    assert main(["convert", *argv, "--no-progress"]) == 0


def _load(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder).eval()


def _same_function(src: Path, back: Path) -> None:
    a, b = _load(src), _load(back)
    assert a.config.rope_parameters["rope_theta"] == b.config.rope_parameters["rope_theta"] == THETA
    assert b.config.rope_parameters["rope_type"] == "default"
    assert b.config.tie_word_embeddings == a.config.tie_word_embeddings
    assert b.config.num_key_value_heads == 2
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key, value in sa.items():
        assert torch.equal(value, sb[key]), f"{key} changed on the way"
    with torch.no_grad():
        torch.testing.assert_close(b(INPUT).logits, a(INPUT).logits, rtol=0, atol=1e-6)


TARGETS = [
    pytest.param(["hf"], id="hf"), pytest.param(["safetensors"], id="safetensors"), pytest.param(["dcp"], id="dcp"),
    pytest.param(["step_dir"], id="step_dir"), pytest.param(["nemo"], id="nemo"),
    pytest.param(["torch"], id="torch"), pytest.param(["lightning"], id="lightning"),
    pytest.param(["megatron", "--megatron-layout", "dist"], id="megatron-dist"),
    pytest.param(["megatron", "--megatron-layout", "legacy"], id="megatron-legacy"),
    pytest.param(["megatron", "--megatron-layout", "dist", "--tp", "2", "--pp", "2"], id="megatron-dist-tp2pp2"),
    pytest.param(["megatron", "--megatron-layout", "legacy", "--tp", "2", "--pp", "2"], id="megatron-legacy-tp2pp2"),
]


@pytest.mark.parametrize("target", TARGETS)
def test_a_round_trip_through_every_target_keeps_the_logits(source, tmp_path, target):
    to, *flags = target
    mid = tmp_path / f"mid{SUFFIX.get(to, '')}"
    _cli(str(source), str(mid), "--to", to, *flags)
    back = tmp_path / "back"
    _cli(str(mid), str(back), "--to", "hf")
    if to in NO_CONFIG:
        assert not (back / "config.json").exists()  # the format has no place for it
        shutil.copyfile(source / "config.json", back / "config.json")
    _same_function(source, back)


def test_megatron_records_the_rotary_base_of_either_spelling(tmp_path):
    """The Megatron run's own ``args`` (what Megatron-LM reads on resume) carry the base, from 5.x and 4.x."""
    from ckptio.formats.megatron.layout import run_args

    five = _llama(tmp_path / "five", tied=False)
    four = _respell_4x(_llama(tmp_path / "four", tied=False))
    for src in (five, four):
        _cli(str(src), str(tmp_path / f"mg-{src.name}"), "--to", "megatron")
        args = run_args(tmp_path / f"mg-{src.name}")
        assert args.rotary_base == THETA and args.position_embedding_type == "rope" and args.num_query_groups == 2
    _cli(str(tmp_path / "mg-four"), str(tmp_path / "back"), "--to", "hf")
    _same_function(five, tmp_path / "back")


def test_the_weights_dtype_is_read_in_either_spelling(tmp_path):
    from ckptio.formats.megatron.write import megatron_args

    config = _config(_llama(tmp_path / "m", tied=False))
    for key in ("dtype", "torch_dtype"):
        spelled = {k: v for k, v in config.items() if k not in ("dtype", "torch_dtype")} | {key: "bfloat16"}
        args = megatron_args(spelled, 1, 1, "torch_dist")
        assert args.bf16 and not args.fp16, key


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}


@pytest.mark.parametrize("spelling,scaling,field", [
    ("5.x", LLAMA3, "rope_parameters.rope_type"),
    ("5.x", {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32}, "rope_parameters.rope_type"),
    ("4.x", {"rope_type": "linear", "factor": 2.0}, "rope_scaling.rope_type"),
    ("4.x", {"type": "dynamic", "factor": 2.0}, "rope_scaling.rope_type"),
])
def test_a_scaled_rope_is_refused_by_megatron_naming_the_field(tmp_path, spelling, scaling, field):
    if spelling == "5.x":
        src = _llama(tmp_path / "src", tied=False, rope_parameters={"rope_theta": THETA, **scaling})
        assert _config(src)["rope_parameters"]["rope_type"] == scaling["rope_type"]
    else:
        src = _respell_4x(_llama(tmp_path / "src", tied=False), **scaling)
    from ckptio.convert import convert

    with pytest.raises(UnsupportedFieldError, match=rf"{field} = '{scaling.get('rope_type', scaling.get('type'))}'.*"
                                                    r"Megatron checkpoint cannot hold it") as err:
        convert(src, tmp_path / "mg", "megatron")
    assert err.value.field == field and isinstance(err.value, ConfigError)
    assert not (tmp_path / "mg").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["src"]


@pytest.mark.parametrize("extra,field", [({"attention_bias": True}, "attention_bias"),
                                         ({"mlp_bias": True}, "mlp_bias")])
def test_biases_are_refused_by_the_cli_naming_the_field(tmp_path, capsys, extra, field):
    src = _llama(tmp_path / "src", tied=False, **extra)
    assert main(["convert", str(src), str(tmp_path / "mg"), "--to", "megatron", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"{field} = True: a Megatron checkpoint cannot hold it" in err and "nothing was written" in err
    assert not (tmp_path / "mg").exists()


def _megatron_with_args(tmp_path: Path, **changes) -> Path:
    src = _llama(tmp_path / "src", tied=False)
    _cli(str(src), str(tmp_path / "mg"), "--to", "megatron")
    common = tmp_path / "mg" / "iter_0000000" / "common.pt"
    state = torch.load(common, weights_only=False)
    for k, v in changes.items():
        setattr(state["args"], k, v)
    torch.save(state, common)
    return tmp_path / "mg"


def test_megatron_lm_rope_scaling_comes_back_as_llama3(tmp_path):
    """Megatron-LM's ``--use-rope-scaling`` (Llama 3.1) is Megatron-Core's llama3 scaling with fixed factors."""
    mg = _megatron_with_args(tmp_path, use_rope_scaling=True, rope_scaling_factor=8.0)
    _cli(str(mg), str(tmp_path / "back"), "--to", "hf")
    config = _load(tmp_path / "back").config
    assert config.rope_parameters == {"rope_theta": THETA, "rope_type": "llama3", "factor": 8.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("arg,value", [("rotary_percent", 0.5), ("rotary_seq_len_interpolation_factor", 4.0)])
def test_megatron_rotary_settings_hf_llama_lacks_are_refused_by_name(tmp_path, capsys, arg, value):
    mg = _megatron_with_args(tmp_path, **{arg: value})
    assert main(["convert", str(mg), str(tmp_path / "back"), "--to", "hf", "--no-progress"]) == 2
    assert f"{arg}={value}" in capsys.readouterr().err
    assert not (tmp_path / "back").exists()


# ------------------------------------------------------------------------------------------------- qnemo
def _qnemo(src: Path, out: Path) -> dict:
    assert main(["quantize", str(src), str(out), "--check", "0"]) == 0
    return json.loads((out / "config.json").read_text())


def _quantized_like_qnemo(model):
    """``model`` with every decoder linear weight replaced by its int8 round trip (what the export holds)."""
    from ckptio.formats.nemo.qnemo import dequantize, quantize

    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and ".layers." in name:
                module.weight.copy_(dequantize(*quantize(module.weight, "int8_wo")))
    return model


def test_qnemo_carries_the_rotary_base_and_computes_like_the_source(source, tmp_path):
    """No reader turns a quantized export back into an hf folder: the exported config is checked, and the model
    ckptio's reference reader rebuilds gives the logits of the source with its weights quantized the same way."""
    from ckptio.formats.nemo.qnemo import load_qnemo

    config = _qnemo(source, tmp_path / "q")
    assert config["rotary_base"] == THETA and config["rotary_scaling"] is None
    assert config["num_key_value_heads"] == 2
    assert config["ckptio"]["hf_config"]["tie_word_embeddings"] == _config(source)["tie_word_embeddings"]
    rebuilt = load_qnemo(tmp_path / "q")
    assert rebuilt.config.rope_parameters["rope_theta"] == THETA
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(INPUT).logits, _quantized_like_qnemo(_load(source))(INPUT).logits,
                                   rtol=0, atol=1e-5)


def test_qnemo_keeps_a_scaled_rope_and_refuses_biases(tmp_path, capsys):
    src = _llama(tmp_path / "src", tied=False, rope_parameters={"rope_theta": THETA, **LLAMA3})
    config = _qnemo(src, tmp_path / "q")
    assert config["rotary_base"] == THETA and config["rotary_scaling"]["type"] == "llama3"
    assert config["rotary_scaling"]["factor"] == 8.0
    biased = _llama(tmp_path / "biased", tied=False, attention_bias=True)
    assert main(["quantize", str(biased), str(tmp_path / "qb"), "--check", "0"]) == 2
    assert "attention_bias = True: a qnemo (TensorRT-LLM) checkpoint cannot hold it" in capsys.readouterr().err
    assert not (tmp_path / "qb").exists()


# ------------------------------------------------------------- every field of the model type, placed (issue 46)
def test_the_field_lists_place_every_field_of_the_installed_config_classes():
    """Each field of transformers' LlamaConfig and MistralConfig is carried, inert, or must have the one value a
    Llama-shaped target computes; a release that adds a field fails here until it is placed."""
    from ckptio.formats.hf_fields import MODEL_FIELDS, class_fields

    for kind in MODEL_FIELDS:
        fields = class_fields(kind)
        assert fields and not fields - MODEL_FIELDS[kind], (kind, sorted(fields - MODEL_FIELDS[kind]))


def test_a_field_is_read_as_the_model_type_reads_it(tmp_path):
    """Issue 46, row 7: a Mistral config with ``sliding_window: 8`` and a stray ``use_sliding_window: false`` (a
    Qwen2 field Mistral ignores) converted without a word and the logits moved by 0.107: Mistral attends in a
    window of 8 whatever that field says, so the window is refused by name."""
    from ckptio.convert import convert

    src = _llama(tmp_path / "src", tied=False)
    config = _config(src)
    config.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=8,
                  use_sliding_window=False)
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedFieldError) as err:
        convert(src, tmp_path / "mg", "megatron")
    assert err.value.field == "sliding_window" and err.value.value == 8
    assert not (tmp_path / "mg").exists()


@pytest.mark.parametrize("field,value", [("pretraining_tp", 2), ("hidden_act", "gelu")])
def test_a_llama_field_with_another_value_is_refused_by_name(tmp_path, field, value):
    from ckptio.convert import convert

    src = _llama(tmp_path / "src", tied=False)
    (src / "config.json").write_text(json.dumps({**_config(src), field: value}))
    with pytest.raises(UnsupportedFieldError) as err:
        convert(src, tmp_path / "mg", "megatron")
    assert err.value.field == field and not (tmp_path / "mg").exists()


def test_a_field_of_the_model_type_the_lists_do_not_place_is_refused_by_name(tmp_path, monkeypatch):
    """What a newer transformers adds to the model type: refused by name, never guessed."""
    from ckptio.convert import convert
    from ckptio.formats import hf_fields

    src = _llama(tmp_path / "src", tied=False)
    (src / "config.json").write_text(json.dumps({**_config(src), "attn_logit_softcapping": 50.0}))
    monkeypatch.setattr(hf_fields, "class_fields", lambda kind: frozenset({"attn_logit_softcapping", "hidden_size"}))
    with pytest.raises(UnsupportedFieldError, match="does not know whether") as err:
        convert(src, tmp_path / "mg", "megatron")
    assert err.value.field == "attn_logit_softcapping"


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_every_carried_field_off_its_default_keeps_the_logits_through_megatron(tmp_path, kind):
    """Each carried field at a value other than its default (head_dim, rms_norm_eps, max_position_embeddings, the
    rotary base, grouped heads, untied embeddings), for both model types: HF -> Megatron -> HF computes the same."""
    src = _llama(tmp_path / "src", tied=False, head_dim=16, rms_norm_eps=1e-3)
    config = _config(src)
    config["max_position_embeddings"] = 48
    if kind == "mistral":
        config.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=None)
    (src / "config.json").write_text(json.dumps(config))
    _cli(str(src), str(tmp_path / "mg"), "--to", "megatron", "--tp", "2")
    _cli(str(tmp_path / "mg"), str(tmp_path / "back"), "--to", "hf")
    a, b = _load(src), _load(tmp_path / "back")
    assert (b.config.head_dim, b.config.rms_norm_eps, b.config.max_position_embeddings) == (16, 1e-3, 48)
    with torch.no_grad():
        torch.testing.assert_close(b(INPUT).logits, a(INPUT).logits, rtol=0, atol=1e-6)


@pytest.mark.parametrize("arg,value", [("apply_layernorm_1p", True), ("window_size", (8, 0)), ("qk_l2_norm", True),
                                       ("qk_layernorm", True), ("num_experts", 8), ("softmax_scale", 0.5)])
def test_megatron_arguments_a_llama_does_not_compute_are_refused_by_name(tmp_path, capsys, arg, value):
    """Issue 46, row 8: ``apply_layernorm_1p`` copied the norm weights as they are (logits off by 0.47), a window
    and QK L2 norms were accepted silently. Every argument is placed (formats/megatron/fields.py); these refuse."""
    mg = _megatron_with_args(tmp_path, **{arg: value})
    assert main(["convert", str(mg), str(tmp_path / "back"), "--to", "hf", "--no-progress"]) == 2
    assert f"{arg}={value!r}" in capsys.readouterr().err
    assert not (tmp_path / "back").exists()


def test_every_field_of_megatron_cores_configs_is_placed():
    """Carried, refused unless off, or inert: each field of the installed megatron-core's ``TransformerConfig`` and
    ``ModelParallelConfig`` (a release that adds one fails here until it is placed in formats/megatron/fields.py)."""
    import dataclasses
    import warnings

    from ckptio.formats.megatron.fields import CARRIED, INERT, MUST

    pytest.importorskip("megatron.core")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.transformer.transformer_config import TransformerConfig
    names = {f.name for f in dataclasses.fields(TransformerConfig)}  # ModelParallelConfig's fields included
    assert len(names) > 200
    assert not names - CARRIED - MUST - INERT, sorted(names - CARRIED - MUST - INERT)
    assert not (CARRIED & MUST) | (CARRIED & INERT) | (MUST & INERT)


def test_megatron_round_trip_carries_the_generation_config_and_tokenizer_files(tmp_path):
    """Issue 52, row 10: Megatron -> HF dropped ``generation_config.json``. The files a Hugging Face model has
    besides its config and weights go into the Megatron run folder and come back from it."""
    src = _llama(tmp_path / "src", tied=False)
    gen = {"bos_token_id": 1, "eos_token_id": 2, "do_sample": True, "temperature": 0.6, "top_p": 0.9}
    (src / "generation_config.json").write_text(json.dumps(gen))
    (src / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64}))
    _cli(str(src), str(tmp_path / "mg"), "--to", "megatron")
    assert (tmp_path / "mg" / "generation_config.json").is_file()
    _cli(str(tmp_path / "mg"), str(tmp_path / "back"), "--to", "hf")
    for name in ("generation_config.json", "tokenizer_config.json"):
        assert json.loads((tmp_path / "back" / name).read_text()) == json.loads((src / name).read_text()), name
    from transformers import GenerationConfig

    assert GenerationConfig.from_pretrained(tmp_path / "back").temperature == 0.6


@pytest.mark.parametrize("field, value, words", [
    ("num_attention_heads", "x", "num_attention_heads must be a whole number"),
    ("num_hidden_layers", 0, "num_hidden_layers must be a whole number"),
    ("num_key_value_heads", 3, "not a multiple of num_key_value_heads 3"),
    ("rope_parameters", {"rope_type": "default", "rope_theta": 10 ** 400}, "must be a positive finite number"),
    ("rms_norm_eps", float("nan"), "rms_norm_eps must be a number"),
], ids=["text", "zero", "kv-heads", "huge", "nan"])
def test_a_config_of_impossible_sizes_given_to_a_megatron_export_is_refused_by_name(tmp_path, field, value, words):
    """What a small config.json makes the writer build is bounded: a size that is not a positive whole number, heads
    that do not divide, a huge or NaN number are refused naming the file and the field (the fuzzer's ``hf_config``
    family found each as a bare ValueError, KeyError, OverflowError or ZeroDivisionError)."""
    from ckptio import CheckpointError

    src = _llama(tmp_path / "src", tied=False)
    config = _config(src)
    config[field] = value
    (tmp_path / "bad.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=words) as err:
        convert(src, tmp_path / "mg", "megatron", config=str(tmp_path / "bad.json"))
    assert "config.json" in str(err.value)
    assert not (tmp_path / "mg").exists()


def test_a_config_whose_heads_do_not_fit_the_weights_is_refused_naming_the_tensors(tmp_path):
    """A config with other (valid) head counts than the weights were made with is refused naming the projections,
    not cut into other heads nor failed by a bare reshape error."""
    from ckptio import CheckpointError

    src = _llama(tmp_path / "src", tied=False)
    config = _config(src)
    config.pop("num_key_value_heads")  # 4 key/value heads assumed, the weights have 2
    (tmp_path / "bad.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"key projection has shape \(16, 32\).*4 key/value heads"):
        convert(src, tmp_path / "mg", "megatron", config=str(tmp_path / "bad.json"))
    assert not (tmp_path / "mg").exists()

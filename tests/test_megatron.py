"""Megatron checkpoints out and back in: HF Llama -> Megatron (TP x PP, both layouts) -> HF, bitwise.

The checkpoints written here are read back by ckptio's own Megatron reader; ``test_megatron_core.py``
proves the same layouts against the real megatron-core package (its checkpoints in, ours read by it).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ckptio.convert.formats import convert
from ckptio.errors import CheckpointCorruptError, CheckpointError, ConfigError
from ckptio.formats.safetensors.sharded import SafetensorsSource
from cli_here import ckptio_here


def _hf(folder: Path, *, tied: bool = False, vocab: int = 100) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def _same_weights(a: Path, b: Path) -> None:
    x, y = SafetensorsSource(a), SafetensorsSource(b)
    assert x.index().keys() == y.index().keys()
    for key in x.index():
        assert torch.equal(x.read(key), y.read(key)), f"{key} differs after the round trip"


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> Path:
    return _hf(tmp_path_factory.mktemp("hf") / "model")


@pytest.mark.parametrize("layout", ["dist", "legacy"])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_hf_to_megatron_and_back_is_bitwise(hf, tmp_path, layout, tp, pp):
    out = convert(hf, tmp_path / "megatron", "megatron", options={"tp": tp, "pp": pp, "layout": layout})
    iteration = out / "iter_0000000"
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "0"
    if layout == "legacy":
        expected = {f"mp_rank_{t:02d}" + (f"_{s:03d}" if pp > 1 else "") for t in range(tp) for s in range(pp)}
        assert {p.name for p in iteration.iterdir()} == expected
    else:
        assert {"metadata.json", "common.pt", ".metadata"} <= {p.name for p in iteration.iterdir()}
    back = convert(out, tmp_path / "back", "hf")
    _same_weights(hf, back)
    from ckptio.formats.common import read_json

    assert read_json(back / "config.json")["vocab_size"] == 100  # the padding (to 128 x TP) is cut again


def test_tied_embeddings_travel_as_megatron_shares_them(tmp_path):
    src = _hf(tmp_path / "tied", tied=True)
    out = convert(src, tmp_path / "megatron", "megatron", options={"tp": 2, "pp": 2, "layout": "legacy"})
    from ckptio.formats.megatron.format import MegatronSource

    assert "output_layer.weight" not in MegatronSource(out).index()
    back = convert(out, tmp_path / "back", "hf")
    _same_weights(src, back)


def test_the_cli_converts_and_inspect_names_the_layout(hf, tmp_path):
    out = tmp_path / "mg"
    run = ckptio_here("convert", str(hf), str(out), "--to", "megatron", "--tp", "2", "--pp", "2", "--megatron-layout",
                      "legacy", "--no-progress")
    assert run.returncode == 0, run.stderr
    shown = ckptio_here("inspect", str(out))
    assert shown.returncode == 0, shown.stderr
    assert "Megatron-LM legacy (mp_rank_*), saved on TP=2 PP=2" in shown.stdout
    assert "LlamaForCausalLM" in shown.stdout


def test_a_split_the_model_does_not_allow_is_refused_before_writing(hf, tmp_path):
    with pytest.raises(ConfigError, match=r"num_key_value_heads \(2\) is not divisible by 4"):
        convert(hf, tmp_path / "mg", "megatron", options={"tp": 4})
    with pytest.raises(ConfigError, match=r"num_hidden_layers \(4\) is not divisible by 3"):
        convert(hf, tmp_path / "mg", "megatron", options={"pp": 3})
    assert not (tmp_path / "mg").exists() and list(tmp_path.iterdir()) == []


def test_damaged_megatron_folders_are_refused_with_the_path(hf, tmp_path):
    import shutil

    out = convert(hf, tmp_path / "mg", "megatron", options={"tp": 2, "pp": 2, "layout": "legacy"})
    shutil.rmtree(out / "iter_0000000" / "mp_rank_01_001")
    with pytest.raises(CheckpointCorruptError, match=r"incomplete; missing \['mp_rank_01_001'\]"):
        convert(out, tmp_path / "back", "hf")
    (out / "latest_checkpointed_iteration.txt").write_text("../../etc")
    with pytest.raises(CheckpointCorruptError, match="not an iteration or 'release'"):
        convert(out, tmp_path / "back2", "hf")
    (out / "latest_checkpointed_iteration.txt").write_text("7")
    with pytest.raises(CheckpointCorruptError, match="names iter_0000007, which is not a folder"):
        convert(out, tmp_path / "back3", "hf")
    # a rank file replaced by one that would run code
    (out / "latest_checkpointed_iteration.txt").write_text("0")
    shutil.copytree(out / "iter_0000000" / "mp_rank_00_001", out / "iter_0000000" / "mp_rank_01_001")
    import pickle
    import zipfile

    evil = out / "iter_0000000" / "mp_rank_01_001" / "model_optim_rng.pt"
    with zipfile.ZipFile(evil, "w") as zf:
        zf.writestr("archive/data.pkl", pickle.dumps({"model": _Evil()}, protocol=2))
    with pytest.raises(CheckpointError, match=r"mp_rank_01_001/model_optim_rng\.pt.*refusing to load the global"):
        convert(out, tmp_path / "back4", "hf")


class _Evil:
    def __reduce__(self):
        import os

        return (os.getcwd, ())


def test_a_non_llama_megatron_model_is_refused_by_name(hf, tmp_path):
    out = convert(hf, tmp_path / "mg", "megatron", options={"layout": "dist"})
    common = out / "iter_0000000" / "common.pt"
    state = torch.load(common, weights_only=False)
    state["args"].normalization = "LayerNorm"
    torch.save(state, common)
    with pytest.raises(CheckpointError, match="not a Llama-style model .normalization=LayerNorm"):
        convert(out, tmp_path / "back", "hf")


def _nemo_config(tp: int, pp: int) -> str:
    # the keys NeMo 1.x writes for a Megatron-Core GPT model (megatron_gpt_config.yaml)
    return "\n".join([
        "mcore_gpt: true", f"tensor_model_parallel_size: {tp}", f"pipeline_model_parallel_size: {pp}",
        "num_layers: 4", "hidden_size: 64", "ffn_hidden_size: 128", "num_attention_heads: 4",
        "num_query_groups: 2", "kv_channels: 16", "layernorm_epsilon: 1.0e-06", "normalization: rmsnorm",
        "activation: fast-swiglu", "position_embedding_type: rope", "rotary_base: 10000.0", "bias: false",
        "share_embeddings_and_output_weights: false", "max_position_embeddings: 2048", "precision: 32",
        "target: nemo.collections.nlp.models.language_modeling.megatron_gpt_model.MegatronGPTModel", ""])


@pytest.mark.parametrize("weights", ["tp_rank_TT_pp_rank_PPP", "mp_rank_TT", "model_weights (torch_dist)"])
def test_nemo_archives_with_megatron_weights_read_as_llama(hf, tmp_path, weights):
    """NeMo 1.x archives keep each rank's ``model.``-prefixed state dict in a model-parallel folder, or a
    Megatron-Core distributed checkpoint in ``model_weights/``; built here from their documented layout."""
    import shutil
    import tarfile

    tp, pp = (2, 1) if weights == "mp_rank_TT" else (2, 2)
    stage = tmp_path / "stage"
    stage.mkdir()
    (stage / "model_config.yaml").write_text(_nemo_config(tp, pp))
    if weights == "model_weights (torch_dist)":
        out = convert(hf, tmp_path / "mg", "megatron", options={"tp": tp, "pp": pp})
        shutil.copytree(out / "iter_0000000", stage / "model_weights")
    else:
        out = convert(hf, tmp_path / "mg", "megatron", options={"tp": tp, "pp": pp, "layout": "legacy"})
        for rank_dir in (out / "iter_0000000").iterdir():
            t, s = int(rank_dir.name[8:10]), int(rank_dir.name[11:14] or 0)
            name = f"mp_rank_{t:02d}" if weights == "mp_rank_TT" else f"tp_rank_{t:02d}_pp_rank_{s:03d}"
            model = torch.load(rank_dir / "model_optim_rng.pt", weights_only=False)["model"]
            (stage / name).mkdir()
            torch.save({f"model.{k}": v for k, v in model.items()}, stage / name / "model_weights.ckpt")
    archive = tmp_path / "gpt.nemo"
    with tarfile.open(archive, "w") as tar:
        tar.add(stage, arcname=".")
    back = convert(archive, tmp_path / "back", "hf")
    from ckptio.formats.common import read_json

    cfg = read_json(back / "config.json")
    assert cfg["rms_norm_eps"] == 1e-6 and cfg["num_key_value_heads"] == 2
    # a NeMo config does not record the tokenizer's vocabulary: the padded rows (zeros here) stay
    assert cfg["vocab_size"] == 128 * tp
    x, y = SafetensorsSource(hf), SafetensorsSource(back)
    assert x.index().keys() == y.index().keys()
    for key in x.index():
        want, got = x.read(key), y.read(key)
        if key in ("model.embed_tokens.weight", "lm_head.weight"):
            assert torch.equal(got[:100], want) and not got[100:].any(), key
        else:
            assert torch.equal(got, want), key
    shown = ckptio_here("inspect", str(archive))
    assert shown.returncode == 0 and "Megatron" in shown.stdout, shown.stderr


def _restore_from(source: str, seed: int) -> dict:
    from ckptio import CheckpointConfig, CheckpointManager
    from toy import full_state, make_model

    model = make_model(seed=seed, tie_word_embeddings=False)  # FSDP2-sharded on several ranks
    with CheckpointManager(CheckpointConfig(checkpoint_dir=str(Path(source).parent / "run")), model=model,
                           rng=False) as mgr:
        info = mgr.restore(source)
    out = {k.removeprefix("model/"): v for k, v in full_state(model).items()}
    out["step"] = torch.tensor(info.step)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["legacy", "dist"])
def test_restore_from_a_megatron_checkpoint_fills_a_sharded_model(tmp_path, layout):
    from distributed import run_ranks
    from toy import make_model

    make_model(seed=5, tie_word_embeddings=False).save_pretrained(tmp_path / "hf")
    src = SafetensorsSource(tmp_path / "hf")
    want = {k: src.read(k) for k in src.index()}
    out = convert(tmp_path / "hf", tmp_path / "mg", "megatron", options={"tp": 2, "pp": 2, "layout": layout})
    (out / "latest_checkpointed_iteration.txt").write_text("40")
    (out / "iter_0000000").rename(out / "iter_0000040")
    for world in (2, 1):
        got = run_ranks(world, _restore_from, source=str(out), seed=9)[0]
        assert int(got.pop("step")) == 40
        assert got.keys() == want.keys(), sorted(set(got) ^ set(want))[:4]
        for k, v in want.items():
            assert torch.equal(got[k], v), f"{layout} on {world} rank(s): {k}"


def test_a_nemo2_checkpoint_reads_its_sizes_from_context(hf, tmp_path):
    """NeMo 2.0: ``weights/`` is a Megatron-Core distributed checkpoint with ``module.``-prefixed keys and an
    empty ``common.pt``; the sizes are in ``context/model.yaml`` (built here from the documented layout)."""
    from megatron_shared import nemo2_folder

    out = convert(hf, tmp_path / "mg", "megatron", options={"tp": 1, "pp": 1})
    nemo2_folder(out / "iter_0000000", tmp_path / "nemo2", [
        "_target_: nemo.collections.llm.gpt.model.llama.LlamaModel", "config:",
        "  _target_: nemo.collections.llm.gpt.model.llama.LlamaConfig",
        "  activation_func:", "    _call_: false", "    _target_: torch.nn.functional.silu",
        "  add_bias_linear: false", "  ffn_hidden_size: 128", "  gated_linear_unit: true", "  hidden_size: 64",
        "  kv_channels: 16", "  layernorm_epsilon: 1.0e-06", "  normalization: RMSNorm", "  num_attention_heads: 4",
        "  num_layers: 4", "  num_query_groups: 2", "  position_embedding_type: rope", "  rotary_base: 10000",
        "  seq_length: 2048", "  share_embeddings_and_output_weights: false", "  vocab_size: 100", ""])
    back = convert(tmp_path / "nemo2", tmp_path / "back", "hf")
    _same_weights(hf, back)


def _rows(run: Path) -> int:
    """Rows of the embedding as stored (with Megatron's vocabulary padding), all TP shards together."""
    from ckptio.formats.megatron.format import MegatronSource

    return MegatronSource(run)._read("embedding.word_embeddings.weight").shape[0]


@pytest.mark.parametrize("layout", ["dist", "legacy"])
def test_the_vocabulary_is_padded_for_the_runs_divisor(hf, tmp_path, layout):
    """Megatron-LM pads the vocabulary to a multiple of --make-vocab-size-divisible-by x TP; a run started with 64
    on TP=2 holds 128 rows where the default (128) would give 256, and cannot load an export padded for 128."""
    default = convert(hf, tmp_path / "default", "megatron", options={"tp": 2, "layout": layout})
    by64 = convert(hf, tmp_path / "by64", "megatron", options={"tp": 2, "layout": layout, "divisible_by": 64})
    assert _rows(default) == 256 and _rows(by64) == 128
    _same_weights(hf, convert(by64, tmp_path / "back", "hf"))  # the padding is cut again
    with pytest.raises(ConfigError, match="--vocab-divisible-by must be a positive integer"):
        convert(hf, tmp_path / "bad", "megatron", options={"divisible_by": 0})


def test_like_takes_tp_pp_and_the_divisor_from_an_existing_run(hf, tmp_path):
    run = convert(hf, tmp_path / "run", "megatron", options={"tp": 2, "pp": 2, "layout": "legacy", "divisible_by": 64})
    out = convert(hf, tmp_path / "like", "megatron", options={"like": str(run)})
    from ckptio.formats.megatron.layout import run_args

    args = run_args(out)
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
            args.make_vocab_size_divisible_by) == (2, 2, 64)
    assert _rows(out) == 128
    # an explicit value that contradicts the run, or a run of another model, is refused before writing
    with pytest.raises(ConfigError, match="--tp 1 contradicts --like"):
        convert(hf, tmp_path / "x", "megatron", options={"like": str(run), "tp": 1})
    other = _hf(tmp_path / "other", vocab=90)
    with pytest.raises(ConfigError, match=r"that run's model is not this one \(vocab_size: the run has 100, the model 90"):
        convert(other, tmp_path / "y", "megatron", options={"like": str(run)})
    with pytest.raises(CheckpointError, match="not a Megatron run or checkpoint folder"):
        convert(hf, tmp_path / "z", "megatron", options={"like": str(hf)})
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists() and not (tmp_path / "z").exists()


def test_the_cli_takes_the_divisor_and_like_and_refuses_them_for_other_targets(hf, tmp_path):
    run = ckptio_here("convert", str(hf), str(tmp_path / "a"), "--to", "megatron", "--tp", "2", "--vocab-divisible-by",
                      "64", "--no-progress")
    assert run.returncode == 0, run.stderr
    like = ckptio_here("convert", str(hf), str(tmp_path / "b"), "--to", "megatron", "--like", str(tmp_path / "a"),
                       "--no-progress")
    assert like.returncode == 0, like.stderr
    assert _rows(tmp_path / "b") == 128
    wrong = ckptio_here("convert", str(hf), str(tmp_path / "c"), "--to", "hf", "--like", str(tmp_path / "a"))
    assert wrong.returncode == 2 and "--like only apply to --to megatron" in wrong.stderr


def test_a_megatron_export_of_an_already_renamed_model_is_a_clear_error(hf, tmp_path):
    """``--to megatron --naming llama-to-megatron`` renamed the model before the export, which renames it itself:
    it stopped on a bare KeyError ('model.embed_tokens.weight'); now a ckptio error that says what to do."""
    run = ckptio_here("convert", str(hf), str(tmp_path / "mg"), "--to", "megatron", "--naming", "llama-to-megatron",
                      "--no-progress")
    assert run.returncode == 2 and "convert without --naming" in run.stderr, run.stderr
    assert not (tmp_path / "mg").exists()


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe"])
def test_a_config_without_rms_norm_eps_or_rope_gets_the_model_types_own_defaults(kind):
    """A ``config.json`` that leaves ``rms_norm_eps`` or the rotary base out means transformers' default for its model
    type (an epsilon of 1e-6 for a Llama, 1e-5 for a Mixtral; a base of 10000, 1e6 for a Mixtral): the Megatron export
    holds those, not one guess for every type."""
    import transformers

    from ckptio.formats.megatron.write import megatron_args

    default = transformers.AutoConfig.for_model(kind)
    config = {k: v for k, v in default.to_dict().items() if k not in ("rms_norm_eps", "rope_theta", "rope_parameters")}
    config.update(model_type=kind, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  intermediate_size=128, num_hidden_layers=2, vocab_size=128, sliding_window=None,
                  layer_types=None, use_sliding_window=False, mlp_only_layers=[], decoder_sparse_step=1)
    config = {k: v for k, v in config.items() if v is not None or k == "sliding_window"}
    args = megatron_args(config, 1, 1, "torch_dist")
    assert (args.norm_epsilon, args.rotary_base) == (default.rms_norm_eps, default.rope_parameters["rope_theta"])


@pytest.mark.parametrize("layout,tp,arg,value,says", [
    ("dist", 1, "ffn_hidden_size", 96, r"decoder\.layers\.\d\.mlp\.linear_fc[12]\.weight \(torch_dist tensor "
     r"decoder\.layers\.mlp\.linear_fc[12]\.weight\[\d\]\) has shape \[(256, 64|64, 128)\], not the "
     r"\[(192, 64|64, 96)\] of the run's ffn_hidden_size=96"),
    ("legacy", 2, "ffn_hidden_size", 96, r"mlp\.linear_fc[12]\.weight \(read from iter_0000000/mp_rank_00/"
     r"model_optim_rng\.pt, merged with its tensor-parallel shards in the other TP ranks' files \(TP=2\)\) "
     r"has shape .* of the run's ffn_hidden_size=96"),
    ("legacy", 2, "hidden_size", 32, r"has shape \[.*64.*\], not the \[.*32.*\] of the run's hidden_size=32"),
    ("legacy", 2, "padded_vocab_size", 384, r"embedding\.word_embeddings\.weight .*has shape \[256, 64\], not the "
     r"\[384, 64\] of the run's padded_vocab_size=384"),
    ("dist", 1, "num_layers", 3, r"holds 4 layers, but the run's num_layers=3"),
])
def test_args_that_disagree_with_the_weights_are_refused_by_name(hf, tmp_path, layout, tp, arg, value, says):
    """Issue 69: each tensor, its TP shards merged, has the shape the run's args give (the config.json written from
    them); one arg changed in the saved args is refused by name, nothing written."""
    from megatron_shared import with_args

    out = with_args(hf, tmp_path, layout=layout, tp=tp, **{arg: value})
    with pytest.raises(CheckpointCorruptError, match=says):
        convert(out, tmp_path / "back", "hf")
    assert not (tmp_path / "back").exists()


def test_a_legacy_tensor_of_a_shape_the_args_disagree_with_is_refused_naming_its_rank_file(hf, tmp_path):
    """A legacy read names the rank file that holds the tensor of the wrong shape (here TP rank 0's file of stage 1,
    whose layer 1 is the model's layer 3; a norm, whole on every TP rank, is read from TP rank 0's), not only the
    iteration folder: it said "its tensor-parallel shards merged", the file left to guess."""
    out = convert(hf, tmp_path / "mg", "megatron", options={"layout": "legacy", "tp": 2, "pp": 2})
    rank_file = out / "iter_0000000" / "mp_rank_00_001" / "model_optim_rng.pt"
    obj = torch.load(rank_file, weights_only=False)
    obj["model"]["decoder.layers.1.input_layernorm.weight"] = torch.ones(48)  # replicated over TP: rank 0's is read
    torch.save(obj, rank_file)
    with pytest.raises(CheckpointCorruptError, match=r"decoder\.layers\.3\.self_attention\.linear_qkv\."
                       r"layer_norm_weight \(read from iter_0000000/mp_rank_00_001/model_optim_rng\.pt\) "
                       r"has shape \[48\]"):
        convert(out, tmp_path / "back", "hf")
    assert not (tmp_path / "back").exists()

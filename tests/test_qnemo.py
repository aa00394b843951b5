""".qnemo exports: TP-split TensorRT-LLM-style files; the reference reader agrees with the original model."""

from __future__ import annotations

import json
import tarfile

import pytest
import torch
from safetensors import safe_open

from ckptio import CheckpointError
from ckptio.formats.nemo import qnemo


def _model():
    from toy import make_model

    return make_model(seed=11, num_key_value_heads=2).eval()  # grouped-query: 4 q heads share 2 kv heads


@pytest.mark.parametrize("algo,tp,min_agree", [("int8_wo", 2, 0.97), ("fp8", 1, 0.85), ("int8_wo", 1, 0.97)])
def test_export_splits_like_tensor_parallelism_and_dequantizes_back(tmp_path, algo, tp, min_agree):
    from toy import make_tokenizer

    model = _model()
    out = qnemo.export_qnemo(model, tmp_path / "m.qnemo", algo=algo, tp_size=tp, tokenizer=make_tokenizer())
    config = json.loads((out / "config.json").read_text())
    assert config["mapping"] == {"world_size": tp, "tp_size": tp, "pp_size": 1}
    assert config["quantization"]["quant_algo"] == qnemo.ALGOS[algo]
    assert (out / "tokenizer_config.yaml").is_file() and (out / "tokenizer.json").is_file()
    files = sorted(p.name for p in out.glob("rank*.safetensors"))
    assert files == [f"rank{r}.safetensors" for r in range(tp)]
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    with safe_open(str(out / "rank0.safetensors"), "pt") as fh:
        qkv = fh.get_tensor("transformer.layers.0.attention.qkv.weight")
        dense = fh.get_tensor("transformer.layers.0.attention.dense.weight")
        emb = fh.get_tensor("transformer.vocab_embedding.weight")
    qkv_rows = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * head_dim
    assert qkv.shape == (qkv_rows // tp, cfg.hidden_size)  # column-parallel: output rows split
    assert dense.shape == (cfg.hidden_size, cfg.hidden_size // tp)  # row-parallel: input columns split
    assert emb.shape == tuple(model.model.embed_tokens.weight.shape)  # replicated
    assert qkv.dtype == (torch.int8 if algo == "int8_wo" else torch.float8_e4m3fn)

    restored = qnemo.load_qnemo(out)
    ids = torch.randint(4, cfg.vocab_size, (4, 32), generator=torch.Generator().manual_seed(0))
    agree = qnemo.agreement(model, restored, ids)
    linear = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n.endswith("proj.weight"))
    stored = sum(p.stat().st_size for p in out.glob("rank*.safetensors"))
    print(f"{algo} tp={tp}: next-token agreement {agree:.3f}; files {stored} B for {linear} B of fp32 linear weights")
    assert agree >= min_agree


def test_unquantized_layout_round_trips_exactly_and_compress_writes_a_tar(tmp_path):
    model = _model()
    out = qnemo.export_qnemo(model, tmp_path / "m.qnemo", algo="int8_wo", tp_size=2, compress=True)
    assert out.is_file() and tarfile.is_tarfile(out)
    restored = qnemo.load_qnemo(out)
    # norms and embeddings are not quantized: they come back bit for bit through the TP split and merge
    assert torch.equal(restored.model.norm.weight, model.model.norm.weight)
    assert torch.equal(restored.model.embed_tokens.weight, model.model.embed_tokens.weight)
    # the int8 weights are within half a quantization step of the originals
    w = model.model.layers[0].self_attn.k_proj.weight
    step = w.abs().amax(dim=1, keepdim=True) / 127
    assert torch.all((restored.model.layers[0].self_attn.k_proj.weight - w).abs() <= step / 2 + 1e-7)


def test_bad_requests_and_damaged_exports_are_refused(tmp_path):
    model = _model()
    with pytest.raises(CheckpointError, match="tp_size=3"):
        qnemo.export_qnemo(model, tmp_path / "a", tp_size=3)
    with pytest.raises(CheckpointError, match="unknown quantization"):
        qnemo.export_qnemo(model, tmp_path / "b", algo="int3")
    out = qnemo.export_qnemo(model, tmp_path / "c", tp_size=2)
    (out / "rank1.safetensors").unlink()
    with pytest.raises(CheckpointError, match="rank1.safetensors is missing"):
        qnemo.load_qnemo(out)
    (out / "config.json").write_text("{")
    with pytest.raises(CheckpointError, match="config.json"):
        qnemo.load_qnemo(out)

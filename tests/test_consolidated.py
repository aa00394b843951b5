"""Consolidated Hugging Face bundles load in transformers with the trained model's logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from distributed import run_ranks

PROMPT = torch.tensor([[1, 8, 5, 12, 12, 15, 4, 20, 8, 5]])


def _train_and_save(root: str, fmt: str, max_shard: str, dtype_name: str = "float32") -> dict:
    from toy import Run, make_tokenizer

    run = Run(root, fmt, max_steps=2, save_consolidated="final", consolidated_max_shard_size=max_shard)
    run.mgr.tokenizer = make_tokenizer()
    run.train(save_at=(1, 2))  # step 1 is not final: no bundle; step 2 (max_steps) is
    run.model.eval()
    with torch.no_grad():
        logits = run.model(input_ids=PROMPT).logits
    return {"logits": logits}


def _check_bundle(step_dir: Path, logits: torch.Tensor) -> None:
    from transformers import AutoModelForCausalLM

    bundle = step_dir / "model" / "consolidated"
    model, info = AutoModelForCausalLM.from_pretrained(bundle, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    model.eval()
    with torch.no_grad():
        got = model(input_ids=PROMPT).logits
    assert torch.equal(got, logits), (got - logits).abs().max()
    index = json.loads((bundle / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == sorted(p.name for p in bundle.glob("model-*.safetensors"))
    assert index["metadata"]["total_size"] == sum(p.stat().st_size for p in bundle.glob("*.safetensors")) - sum(
        8 + int.from_bytes(p.read_bytes()[:8], "little") for p in bundle.glob("*.safetensors"))
    assert "lm_head.weight" not in index["weight_map"]  # tied, omitted as transformers does
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (bundle / name).is_file(), name


@pytest.mark.parametrize("world,fmt", [(1, "safetensors"), pytest.param(3, "torch_save", marks=pytest.mark.slow)])
def test_bundle_loads_in_transformers(tmp_path, world, fmt):
    out = run_ranks(world, _train_and_save, root=str(tmp_path), fmt=fmt, max_shard="30KB")[0]
    assert not (tmp_path / "epoch_0_step_1" / "model" / "consolidated").exists()  # "final" only
    step_dir = tmp_path / "epoch_0_step_2"
    _check_bundle(step_dir, out["logits"])
    n_files = len(list((step_dir / "model" / "consolidated").glob("model-*.safetensors")))
    assert n_files >= 3  # several files, so with 3 ranks each rank wrote some


def test_pipeline_generates_text_offline(tmp_path):
    from transformers import pipeline

    run_ranks(1, _train_and_save, root=str(tmp_path), fmt="safetensors", max_shard="5GB")
    bundle = tmp_path / "epoch_0_step_2" / "model" / "consolidated"
    assert [p.name for p in bundle.glob("model-*.safetensors")] == ["model-00001-of-00001.safetensors"]
    pipe = pipeline("text-generation", model=str(bundle), device="cpu")
    text = pipe("hello", max_new_tokens=8, do_sample=False)[0]["generated_text"]
    assert text.startswith("hello") and len(text) > len("hello")

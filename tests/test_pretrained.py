"""Starting from a Hugging Face folder: each rank reads its slices; weights equal from_pretrained's."""

from __future__ import annotations

import pytest
import torch

from distributed import run_ranks

PROMPT = torch.tensor([[3, 9, 27, 17, 51, 25, 11, 33]])


def _load(folder: str, meta: bool) -> dict:
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM

    from ckptio import load_pretrained
    from toy import full_state

    config = AutoConfig.from_pretrained(folder)
    if meta:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    else:
        torch.manual_seed(123)  # a different init: everything must come from the folder
        model = AutoModelForCausalLM.from_config(config)
    if dist.is_initialized():
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    load_pretrained(model, folder)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=PROMPT).logits
    return {"state": full_state(model), "logits": logits}


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    from toy import llama_config
    from transformers import LlamaForCausalLM

    torch.manual_seed(5)
    folder = tmp_path_factory.mktemp("hf") / "tiny-llama"
    # untied, and split over several files with an index, as large hub models are
    LlamaForCausalLM(llama_config(tie_word_embeddings=False)).save_pretrained(folder, max_shard_size="40KB")
    assert (folder / "model.safetensors.index.json").is_file()
    return folder


@pytest.mark.parametrize("world,meta", [(1, False), (1, True), pytest.param(2, False, marks=pytest.mark.slow),
                                        pytest.param(2, True, marks=pytest.mark.slow)])
def test_load_pretrained_matches_from_pretrained(hf_folder, world, meta):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(hf_folder)
    ref.eval()
    got = run_ranks(world, _load, folder=str(hf_folder), meta=meta)[0]
    ref_sd = ref.state_dict()
    assert {k[len("model/"):] for k in got["state"]} == set(ref_sd)
    for key, value in ref_sd.items():
        assert torch.equal(got["state"][f"model/{key}"], value), key
    with torch.no_grad():
        assert torch.equal(got["logits"], ref(input_ids=PROMPT).logits)


def test_missing_folder_and_wrong_model_are_clear(hf_folder, tmp_path):
    from toy import llama_config
    from transformers import LlamaForCausalLM

    from ckptio import CheckpointMismatchError, CheckpointNotFoundError, load_pretrained

    with pytest.raises(CheckpointNotFoundError, match="nope"):
        load_pretrained(LlamaForCausalLM(llama_config()), tmp_path / "nope")
    with pytest.raises(CheckpointMismatchError, match="hidden|shape|mismatch"):
        load_pretrained(LlamaForCausalLM(llama_config(tie_word_embeddings=False, intermediate_size=96)), hf_folder)

"""The model's state dict (``ckptio.state.model``): ties read at each save, wrappers that do not change the keys.

The oracle is the live model: every parameter it holds under its own (uncompiled) name is in the checkpoint, and a
restore puts each back, whatever happened to the model between the manager's construction and the save.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ckptio import CheckpointConfig, CheckpointManager
from ckptio.errors import CheckpointMismatchError
from toy import llama_config


def _llama(seed: int = 0):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config(num_hidden_layers=1, tie_word_embeddings=True))


def _untie(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    """What a user does to train the head apart from the embedding once the manager exists."""
    g = torch.Generator().manual_seed(seed)
    model.lm_head.weight = nn.Parameter(torch.randn(model.lm_head.weight.shape, generator=g))
    opt.add_param_group({"params": [model.lm_head.weight], "lr": 1e-3})


def _saved_keys(step_dir) -> set[str]:
    from safetensors import safe_open

    keys: set[str] = set()
    for f in (step_dir / "model").glob("*.safetensors"):
        with safe_open(str(f), "pt") as opened:
            keys.update(opened.keys())
    return keys


def _values(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_a_head_untied_after_the_manager_was_made_is_saved_and_restored(tmp_path) -> None:
    model = _llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with CheckpointManager(CheckpointConfig(checkpoint_dir=str(tmp_path)), model=model, optimizer=opt,
                           rng=False) as mgr:
        mgr.save(step=1)  # tied: lm_head.weight is the embedding, stored once
        _untie(model, opt, seed=5)
        path = mgr.save(step=2)
    assert "lm_head.weight" in _saved_keys(path)
    saved = _values(model)
    assert not torch.equal(saved["lm_head.weight"], saved["model.embed_tokens.weight"])

    fresh = _llama(seed=1)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    _untie(fresh, fresh_opt, seed=9)
    with CheckpointManager(CheckpointConfig(checkpoint_dir=str(tmp_path)), model=fresh, optimizer=fresh_opt,
                           rng=False) as mgr:
        mgr.restore(path)
    for k, v in saved.items():
        assert torch.equal(fresh.state_dict()[k], v), k

    # a model that still ties them cannot hold both: refused by name, not loaded with the head as the embedding
    tied = _llama(seed=1)
    with CheckpointManager(CheckpointConfig(checkpoint_dir=str(tmp_path)), model=tied, rng=False) as mgr:
        with pytest.raises(CheckpointMismatchError, match="lm_head.weight"):
            mgr.restore(path, states=["model"])


def test_a_tied_model_still_saves_its_tied_weight_once(tmp_path) -> None:
    model = _llama()
    with CheckpointManager(CheckpointConfig(checkpoint_dir=str(tmp_path)), model=model, rng=False) as mgr:
        path = mgr.save(step=1)
    assert "lm_head.weight" not in _saved_keys(path) and "model.embed_tokens.weight" in _saved_keys(path)
    fresh = _llama(seed=1)
    with CheckpointManager(CheckpointConfig(checkpoint_dir=str(tmp_path)), model=fresh, rng=False) as mgr:
        mgr.restore(path)
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight
    assert torch.equal(fresh.lm_head.weight, model.model.embed_tokens.weight)


@pytest.mark.parametrize("save_compiled,load_compiled", [(True, False), (True, True), (False, True)])
def test_a_compiled_model_saves_and_restores_under_its_uncompiled_keys(tmp_path, save_compiled: bool,
                                                                       load_compiled: bool) -> None:
    model = _llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(input_ids=torch.arange(8)[None], labels=torch.arange(8)[None]).loss.backward()
    opt.step()
    live = torch.compile(model, backend="eager") if save_compiled else model
    with CheckpointManager(CheckpointConfig(checkpoint_dir=str(tmp_path), async_save=True), model=live,
                           optimizer=opt, rng=False) as mgr:
        path = mgr.save(step=1)
    keys = _saved_keys(path)
    assert keys == set(model.state_dict()) - {"lm_head.weight"}  # no _orig_mod. prefix, the tie stored once
    fresh = _llama(seed=1)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    target = torch.compile(fresh, backend="eager") if load_compiled else fresh
    with CheckpointManager(CheckpointConfig(checkpoint_dir=str(tmp_path)), model=target, optimizer=fresh_opt,
                           rng=False) as mgr:
        mgr.restore(path)
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k
    for p, q in zip(opt.param_groups[0]["params"], fresh_opt.param_groups[0]["params"]):
        assert torch.equal(opt.state[p]["exp_avg"], fresh_opt.state[q]["exp_avg"])

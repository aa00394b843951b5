"""Pipeline stages: every stage's tensors reach the disk, and the checkpoint restores on other layouts.

Each rank holds one stage of the tiny Llama, as ``torch.distributed.pipelining`` stages are built: the
model with the modules of other stages removed (replaced by parameter-less modules, so the original
parameter names are kept). A save must write every stage's weights and optimizer state (before the fix
only the first stage's tensors reached the disk while the save reported success), and the checkpoint
must restore bitwise on the same layout, on one rank with the whole model, and back onto two stages.
"""

from __future__ import annotations

import pytest
import torch

from distributed import run_ranks
from layouts import LAYERS, keep_stage

pytestmark = pytest.mark.slow  # multi-process: left out of the quick loop (-m 'not slow')

FORMATS = ("safetensors", "torch_save")


def _build(seed: int, stages: int, stage: int):
    from transformers import LlamaForCausalLM

    from toy import llama_config

    torch.manual_seed(seed)
    model = LlamaForCausalLM(llama_config(num_hidden_layers=LAYERS, tie_word_embeddings=False, attention_dropout=0.0))
    if stages > 1:
        keep_stage(model, stage, stages)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    return model, opt


def _state(model, opt) -> dict[str, torch.Tensor]:
    names = {id(p): n for n, p in model.named_parameters()}
    out = {f"model/{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for p, st in opt.state.items():
        for k, v in st.items():
            out[f"optim/{names[id(p)]}/{k}"] = v.detach().clone()
    return out


def _save(root: str, fmt: str, stages: int) -> dict:
    import torch.distributed as dist

    from ckptio import CheckpointConfig, CheckpointManager

    stage = dist.get_rank() if stages > 1 else 0
    model, opt = _build(0, stages, stage)
    g = torch.Generator().manual_seed(stage)
    for p in model.parameters():  # one step with made-up gradients: optimizer state exists everywhere
        p.grad = torch.randn(p.shape, generator=g) * 1e-2
    opt.step()
    with CheckpointManager(CheckpointConfig(checkpoint_dir=root, model_save_format=fmt), model=model,
                           optimizer=opt, rng=False) as mgr:
        mgr.save(step=1)
    return _state(model, opt)


def _load(root: str, fmt: str, stages: int) -> dict:
    import torch.distributed as dist

    from ckptio import CheckpointConfig, CheckpointManager

    stage = dist.get_rank() if stages > 1 else 0
    model, opt = _build(1, stages, stage)  # another init: everything must come from disk
    with CheckpointManager(CheckpointConfig(checkpoint_dir=root, model_save_format=fmt), model=model,
                           optimizer=opt, rng=False) as mgr:
        assert mgr.restore() is not None
    return _state(model, opt)


def _union(parts: list[dict]) -> dict:
    out: dict = {}
    for part in parts:
        out.update(part)
    return out


def _same(a: dict, b: dict, where: str) -> None:
    assert a.keys() == b.keys(), f"{where}: keys differ: {sorted(set(a) ^ set(b))[:5]}"
    assert len([k for k in a if k.startswith("optim/")]) > 20
    for k in a:
        assert torch.equal(a[k], b[k]), f"{where}: {k} differs"


@pytest.mark.parametrize("fmt", FORMATS)
def test_pipeline_stages_save_everything_and_restore_on_other_layouts(tmp_path, fmt):
    pp = str(tmp_path / "pp2")
    saved = _union(run_ranks(2, _save, root=pp, fmt=fmt, stages=2))
    from ckptio.engine.manifest import read_manifest

    manifest = read_manifest(next(p for p in (tmp_path / "pp2").iterdir() if p.name.startswith("epoch")))
    full_keys = {k.removeprefix("model/") for k in saved if k.startswith("model/")}
    assert set(manifest.model_signature["shapes"]) == full_keys, "the manifest must describe every stage"
    # same layout
    _same(saved, _union(run_ranks(2, _load, root=pp, fmt=fmt, stages=2)), "PP 2 -> PP 2")
    # PP 2 -> one rank with the whole model
    _same(saved, run_ranks(1, _load, root=pp, fmt=fmt, stages=1)[0], "PP 2 -> 1")
    # one rank -> PP 2
    one = str(tmp_path / "one")
    saved_one = run_ranks(1, _save, root=one, fmt=fmt, stages=1)[0]
    _same(saved_one, _union(run_ranks(2, _load, root=one, fmt=fmt, stages=2)), "1 -> PP 2")

"""Within one read of a Megatron checkpoint, each pickle is walked by the gate once (:mod:`ckptio.storage.read_scope`).

The walk costs several times the load it guards; the readers open a legacy rank file for the run's arguments (its
layout), then for its weights, and a torch_dist ``.metadata`` once per Adam moment. ``parse.walked`` counts the walks
the gate really ran, by the name it gave each pickle."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from ckptio.convert.formats import convert
from ckptio.formats.megatron.format import MegatronFormat, MegatronSource, read_legacy
from ckptio.storage import parse


def _step_dir(root: Path) -> Path:
    """A ckptio checkpoint of a tiny Llama after one AdamW step."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from ckptio import CheckpointConfig, CheckpointManager

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 64, (2, 8))
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    with CheckpointManager(CheckpointConfig(checkpoint_dir=str(root)), model=model, optimizer=opt, rng=False) as mgr:
        mgr.save(step=1)
    return next(p for p in root.iterdir() if p.name.startswith("epoch"))


@pytest.fixture(scope="module")
def step(tmp_path_factory) -> Path:
    return _step_dir(tmp_path_factory.mktemp("one_walk") / "ck")


def _walks(read) -> Counter:
    before = Counter(parse.walked)
    read()
    return parse.walked - before


def test_a_legacy_rank_file_read_for_its_layout_and_its_weights_is_walked_once(step, tmp_path):
    out = convert(step, tmp_path / "megatron", "megatron", options={"pp": 2, "layout": "legacy"})
    walks = _walks(lambda: read_legacy(out / "iter_0000001"))
    first = [w for w in walks if "mp_rank_00_000/model_optim_rng.pt" in w]
    assert first, walks  # the rank file's pickle is walked (not one of the small ones the gate knows by heart)
    assert max(walks.values()) == 1, walks
    walks = _walks(lambda: MegatronSource(out))
    assert walks and max(walks.values()) == 1, walks


def test_a_torch_dist_metadata_is_walked_once_for_both_moments(step, tmp_path):
    out = convert(step, tmp_path / "megatron", "megatron", options={"tp": 2})
    assert (out / "iter_0000001" / ".metadata").is_file()
    walks = _walks(lambda: MegatronFormat().open_adam(out))
    metadata = [w for w in walks if w.endswith(".metadata")]
    assert metadata, walks
    assert max(walks.values()) == 1, walks


def test_nothing_is_remembered_between_reads(step, tmp_path):
    out = convert(step, tmp_path / "megatron", "megatron", options={"tp": 2})
    MegatronFormat().open_adam(out)
    walks = _walks(lambda: MegatronFormat().open_adam(out))
    assert [w for w in walks if w.endswith(".metadata")], walks  # a new read walks the file again

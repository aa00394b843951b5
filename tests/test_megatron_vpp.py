"""Virtual pipeline stages (``--virtual-pipeline-model-parallel-size``), with the real megatron-core package.

``megatron_fixture.py --vpp 2`` builds the tiny GPT as megatron-core does on PP=2 x VPP=2 (four model chunks of one
layer each: stage 0 holds layers 0 and 2, stage 1 layers 1 and 3), takes one Adam step and saves both layouts:
torch_dist (global layer numbers, the same files as without chunks) and Megatron-LM's legacy rank files with
``model0``/``model1`` entries, each numbered from 0. In: both convert to a model with Megatron's logits, and the
moments land on their elements. Out: ``--vpp 2`` exports that megatron-core loads strictly (torch_dist through
``dist_checkpointing.load``, legacy chunk by chunk) with the same logits, and legacy rank files equal to Megatron's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ckptio.convert.formats import convert
from fixture_cache import built
from megatron_shared import check_fixture_adam, restore_with_adam, run_fixture

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.slow  # multi-process megatron-core runs


@pytest.fixture(scope="module")
def made() -> Path:
    return built("megatron_fixture.py", "--tp", "1", "--pp", "2", "--vpp", "2")


@pytest.fixture(scope="module")
def hf(made, tmp_path_factory) -> Path:
    return convert(made / "legacy", tmp_path_factory.mktemp("vpp_hf") / "hf", "hf")


def _logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(folder).eval()(ids).logits


@pytest.mark.parametrize("layout", ["torch_dist", "legacy"])
def test_virtual_pipeline_checkpoints_convert_to_a_model_with_megatrons_logits(made, tmp_path, layout):
    ref = torch.load(made / "reference.pt")
    got = _logits(convert(made / layout, tmp_path / "hf", "hf"), ref["input_ids"])
    assert torch.allclose(got, ref["logits"], atol=1e-5, rtol=0), (got - ref["logits"]).abs().max()


def test_both_layouts_of_a_virtual_pipeline_run_hold_the_same_model(made):
    from ckptio.formats.megatron.format import MegatronSource

    dist, legacy = MegatronSource(made / "torch_dist"), MegatronSource(made / "legacy")
    assert dist.index() == legacy.index() and legacy.info["layers"] == 4
    for key in dist.index():
        assert torch.equal(dist.read(key), legacy.read(key)), key


def test_virtual_pipeline_moments_reach_their_elements(made, hf):
    """One Adam step (lr 1e-3, betas 0.9/0.95) with g = 0.5 w0 + 0.25: exp_avg = 0.1 g, exp_avg_sq = 0.05 g^2 and
    w = 2 g - 0.5 - 1e-3 sign(g) on every element, for layers of every chunk."""
    from distributed import run_ranks

    got = run_ranks(1, restore_with_adam, source=str(made / "torch_dist"), config=str(hf))[0]
    check_fixture_adam(got)


@pytest.mark.parametrize("layout", ["dist", "legacy"])
def test_megatron_core_loads_a_virtual_pipeline_export_strictly(made, hf, tmp_path, layout):
    ref = torch.load(made / "reference.pt")
    out = convert(hf, tmp_path / "export", "megatron", options={"tp": 1, "pp": 2, "vpp": 2, "layout": layout})
    run_fixture("--tp", "1", "--pp", "2", "--vpp", "2", "--load", str(out / "iter_0000000"),
              "--out", str(tmp_path / "logits.pt"))
    got = torch.load(tmp_path / "logits.pt")
    assert torch.allclose(got["logits"], ref["logits"], atol=1e-5, rtol=0), (got["logits"] - ref["logits"]).abs().max()


def test_a_virtual_pipeline_round_trip_is_bitwise(made, hf, tmp_path):
    """Megatron's legacy VPP files -> HF -> ckptio's legacy export at PP=2 VPP=2: every rank file holds Megatron's
    chunks, tensor for tensor under the same names; and that export reads back as Megatron's model, bitwise."""
    from ckptio.formats import safe_pickle as megatron_pickle
    from ckptio.storage.confined import Folder

    out = convert(hf, tmp_path / "export", "megatron", options={"pp": 2, "vpp": 2, "layout": "legacy"})
    theirs_root, ours_root = Folder(made / "legacy" / "iter_0000002"), Folder(out / "iter_0000000")
    for rank in ("mp_rank_00_000", "mp_rank_00_001"):
        theirs, _ = megatron_pickle.load(theirs_root, f"{rank}/model_optim_rng.pt", max_size=1 << 30)
        ours, _ = megatron_pickle.load(ours_root, f"{rank}/model_optim_rng.pt", max_size=1 << 30)
        assert [k for k in ours if k.startswith("model")] == ["model0", "model1"]
        assert ours["args"].virtual_pipeline_model_parallel_size == 2
        for chunk in ("model0", "model1"):
            assert set(theirs[chunk]) == set(ours[chunk]), (rank, chunk, sorted(set(theirs[chunk]) ^ set(ours[chunk])))
            for k, v in theirs[chunk].items():
                if isinstance(v, torch.Tensor):
                    assert torch.equal(v, ours[chunk][k]), f"{rank} {chunk}: {k}"
    from ckptio.formats.megatron.format import MegatronSource

    back, there = MegatronSource(out), MegatronSource(made / "legacy")
    assert back.index() == there.index()
    for key in there.index():
        assert torch.equal(back.read(key), there.read(key)), key


def test_virtual_pipeline_stages_that_do_not_divide_the_layers_are_refused(hf, tmp_path):
    from ckptio.errors import ConfigError

    with pytest.raises(ConfigError, match="virtual"):
        convert(hf, tmp_path / "a", "megatron", options={"pp": 2, "vpp": 4})
    with pytest.raises(ConfigError, match="--vpp needs --pp"):
        convert(hf, tmp_path / "b", "megatron", options={"vpp": 2})


def test_damaged_chunk_tensors_and_args_are_refused_by_name(made, tmp_path):
    """Found by the megatron_vpp fuzz family: a tensor with fewer dimensions than its TP split, and args saved as a
    string, were an IndexError and a TypeError; they are CheckpointCorruptError naming the rank file."""
    import shutil

    from ckptio.errors import CheckpointCorruptError
    from ckptio.formats.megatron.format import MegatronSource

    for name, change in (("flat", lambda o: o["model1"].__setitem__("decoder.layers.0.mlp.linear_fc2.weight",
                                                                     torch.zeros(8))),
                         ("args", lambda o: o.__setitem__("args", "x"))):
        run = tmp_path / name
        shutil.copytree(made / "legacy", run)
        rank = run / "iter_0000002" / ("mp_rank_00_001" if name == "flat" else "mp_rank_00_000") / "model_optim_rng.pt"
        obj = torch.load(rank, weights_only=False)
        change(obj)
        torch.save(obj, rank)
        with pytest.raises(CheckpointCorruptError, match="mp_rank_00_00"):
            MegatronSource(run)


@pytest.mark.slow
def test_fuzz_family_smoke():
    """A CI-sized run of the megatron_vpp fuzz family (legacy rank files with model chunks and the distributed
    optimizer's distrib_optim.pt, written by megatron-core):
    every damaged folder ends in a right read or a ckptio error."""
    from megatron_shared import fuzz_smoke

    fuzz_smoke("megatron_vpp", 60)

"""Megatron's distributed optimizer saved as torch_dist, against megatron-core 0.16.1.

``megatron_fixture.py --dp 2 --dist-formats ...`` has megatron-core train three steps on TP=2 x DP=2 gloo ranks with
its ``DistributedOptimizer`` and save, as Megatron-LM's torch_dist save does, ``{"model": ..., "optimizer":
optimizer.sharded_state_dict(..., metadata={"distrib_optim_sharding_type": FORMAT})}`` through
``dist_checkpointing.save``. ``fully_reshardable`` (Megatron-LM's ``--dist-ckpt-optim-fully-reshardable``) keys
Adam's state like the model (``optimizer.state.exp_avg.<model key>``) and the step in the parameter groups of
``common.pt``: read, it is Megatron's own fp32 state (``reference_adam.pt``, from the optimizer's bookkeeping)
bitwise, and a plain model with AdamW resumes with it. ``dp_reshardable`` (Megatron-LM's default) keeps each
data-parallel group's flat buckets: refused by name when Adam's state is asked for, its weights still read.
(``fully_sharded_model_space``, megatron-core's own default, cannot be saved by 0.16.1: "ShardedTensor.
flattened_range is not supported".)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ckptio.convert.formats import convert
from ckptio.errors import CheckpointError
from fixture_cache import built
from megatron_shared import restore_with_adam

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.slow  # multi-process megatron-core runs


@pytest.fixture(scope="module")
def made() -> Path:
    return built("megatron_fixture.py", "--tp", "2", "--dp", "2", "--iteration", "3", "--hidden", "48",
                 "--dist-formats", "fully_reshardable,dp_reshardable")


def _reference(made: Path) -> tuple[float, dict[str, dict[str, torch.Tensor]]]:
    from ckptio.formats.megatron.layout import _LAYER, _RENAME

    ref = torch.load(made / "reference_adam.pt")
    out = {}
    for name, state in ref["state"].items():
        m = _LAYER.match(name)
        out[f"decoder.layers.{m.group(1)}.{_RENAME.get(m.group(2), m.group(2))}" if m else name] = state
    return ref["step"], out


def test_fully_reshardable_state_is_megatrons_own_bitwise(made):
    from ckptio.formats.megatron.format import MegatronSource

    step, ref = _reference(made)
    folder = made / "torch_dist_fully_reshardable"
    weights = MegatronSource(folder)
    assert weights.info["optimizer_step"] == step == 3.0
    assert set(weights.index()) == set(ref)
    for moment in ("exp_avg", "exp_avg_sq", "param"):
        source = MegatronSource(folder, prefix=f"optimizer.state.{moment}.")
        assert set(source.index()) == set(ref)
        for name, state in ref.items():
            got = source.read(name)
            assert got.dtype == torch.float32 and torch.equal(got, state[moment]), f"{moment} of {name}"


def test_a_plain_model_resumes_with_the_distributed_optimizers_moments(made, tmp_path):
    from distributed import run_ranks

    from ckptio.formats.megatron.format import MegatronFormat

    folder = made / "torch_dist_fully_reshardable"
    hf = convert(folder, tmp_path / "hf", "hf")
    step, moments = MegatronFormat().open_adam(folder)
    got = run_ranks(1, restore_with_adam, source=str(folder), config=str(hf))[0]
    assert bool((got.pop("steps") == step).all()) and step == 3.0
    for moment, source in moments.items():
        for name in source.index():
            assert torch.equal(got[f"optim/state.{name}.{moment}"], source.read(name)), (moment, name)


def test_the_bucketed_dp_reshardable_format_is_refused_by_name_and_its_weights_still_read(made):
    from ckptio.formats.megatron.format import MegatronFormat, MegatronSource

    folder = made / "torch_dist_dp_reshardable"
    with pytest.raises(CheckpointError, match="dp_reshardable"):
        MegatronFormat().open_adam(folder)
    ours, theirs = MegatronSource(folder), MegatronSource(made / "torch_dist_fully_reshardable")
    assert ours.index() == theirs.index()
    assert all(torch.equal(ours.read(k), theirs.read(k)) for k in ours.index())


@pytest.mark.slow
def test_fuzz_family_smoke():
    """A CI-sized run of the megatron_dist_distopt fuzz family (the DistributedOptimizer's torch_dist, written by
    megatron-core): every damaged folder ends in a right read or a ckptio error."""
    from megatron_shared import fuzz_smoke

    fuzz_smoke("megatron_dist_distopt", 60)

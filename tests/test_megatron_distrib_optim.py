"""Megatron's distributed optimizer in the legacy layout (``mp_rank_TT/distrib_optim.pt``), against megatron-core.

``megatron_fixture.py --dp 2`` has megatron-core train a tiny GPT three steps on TP=2 x DP=2 gloo ranks with its
``DistributedDataParallel`` and ``DistributedOptimizer`` (also Qwen2, and TP=1 x PP=2 x DP=2 with tied
embeddings; hidden size 48, so that the norms' 48 elements leave
padding in the 64-element aligned buffer; a bucket size that closes a bucket after a norm), and save it as
Megatron-LM does: ``model_optim_rng.pt`` and the optimizer's own ``save_parameter_state`` into
``distrib_optim.pt``. Beside it, ``reference_adam.pt`` holds Megatron's own fp32 state of every parameter,
taken from the optimizer's bookkeeping (each DP rank's owned range, gathered), not from the flat files.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from ckptio.errors import CheckpointCorruptError, CheckpointError
from fixture_cache import built
from megatron_shared import restore_with_adam

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.slow  # multi-process megatron-core runs

FIXTURE = Path(__file__).with_name("megatron_fixture.py")
ITER = "iter_0000003"
# legacy (local spec) names -> the canonical names ckptio reads them under
_CANONICAL = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
              "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}


def _train(family: str, *layout: str) -> Path:
    """The run (shared, read-only: ``fixture_cache.built``; the megatron_distopt fuzz family's is the llama one)."""
    layout = layout or ("--tp", "2")
    return built(FIXTURE.name, *layout, "--dp", "2", "--iteration", "3", "--hidden", "48", "--bucket", "6192",
                 "--family", family)


@pytest.fixture(scope="module")
def made() -> Path:
    return _train("llama")


@pytest.fixture(scope="module")
def made_qwen2() -> Path:
    """The same run with Qwen2's biases on the query/key/value projection (48 elements per rank: padded too)."""
    return _train("qwen2")


@pytest.fixture(scope="module")
def made_pp2_tied() -> Path:
    """Two pipeline stages (the second keeps one bucket whatever the bucket size) and tied embeddings (the last
    stage holds a copy of the embedding, in a bucket of its own): TP=1 x PP=2 x DP=2."""
    return _train("llama", "--tp", "1", "--pp", "2", "--tied")


@pytest.fixture(scope="module")
def made_bf16() -> Path:
    """Megatron-LM's --bf16: the weights in bf16, the optimizer's master copies and moments in fp32."""
    return _train("llama", "--tp", "2", "--bf16")


def _run_of(request, family: str) -> Path:
    return request.getfixturevalue({"llama": "made", "qwen2": "made_qwen2", "pp2_tied": "made_pp2_tied",
                                    "bf16": "made_bf16"}[family])


def _canonical(name: str) -> str:
    for old, new in _CANONICAL.items():
        name = name.replace(old, new)
    return name


def _reference(made: Path) -> tuple[float, dict[str, dict[str, torch.Tensor]]]:
    ref = torch.load(made / "reference_adam.pt")
    return ref["step"], {_canonical(k): v for k, v in ref["state"].items()}


@pytest.mark.parametrize("family", ["llama", "qwen2", "pp2_tied", "bf16"])
def test_the_flat_buffers_give_megatrons_own_state_of_every_parameter_bitwise(request, family):
    from ckptio.formats.megatron.format import read_legacy

    made = _run_of(request, family)
    step, ref = _reference(made)
    assert any(k.endswith("linear_qkv.bias") for k in ref) == (family == "qwen2")
    model, info = read_legacy(made / "legacy" / ITER, optimizer=True)
    assert info["optimizer_step"] == step == 3.0
    assert set(info["optimizer"]) == {"param", "exp_avg", "exp_avg_sq"}
    copy = {"output_layer.weight"} if family == "pp2_tied" else set()  # the tied embedding's copy: not a weight
    assert set(info["optimizer"]["exp_avg"]) == set(model) == set(ref) | copy
    for name, state in ref.items():
        for key, want in state.items():
            got = info["optimizer"][key][name][: want.shape[0]]  # the vocabulary padding rows are cut in ref
            assert got.dtype == want.dtype == torch.float32 and torch.equal(got, want), f"{key} of {name}"
        assert model[name].dtype == (torch.bfloat16 if family == "bf16" else torch.float32)


def test_without_distributed_optimizer_files_there_is_no_adam_state(made, tmp_path):
    from ckptio.formats.megatron.format import MegatronFormat

    bare = tmp_path / "bare"
    shutil.copytree(made / "legacy", bare)
    for f in bare.glob(f"{ITER}/mp_rank_*/distrib_optim.pt"):
        f.unlink()
    assert MegatronFormat().open_adam(bare) is None


# ------------------------------------------------------------------------------------------------ refusals
def _copy(made: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(made / "legacy", dst)
    return dst


def _rewrite(path: Path, change) -> None:
    """Load one of the fixture's own torch.save files, change it, save it back (a damaged or odd checkpoint)."""
    obj = torch.load(path, weights_only=False)
    obj = change(obj) or obj
    torch.save(obj, path)


def _buffer(obj):
    return next(iter(obj[0].values()))


def _read(folder: Path):
    from ckptio.formats.megatron.format import MegatronFormat

    return MegatronFormat().open_adam(folder)


def test_a_rank_folder_without_its_distrib_optim_is_refused_by_name(made, tmp_path):
    run = _copy(made, tmp_path)
    (run / ITER / "mp_rank_01" / "distrib_optim.pt").unlink()
    with pytest.raises(CheckpointCorruptError, match=r"mp_rank_01.*no distrib_optim\.pt"):
        _read(run)


def test_a_missing_data_parallel_shard_is_refused_by_name(made, tmp_path):
    run = _copy(made, tmp_path)

    def cut(obj):
        buf = _buffer(obj)
        buf["exp_avg"] = buf["exp_avg"][: buf["exp_avg"].numel() // 2].clone()  # DP rank 1's half lost

    _rewrite(run / ITER / "mp_rank_00" / "distrib_optim.pt", cut)
    with pytest.raises(CheckpointCorruptError, match=r"mp_rank_00/distrib_optim\.pt: exp_avg is \[\d+\].*data-parallel"):
        _read(run)


def test_numel_unpadded_other_than_the_layout_is_refused(made, tmp_path):
    run = _copy(made, tmp_path)
    _rewrite(run / ITER / "mp_rank_01" / "distrib_optim.pt",
             lambda obj: _buffer(obj).update(numel_unpadded=_buffer(obj)["numel_unpadded"] + 128))
    with pytest.raises(CheckpointCorruptError, match=r"mp_rank_01/distrib_optim\.pt: numel_unpadded is \d+"):
        _read(run)


def test_values_in_the_padding_are_refused(made, tmp_path):
    from ckptio.formats.megatron.distrib_optim import flat_layout

    run = _copy(made, tmp_path)
    model = torch.load(run / ITER / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)["model"]
    params = [(k, v.numel()) for k, v in model.items() if isinstance(v, torch.Tensor)]
    _, _, gaps = flat_layout(params, size=6192)
    assert gaps, "the fixture's layout has padding between parameters"
    _rewrite(run / ITER / "mp_rank_00" / "distrib_optim.pt",
             lambda obj: _buffer(obj)["exp_avg_sq"].__setitem__(gaps[0][0], 1.0))
    with pytest.raises(CheckpointCorruptError, match=r"exp_avg_sq holds values in the padding"):
        _read(run)


def test_a_bucket_size_other_than_the_runs_is_refused_not_misread(made, tmp_path):
    """The run's arguments say how the buffer was bucketed; with other ones every parameter after the first
    bucket would be shifted: the fp32 master copies no longer match the weights, which is refused."""
    run = _copy(made, tmp_path)
    for rank in ("mp_rank_00", "mp_rank_01"):
        _rewrite(run / ITER / rank / "model_optim_rng.pt", lambda obj: setattr(obj["args"], "ddp_bucket_size", None))
    with pytest.raises(CheckpointCorruptError, match=r"(numel_unpadded|master copy of) .*bucket size"):
        _read(run)


def test_the_format_before_coalesced_buckets_and_chained_optimizers_are_refused_by_name(made, tmp_path):
    run = _copy(made, tmp_path)
    _rewrite(run / ITER / "mp_rank_00" / "distrib_optim.pt", lambda obj: obj.pop("buckets_coalesced"))
    with pytest.raises(CheckpointError, match=r"buckets_coalesced.*ckpt-convert-update-legacy-dist-opt-format"):
        _read(run)
    run = _copy(made, tmp_path / "b")
    _rewrite(run / ITER / "mp_rank_00" / "distrib_optim.pt", lambda obj: [obj, obj])
    with pytest.raises(CheckpointError, match=r"2 chained optimizers"):
        _read(run)


def test_ranks_that_disagree_on_the_step_are_refused(made, tmp_path):
    run = _copy(made, tmp_path)

    def bump(obj):
        for group in obj["optimizer"]["optimizer"]["param_groups"]:
            group["step"] = 4.0

    _rewrite(run / ITER / "mp_rank_01" / "model_optim_rng.pt", bump)
    with pytest.raises(CheckpointCorruptError, match=r"mp_rank_01/model_optim_rng\.pt: the optimizer's step is 4"):
        _read(run)


# ------------------------------------------------------------------------------------------------ resume
class _Reference:
    """Megatron's own state (one of param / exp_avg / exp_avg_sq) as a tensor source under canonical names."""

    def __init__(self, state: dict[str, dict[str, torch.Tensor]], key: str, folder: Path) -> None:
        self.tensors, self.folder = {name: s[key] for name, s in state.items()}, folder

    def index(self):
        from ckptio.formats.common import TensorInfo

        return {k: TensorInfo(tuple(v.shape), "float32") for k, v in self.tensors.items()}

    def read(self, key: str) -> torch.Tensor:
        return self.tensors[key]


def _expected(made: Path, hf: Path) -> dict[str, torch.Tensor]:
    """Megatron's own fp32 state under the Hugging Face names ``full_state`` gives (``model/...``, ``optim/...``)."""
    import json

    from ckptio.formats.naming import _RenamedSource, get_converter

    _, ref = _reference(made)
    config = json.loads((hf / "config.json").read_text())
    out = {}
    for key, prefix in (("param", "model/{}"), ("exp_avg", "optim/state.{}.exp_avg"),
                        ("exp_avg_sq", "optim/state.{}.exp_avg_sq")):
        source = _RenamedSource(_Reference(ref, key, hf), get_converter("megatron-to-llama"), config)
        out.update({prefix.format(name): source.read(name) for name in source.index()})
    return out




@pytest.mark.parametrize("family,world", [("llama", 1), ("llama", 2), ("qwen2", 1), ("pp2_tied", 1), ("bf16", 1),
                                          ("bf16", 2)])
def test_a_plain_model_and_adamw_resume_with_megatrons_fp32_state_bitwise(request, tmp_path, family, world):
    """On 1 rank, and under FSDP2 on 2: the weights are Megatron's fp32 master copies, the moments Megatron's
    own, bitwise, and every parameter's step is the 3 Megatron took. A bf16 run resumes into an fp32 model from
    its fp32 master copies, not from its bf16 weights."""
    from ckptio.convert.formats import convert
    from distributed import run_ranks

    made = _run_of(request, family)

    hf = convert(made / "legacy", tmp_path / "hf", "hf")
    got = run_ranks(world, restore_with_adam, source=str(made / "legacy"), config=str(hf))[0]
    steps = got.pop("steps")
    assert bool((steps == 3).all()), steps
    assert {v.item() for k, v in got.items() if k.endswith(".step")} == {3.0}
    got = {k: v for k, v in got.items() if not k.endswith(".step")}
    want = _expected(made, hf)
    if family == "pp2_tied":  # the tied model's state dict names the one tensor twice
        want["model/lm_head.weight"] = want["model/model.embed_tokens.weight"]
    assert set(got) == set(want), sorted(set(got) ^ set(want))[:6]
    for key, value in want.items():
        assert got[key].dtype == torch.float32 and torch.equal(got[key], value), key


def test_fuzz_family_smoke():
    """A CI-sized run of the distrib_optim.pt fuzz family (the long run: ``fuzz_readers.py --family
    megatron_distopt --inputs 100000``): every damaged folder ends in a right read or a ckptio error."""
    from megatron_shared import fuzz_smoke

    fuzz_smoke("megatron_distopt", 80)


def test_rank_files_found_bad_by_the_fuzzer_are_refused_by_name(made, tmp_path):
    """Two inputs of the fuzz family, which the weights' reader met too: a model entry keyed by something else than a string, and a rank file that is
    a 1 TiB sparse file (read whole before: a MemoryError; now only its zip directory is looked at)."""
    from ckptio.formats.megatron.format import MegatronSource

    run = _copy(made, tmp_path)
    _rewrite(run / ITER / "mp_rank_00" / "model_optim_rng.pt", lambda obj: obj["model"].update({None: 1}))
    with pytest.raises(CheckpointCorruptError, match=r"mp_rank_00/model_optim_rng\.pt: model entries named 'None'"):
        MegatronSource(run)
    run = _copy(made, tmp_path / "b")
    with open(run / ITER / "mp_rank_01" / "model_optim_rng.pt", "wb") as fh:
        fh.truncate(1 << 40)
    with pytest.raises(CheckpointCorruptError, match=r"mp_rank_01/model_optim_rng\.pt: not a torch\.save archive"):
        MegatronSource(run)


def test_a_missing_tensor_parallel_rank_folder_is_refused_not_read_as_a_smaller_run(made, tmp_path):
    """A fuzz input: the last TP rank's folder gone. The folders then look like TP=1 while the shards are TP=2."""
    from ckptio.formats.megatron.format import MegatronSource

    run = _copy(made, tmp_path)
    shutil.rmtree(run / ITER / "mp_rank_01")
    with pytest.raises(CheckpointCorruptError, match=r"tensor_model_parallel_size is 2, but its rank folders are for 1"):
        MegatronSource(run)
    with pytest.raises(CheckpointCorruptError, match=r"tensor_model_parallel_size is 2"):
        _read(run)

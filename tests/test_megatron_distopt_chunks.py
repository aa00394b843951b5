"""The distributed optimizer's legacy ``distrib_optim.pt`` with several gradient buffers per rank, against megatron-core.

``megatron_distopt_chunks.py`` has megatron-core 0.16.1 train two steps with its ``DistributedDataParallel`` and
``get_megatron_optimizer`` and save as Megatron-LM's legacy save does:

* virtual pipeline stages (PP=2 x VPP=2 x DP=2, a bucket size that splits chunk 0 of the first stage): one gradient
  buffer per model chunk, ``distrib_optim.pt`` keyed 0, 1... in chunk order, buckets only in the first chunk;
* expert parallelism (a Mixtral, EP=2 over DP=2): a list of the two chained optimizers' states, the dense one's
  (written where its DP rank is 0: EP rank 0's folder, ``None`` in the others) and each EP rank's expert buffer
  (its expert data-parallel group);
* both (a Mixtral at PP=2 x VPP=2 x EP=2 on four ranks): ``mp_rank_00_PPP_EEE`` files with ``model0``/``model1``,
  each optimizer one buffer per chunk; saved in torch_dist too, as Megatron-LM does today (``fully_reshardable``,
  the chained optimizers' tensors keyed like one's) and without ``chained_optim_avoid_prefix`` (megatron-core's
  default: the tensors under ``chained_0.``/``chained_1.``);
* the same with a Qwen2-MoE (a gated shared expert, q/k/v biases) and a Qwen3-MoE (q/k norms), legacy and torch_dist.

Read, every parameter's fp32 master copy and Adam moments are Megatron's own (``reference_adam.pt``, from the
optimizers' bookkeeping) bitwise, and a plain Hugging Face model with AdamW resumes with them; the Mixtral, Qwen2-MoE
and Qwen3-MoE of the VPP x EP runs give Megatron's logits (``reference.pt``) from every layout.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from ckptio.errors import CheckpointCorruptError, CheckpointError
from fixture_cache import built

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.slow  # multi-process megatron-core runs

FIXTURE = Path(__file__).with_name("megatron_distopt_chunks.py")
ITER = "iter_0000002"
_CANONICAL = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
              "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}
RUNS = {"vpp": ("--pp", "2", "--vpp", "2", "--bucket", "6192"), "ep": ("--family", "mixtral", "--ep", "2"),
        "vppep": ("--family", "mixtral", "--pp", "2", "--vpp", "2", "--ep", "2", "--dist"),
        **{family: ("--family", family, "--pp", "2", "--vpp", "2", "--ep", "2", "--dist")
           for family in ("qwen2moe", "qwen3moe")}}
SOURCES = [(run, "legacy") for run in RUNS] + [("vppep", "torch_dist"), ("vppep", "torch_dist_chained"),
                                               ("qwen2moe", "torch_dist"), ("qwen3moe", "torch_dist")]
KINDS = {"vppep": "MixtralForCausalLM", "qwen2moe": "Qwen2MoeForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM"}
"""The Hugging Face class each run of virtual pipeline stages with experts converts to."""
NAMINGS = {"vpp": "megatron-to-llama", "qwen2moe": "megatron-to-qwen2moe", "qwen3moe": "megatron-to-qwen2moe"}


@pytest.fixture(scope="module")
def made() -> dict[str, Path]:
    return {name: built(FIXTURE.name, *layout, "--dp", "2") for name, layout in RUNS.items()}


def _reference(run: Path) -> tuple[float, dict[str, dict[str, torch.Tensor]]]:
    ref = torch.load(run / "reference_adam.pt")
    out = {}
    for name, state in ref["state"].items():
        for old, new in _CANONICAL.items():
            name = name.replace(old, new)
        out[name] = state
    return ref["step"], out


@pytest.mark.parametrize("run", list(RUNS))
def test_every_buffer_gives_megatrons_own_state_of_every_parameter_bitwise(made, run):
    from ckptio.formats.megatron.format import read_legacy

    step, ref = _reference(made[run])
    assert any(".mlp.experts." in k for k in ref) == (run != "vpp")
    model, info = read_legacy(made[run] / "legacy" / ITER, optimizer=True)
    assert info["optimizer_step"] == step == 2.0
    assert set(info["optimizer"]["exp_avg"]) == set(model) == set(ref)
    for name, state in ref.items():
        for key, want in state.items():
            got = info["optimizer"][key][name][: want.shape[0]]  # the vocabulary padding rows are cut in ref
            assert got.dtype == want.dtype == torch.float32 and torch.equal(got, want), f"{key} of {name}"


class _Reference:
    """Megatron's own state (one of param / exp_avg / exp_avg_sq) as a tensor source under canonical names."""

    def __init__(self, state: dict[str, dict[str, torch.Tensor]], key: str, folder: Path) -> None:
        self.tensors, self.folder = {name: s[key] for name, s in state.items()}, folder

    def index(self):
        from ckptio.formats.common import TensorInfo

        return {k: TensorInfo(tuple(v.shape), "float32") for k, v in self.tensors.items()}

    def read(self, key: str) -> torch.Tensor:
        return self.tensors[key]


@pytest.mark.parametrize("run,layout", [(run, layout) for run, layout in SOURCES if run in KINDS])
def test_virtual_pipeline_stages_with_experts_convert_to_hugging_face_with_megatrons_logits(made, tmp_path, run,
                                                                                            layout):
    """A Mixtral, a Qwen2-MoE (gated shared expert, q/k/v biases) and a Qwen3-MoE (q/k norms) of PP=2 x VPP=2 x
    EP=2, from every layout: megatron-core's logits, on tokens that reach every expert of every layer."""
    import transformers

    from ckptio.convert.formats import convert
    from megatron_shared import routed_logits

    ref = torch.load(made[run] / "reference.pt")
    got, routed = routed_logits(convert(made[run] / layout, tmp_path / "hf", "hf"), ref["input_ids"],
                                getattr(transformers, KINDS[run]))
    assert len(routed) == 4 and all(r == {0, 1, 2, 3} for r in routed), f"not every expert got tokens: {routed}"
    assert torch.allclose(got, ref["logits"], atol=1e-5, rtol=0), (got - ref["logits"]).abs().max()


@pytest.mark.parametrize("run,layout,world", [(*s, 1) for s in SOURCES] + [("ep", "legacy", 2),
                                                                          ("vppep", "torch_dist", 2)])
def test_a_plain_model_and_adamw_resume_with_megatrons_fp32_state_bitwise(made, tmp_path, run, layout, world):
    """A plain Llama (VPP), Mixtral (EP, VPP x EP), Qwen2-MoE or Qwen3-MoE (VPP x EP; transformers 5 fuses their
    experts in memory) with AdamW, on 1 rank and under FSDP2 on 2 (the fused experts' weights and moments sharded as
    DTensors, gathered whole to compare): its weights are Megatron's fp32 master copies, its moments Megatron's,
    bitwise, every parameter's step Megatron's 2; and it trains on, every parameter stepping a third time."""
    import json

    from ckptio.convert.formats import convert
    from ckptio.formats.live_experts import as_live
    from ckptio.formats.naming import _RenamedSource, get_converter
    from distributed import run_ranks
    from megatron_shared import restore_with_adam

    src = made[run] / layout
    hf = convert(src, tmp_path / "hf", "hf")
    got = run_ranks(world, restore_with_adam, source=str(src), config=str(hf), train=True)[0]
    assert bool((got.pop("steps") == 2).all())
    assert bool(torch.isfinite(got.pop("loss"))) and bool((got.pop("steps_after") == 3).all())
    _, ref = _reference(made[run])
    config = json.loads((hf / "config.json").read_text())
    naming = NAMINGS.get(run, "megatron-to-mixtral")
    want, live = {}, {k.removeprefix("model/") for k in got if k.startswith("model/")}
    for key, prefix in (("param", "model/{}"), ("exp_avg", "optim/state.{}.exp_avg"),
                        ("exp_avg_sq", "optim/state.{}.exp_avg_sq")):
        source = as_live(_RenamedSource(_Reference(ref, key, hf), get_converter(naming), config), live)
        want.update({prefix.format(name): source.read(name) for name in source.index()})
    got = {k: v for k, v in got.items() if not k.endswith(".step")}
    assert set(got) == set(want), sorted(set(got) ^ set(want))[:6]
    for key, value in want.items():
        assert got[key].dtype == torch.float32 and torch.equal(got[key], value[: got[key].shape[0]]), key


# ------------------------------------------------------------------------------------------------ refusals
def _copy(made: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(made / "legacy", dst)
    return dst


def _rewrite(path: Path, change) -> None:
    obj = torch.load(path, weights_only=False)
    obj = change(obj) or obj
    torch.save(obj, path)


def _read(folder: Path):
    from ckptio.formats.megatron.format import MegatronFormat

    return MegatronFormat().open_adam(folder)


def test_a_chunk_buffer_missing_or_extra_is_refused_by_name(made, tmp_path):
    run = _copy(made["vpp"], tmp_path)
    _rewrite(run / ITER / "mp_rank_00_001" / "distrib_optim.pt", lambda obj: [obj.pop(1), obj][1])
    with pytest.raises(CheckpointCorruptError, match=r"mp_rank_00_001/distrib_optim\.pt: holds the gradient buffers "
                                                     r"\['0'\], but the rank's 2 model chunk\(s\) have 2"):
        _read(run)


def test_chunk_buffers_swapped_are_refused_not_misread(made, tmp_path):
    run = _copy(made["vpp"], tmp_path)
    _rewrite(run / ITER / "mp_rank_00_000" / "distrib_optim.pt", lambda obj: obj.update({0: obj[1], 1: obj[0]}))
    with pytest.raises(CheckpointCorruptError, match=r"mp_rank_00_000/distrib_optim\.pt: (numel_unpadded|the fp32 "
                                                     r"master copy)"):
        _read(run)


def test_expert_parallel_files_without_their_optimizers_are_refused_by_name(made, tmp_path):
    run = _copy(made["ep"], tmp_path)
    _rewrite(run / ITER / "mp_rank_00_001" / "distrib_optim.pt", lambda obj: obj[:1])
    with pytest.raises(CheckpointCorruptError, match=r"mp_rank_00_001/distrib_optim\.pt: holds the state of 1 "
                                                     r"optimizer\(s\), not the 2 .*expert-parallel"):
        _read(run)
    run = _copy(made["ep"], tmp_path / "b")
    _rewrite(run / ITER / "mp_rank_00_000" / "distrib_optim.pt", lambda obj: [None, obj[1]])
    with pytest.raises(CheckpointCorruptError, match=r"mp_rank_00_000/distrib_optim\.pt: .*no state of the dense "
                                                     r"parameters"):
        _read(run)


def test_expert_ranks_files_swapped_are_refused_not_misread(made, tmp_path):
    run = _copy(made["ep"], tmp_path)
    a, b = (run / ITER / f"mp_rank_00_00{e}" / "distrib_optim.pt" for e in (0, 1))
    first, second = torch.load(a, weights_only=False), torch.load(b, weights_only=False)
    torch.save([first[0], second[1]], a)
    torch.save([None, first[1]], b)
    with pytest.raises(CheckpointCorruptError, match=r"distrib_optim\.pt: the fp32 master copy of .*experts"):
        _read(run)


def test_a_dense_run_with_chained_optimizers_is_refused(made, tmp_path):
    run = _copy(made["vpp"], tmp_path)
    _rewrite(run / ITER / "mp_rank_00_000" / "distrib_optim.pt", lambda obj: [obj, obj])
    with pytest.raises(CheckpointError, match=r"2 chained optimizers"):
        _read(run)


def test_model_chunks_with_experts_whose_args_name_another_family_are_refused_by_name(made, tmp_path):
    """Virtual pipeline stages with expert parallelism are read for a Mixtral, a Qwen2-MoE and a Qwen3-MoE: a
    Mixtral's file whose args add a shared expert or query/key norms its weights lack is refused, naming the
    argument; so is a Qwen2-MoE whose EP rank 1 lacks a chunk's shared expert gate."""
    from argparse import Namespace

    for arg, value, says in (("moe_shared_expert_intermediate_size", 24, r"moe_shared_expert_intermediate_size=24 "
                                                                         r"\(shared experts"),
                             ("qk_layernorm", True, r"0 of its 4 layers hold self_attention\.q_layernorm\.weight, "
                                                    r"but the run's qk_layernorm=True")):
        run = _copy(made["vppep"], tmp_path / arg)
        _rewrite(run / ITER / "mp_rank_00_000_000" / "model_optim_rng.pt",
                 lambda obj: obj.update(args=Namespace(**{**vars(obj["args"]), arg: value})))
        with pytest.raises(CheckpointError, match=says):
            _read(run)
    run = _copy(made["qwen2moe"], tmp_path / "qwen2moe")
    _rewrite(run / ITER / "mp_rank_00_001_001" / "model_optim_rng.pt",
             lambda obj: [obj["model1"].pop("decoder.layers.0.mlp.shared_experts.gate_weight"), obj][1])
    with pytest.raises(CheckpointCorruptError, match=r"mp_rank_00_001_001/model_optim_rng\.pt: holds other shared "
                                                     r"parameters than .*mp_rank_00_001_000.*shared_experts\.gate"):
        _read(run)


def test_a_chained_optimizers_tensor_under_both_prefixes_is_refused(made, tmp_path):
    """torch_dist keys without a ``chained_N.`` prefix and with one name the same tensor: refused, not one chosen."""
    import torch.distributed.checkpoint as dcp

    from ckptio.formats.dcp.format import load_all

    src = made["vppep"] / "torch_dist_chained" / ITER
    dst = tmp_path / "run" / ITER
    state = load_all(src)
    key = next(k for k in state if k.startswith("chained_0.optimizer.state.exp_avg."))
    state[key.removeprefix("chained_0.")] = state[key].clone()
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(dst)), no_dist=True)
    for name in ("common.pt", "metadata.json"):
        shutil.copy(src / name, dst / name)
    with pytest.raises(CheckpointCorruptError, match=r"both hold"):
        _read(dst)


@pytest.mark.parametrize("run", ["vppep", "qwen2moe", "qwen3moe"])
def test_ckptios_export_registers_parameters_in_megatron_cores_own_order(made, run):
    """The order ckptio's legacy export lays a rank's parameters out in (the plain optimizer's positions, the
    distributed optimizer's buffers, :func:`registered`) is the order of megatron-core's own rank files: a Qwen2-MoE's
    shared expert's gate, a parameter of ``SharedExpertMLP`` itself, before its ``linear_fc1``/``linear_fc2``."""
    from ckptio.formats.megatron.optim_write import registered

    files = sorted((made[run] / "legacy" / ITER).glob("*/model_optim_rng.pt"))
    assert len(files) == 4
    for path in files:
        obj = torch.load(path, weights_only=False)
        for v in range(2):
            megatrons = [n for n, t in obj[f"model{v}"].items() if isinstance(t, torch.Tensor)]
            assert list(registered(obj[f"model{v}"]))[:len(megatrons)] == megatrons, (path, v)

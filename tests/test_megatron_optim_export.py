"""A ckptio checkpoint with Adam's state goes to Megatron (``--to megatron``) and megatron-core trains on from it.

The source is a ckptio step directory of the tiny Llama ``megatron_fixture.py`` builds (its sizes), trained two
AdamW steps. Its export (torch_dist, TP=2) is loaded by megatron-core's own optimizer and scheduler in a real
process (``megatron_optim.py``: ``get_megatron_optimizer``, ``dist_checkpointing.load`` strict, the
``load_state_dict`` calls of Megatron-LM's ``load_checkpoint``): the moments Megatron holds are ckptio's bitwise,
the step and learning rate are the source's, and its next training step moves every parameter as a plain torch
AdamW step from that state with the same gradient does.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ckptio.convert.formats import convert
from megatron_shared import run_fixture

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.slow  # multi-process megatron-core runs


def _llama(dtype: torch.dtype = torch.float32, tied: bool = False, hidden: int = 64):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=64,
                         rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=tied, torch_dtype=dtype)
    torch.manual_seed(3)
    return LlamaForCausalLM(config).to(dtype)


def _step_dir(root: Path, dtype: torch.dtype = torch.float32, tied: bool = False,
              hidden: int = 64) -> tuple[Path, torch.nn.Module, torch.optim.Optimizer]:
    """A ckptio checkpoint of the tiny Llama after two AdamW steps (weight decay, betas 0.9/0.95), at step 2."""
    from ckptio import CheckpointConfig, CheckpointManager

    model = _llama(dtype, tied, hidden)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
    for step in range(2):
        x = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(step))
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    with CheckpointManager(CheckpointConfig(checkpoint_dir=str(root)), model=model, optimizer=opt, rng=False) as mgr:
        mgr.save(step=2)
    return next(p for p in root.iterdir() if p.name.startswith("epoch")), model, opt


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron_optim")
    step, model, opt = _step_dir(root / "ck")
    out = convert(step, root / "export", "megatron", options={"tp": 2})
    run_fixture("--tp", "2", "--train", str(out / "iter_0000002"), "--out", str(root / "trained.pt"))
    return torch.load(root / "trained.pt"), model, opt, out


@pytest.fixture(scope="module")
def trained_distributed(tmp_path_factory):
    """The same source exported for megatron-core's DistributedOptimizer (fully_reshardable), loaded on TP=1 x DP=2."""
    root = tmp_path_factory.mktemp("megatron_optim_dist")
    step, model, opt = _step_dir(root / "ck")
    out = convert(step, root / "export", "megatron", options={"optimizer": "distributed"})
    run_fixture("--tp", "1", "--dp", "2", "--train", str(out / "iter_0000002"), "--out", str(root / "trained.pt"))
    return torch.load(root / "trained.pt"), model, opt


def _megatron_named(model, opt, moment: str | None) -> dict[str, torch.Tensor]:
    """The HF model's weights (or one Adam moment) under Megatron-Core names, whole, through ckptio's converter."""
    from ckptio.formats.naming import _RenamedSource, get_converter

    class Held:
        folder = None

        def __init__(self):
            self.t = {n: (p.detach() if moment is None else opt.state[p][moment]) for n, p in model.named_parameters()}

        def index(self):
            from ckptio.formats.common import TensorInfo, dtype_name

            return {k: TensorInfo(tuple(v.shape), dtype_name(v.dtype)) for k, v in self.t.items()}

        def read(self, key):
            return self.t[key]

    renamed = _RenamedSource(Held(), get_converter("llama-to-megatron"), model.config.to_dict())
    return {k: renamed.read(k) for k in renamed.index()}


def _canonical(name: str) -> str:
    """The local spec's norm names (``input_layernorm``) as the torch_dist names ckptio's converter gives."""
    from ckptio.formats.megatron.layout import _LAYER, _RENAME

    m = _LAYER.match(name)
    return f"decoder.layers.{m.group(1)}.{_RENAME.get(m.group(2), m.group(2))}" if m else name


def _megatron_holds_ours(got, model, opt, named=_megatron_named, tag=()) -> None:
    """Every weight and moment megatron-core held before its step (``got``) is the ckptio state's, bitwise, under
    Megatron-Core names (``named``; ``tag`` leads each failure's message)."""
    for moment in (None, "exp_avg", "exp_avg_sq"):
        ours = named(model, opt, moment)
        assert set(ours) == {_canonical(n) for n in got["params"]}
        for name, theirs in got["params"].items():
            assert torch.equal(theirs["before"][moment or "param"], ours[_canonical(name)]), (*tag, moment, name)


def _stepped_on_from_step_2(got) -> None:
    """megatron-core's step went from 2 to 3 with the source's learning rate and weight decay on the matrices only,
    and every parameter and moment moved."""
    for name, p in got["params"].items():
        assert p["before"]["step"] == 2.0 and p["after"]["step"] == 3.0, name
        assert p["hyper"]["lr"] == 2e-3 and (p["hyper"]["weight_decay"] == 0) == (p["before"]["param"].dim() == 1)
        for key in ("param", "exp_avg", "exp_avg_sq"):
            assert not torch.equal(p["after"][key], p["before"][key]), (name, key)


def _ckptio_reads_back(out, model, opt) -> None:
    """ckptio's own Megatron reader finds the source's Adam state in the export ``out``, bitwise, and its step 2."""
    from ckptio.formats.megatron.format import MegatronFormat

    step, moments = MegatronFormat().open_adam(out)
    assert step == 2.0
    for name, p in model.named_parameters():
        for moment, source in moments.items():
            assert torch.equal(source.read(name), opt.state[p][moment]), (moment, name)


def test_megatron_core_loads_ckptios_adam_state_bitwise(trained):
    got, model, opt, _ = trained
    assert got["iteration"] == 2
    _megatron_holds_ours(got, model, opt)
    assert {p["before"]["step"] for p in got["params"].values()} == {2.0}


def test_megatron_core_trains_on_as_adamw_would_from_that_state(trained):
    got, *_ = trained
    assert torch.isfinite(torch.tensor(got["loss"]))
    decayed = set()
    for name, p in got["params"].items():
        hyper = p["hyper"]
        assert hyper["lr"] == 2e-3 and hyper["betas"] == (0.9, 0.95) and hyper["eps"] == 1e-8, (name, hyper)
        if hyper["weight_decay"]:
            decayed.add(name)
        w = p["before"]["param"].clone().requires_grad_(True)
        ref = torch.optim.AdamW([w], lr=hyper["lr"], betas=hyper["betas"], eps=hyper["eps"],
                                weight_decay=hyper["weight_decay"])
        ref.state[w] = {"step": torch.tensor(p["before"]["step"]), "exp_avg": p["before"]["exp_avg"].clone(),
                        "exp_avg_sq": p["before"]["exp_avg_sq"].clone()}
        w.grad = p["grad"]
        ref.step()
        assert p["after"]["step"] == 3.0
        assert not torch.equal(p["after"]["param"], p["before"]["param"]), name
        for key, mine in (("param", w.detach()), ("exp_avg", ref.state[w]["exp_avg"]),
                          ("exp_avg_sq", ref.state[w]["exp_avg_sq"])):
            assert torch.allclose(p["after"][key], mine, rtol=1e-6, atol=1e-9), (name, key)
    # megatron's grouping: weight decay on the matrices, none on the norms
    assert decayed == {n for n, p in got["params"].items() if p["before"]["param"].dim() > 1}


def test_what_megatron_would_not_train_on_is_refused_by_name(tmp_path):
    from ckptio.errors import ConfigError

    bf16, *_ = _step_dir(tmp_path / "ck16", torch.bfloat16)
    with pytest.raises(ConfigError, match="Float16OptimizerWithFloat16Params"):
        convert(bf16, tmp_path / "bf16", "megatron")
    assert not (tmp_path / "bf16").exists()


def test_the_export_reads_back_as_the_ckptio_state_it_came_from(trained):
    """ckptio -> Megatron (TP=2, moments padded and fused) -> ckptio's Megatron reader: every weight and moment
    is the source's, bitwise, under the Hugging Face names, and the step is its step."""
    from ckptio.formats.megatron.format import MegatronFormat, MegatronSource, _as_llama

    _, model, opt, out = trained
    step, moments = MegatronFormat().open_adam(out)
    weights = _as_llama(MegatronSource(out))
    assert step == 2.0
    names = dict(model.named_parameters())
    assert set(weights.index()) == set(names) == set(moments["exp_avg"].index())
    for name, p in names.items():
        assert torch.equal(weights.read(name), p.detach()), name
        for moment, source in moments.items():
            assert torch.equal(source.read(name), opt.state[p][moment]), (moment, name)


def test_megatron_cores_distributed_optimizer_loads_and_trains_on_the_distributed_export(trained_distributed):
    """Each DP rank's range of every parameter, gathered: the fp32 master copy, moments and step are ckptio's,
    bitwise; one step later the step is 3 and every parameter and moment has moved."""
    got, model, opt = trained_distributed
    assert got["iteration"] == 2 and torch.isfinite(torch.tensor(got["loss"]))
    _megatron_holds_ours(got, model, opt)
    for name, p in got["params"].items():
        assert p["before"]["step"] == 2.0 and p["after"]["step"] == 3.0
        assert p["hyper"]["lr"] == 2e-3 and p["hyper"]["betas"] == (0.9, 0.95), (name, p["hyper"])
        for key in ("param", "exp_avg", "exp_avg_sq"):
            assert not torch.equal(p["after"][key], p["before"][key]), (name, key)


# ------------------------------------------------------------------------------------------------ a mixture of experts
def _moe(family: str) -> torch.nn.Module:
    """A tiny mixture of experts of ``megatron_fixture.py --family F``'s sizes: a Mixtral, a Qwen2-MoE (its gated
    shared expert and q/k/v biases) or a Qwen3-MoE (its q/k norms), both routed as norm_topk_prob=False (the fixture's
    moe_router_pre_softmax)."""
    import transformers

    sizes = dict(vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, max_position_embeddings=64, tie_word_embeddings=False, num_experts_per_tok=2,
                 rope_parameters={"rope_theta": 1e6, "rope_type": "default"})
    kind, extra = {
        "mixtral": ("Mixtral", dict(intermediate_size=32, rms_norm_eps=1e-5, num_local_experts=4)),
        "qwen2moe": ("Qwen2Moe", dict(intermediate_size=128, moe_intermediate_size=32, num_experts=4, rms_norm_eps=1e-6,
                                      shared_expert_intermediate_size=48, norm_topk_prob=False)),
        "qwen3moe": ("Qwen3Moe", dict(intermediate_size=128, moe_intermediate_size=32, num_experts=4, rms_norm_eps=1e-6,
                                      norm_topk_prob=False)),
    }[family]
    torch.manual_seed(3)
    return getattr(transformers, f"{kind}ForCausalLM")(getattr(transformers, f"{kind}Config")(**sizes, **extra))


def _moe_step_dir(root: Path, family: str) -> tuple[Path, torch.nn.Module, torch.optim.Optimizer]:
    """A ckptio checkpoint of a tiny mixture of experts (:func:`_moe`; transformers 5 fuses its experts in memory, and
    so does the checkpoint) after two AdamW steps, at step 2."""
    from ckptio import CheckpointConfig, CheckpointManager

    model = _moe(family)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
    for step in range(2):
        x = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(step))
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    with CheckpointManager(CheckpointConfig(checkpoint_dir=str(root)), model=model, optimizer=opt, rng=False) as mgr:
        mgr.save(step=2)
    return next(p for p in root.iterdir() if p.name.startswith("epoch")), model, opt


@pytest.fixture(scope="module", params=[("mixtral", "plain"), ("mixtral", "distributed"), ("mixtral", "legacy-plain"),
                                        ("mixtral", "legacy-distributed"), ("qwen2moe", "distributed"),
                                        ("qwen3moe", "distributed")], ids="-".join)
def trained_moe(request, tmp_path_factory):
    """The mixture of experts exported (torch_dist, TP=1; or ``legacy-``: in EP=2 rank folders, each rank file's
    optimizer a ``ChainedOptimizer`` list, with the distributed optimizer each folder's ``distrib_optim.pt`` the list
    of the dense state (EP rank 0's only) and the experts'), loaded and trained one step by megatron-core at EP=2 (two
    ranks, each two of the four experts; the experts' optimizer chained beside the dense one)."""
    family, layout_kind = request.param
    root = tmp_path_factory.mktemp(f"megatron_moe_optim_{family}_{layout_kind}")
    step, model, opt = _moe_step_dir(root / "ck", family)
    kind = layout_kind.removeprefix("legacy-")
    options = {"layout": "legacy", "ep": 2} if layout_kind.startswith("legacy") else {}
    out = convert(step, root / "export", "megatron", options={"optimizer": kind, **options})
    run_fixture("--family", family, "--ep", "2", "--dp", "2", "--train", str(out / "iter_0000002"),
                "--train-optimizer", kind, "--out", str(root / "trained.pt"))
    return torch.load(root / "trained.pt"), model, opt, layout_kind, out


def _saved_moe(model, opt, moment: str | None):
    """The mixture's weights (or one moment) as a source under the Hugging Face names of a saved checkpoint (its
    live fused experts split per expert)."""
    from ckptio.formats.common import TensorInfo, dtype_name
    from ckptio.formats.live_experts import as_saved

    class Held:
        folder = None
        t = {n: (p.detach() if moment is None else opt.state[p][moment]) for n, p in model.named_parameters()}

        def index(self):
            return {k: TensorInfo(tuple(v.shape), dtype_name(v.dtype)) for k, v in self.t.items()}

        def read(self, key):
            return self.t[key]

    return as_saved(Held(), model.config.model_type)


def _megatron_named_moe(model, opt, moment: str | None) -> dict[str, torch.Tensor]:
    """The mixture's weights (or one moment), its live fused experts split per expert, under Megatron-Core names."""
    from ckptio.formats.naming import _RenamedSource, get_converter

    naming = "mixtral-to-megatron" if model.config.model_type == "mixtral" else "qwen2moe-to-megatron"  # Qwen3-MoE's
    renamed = _RenamedSource(_saved_moe(model, opt, moment), get_converter(naming), model.config.to_dict())
    return {k: renamed.read(k) for k in renamed.index()}


def test_megatron_core_loads_a_mixtures_adam_state_at_ep2_bitwise_and_trains_on(trained_moe):
    """Every expert's weights, moments and step as megatron-core's plain or distributed optimizer holds them at EP=2
    (each from the EP rank that holds it) are the ckptio checkpoint's, bitwise (a Mixtral's, a Qwen2-MoE's with its
    shared expert, a Qwen3-MoE's with its q/k norms); the experts sit in an optimizer of
    their own (``is_expert_parallel``) with the source's hyper-parameters, and one step later every parameter and
    moment has moved and the step is 3."""
    got, model, opt, kind, out = trained_moe
    if kind == "legacy-distributed":  # ckptio's reader lays the EP ranks' buffers out again: every master copy is
        from ckptio.formats.megatron.format import MegatronFormat, MegatronSource, _as_llama  # the weight, the
        # padding zeros
        step, moments = MegatronFormat().open_adam(out)
        assert step == 2.0 and moments["exp_avg"].index().keys() == _as_llama(MegatronSource(out)).index().keys()
    assert got["iteration"] == 2 and torch.isfinite(torch.tensor(got["loss"]))
    _megatron_holds_ours(got, model, opt, _megatron_named_moe, (kind,))
    experts = {n for n in got["params"] if ".mlp.experts." in n}
    assert len(experts) == 4 * 4 * 2
    for name, p in got["params"].items():
        assert p["before"]["step"] == 2.0 and p["after"]["step"] == 3.0, (name, p["before"]["step"])
        assert p["hyper"]["is_expert_parallel"] == (name in experts), name
        assert p["hyper"]["lr"] == 2e-3 and p["hyper"]["betas"] == (0.9, 0.95), (name, p["hyper"])
        assert (p["hyper"]["weight_decay"] == 0) == (p["before"]["param"].dim() == 1), (name, p["hyper"])
        for key in ("param", "exp_avg", "exp_avg_sq"):
            if name.endswith("mlp.router.weight") or name in experts:
                continue  # an expert no token reached this step keeps its gradient zero (its moments still decay)
            assert not torch.equal(p["after"][key], p["before"][key]), (name, key)


# ------------------------------------------------------------------------------------------------ the legacy layout
@pytest.fixture(scope="module")
def trained_legacy_distributed(tmp_path_factory):
    """The Llama exported in the legacy layout for megatron-core's DistributedOptimizer (TP=2: each rank folder's
    ``distrib_optim.pt`` beside ``model_optim_rng.pt``), loaded on TP=2 x DP=2 as Megatron-LM's legacy
    load_checkpoint does (``load_state_dict``, then ``load_parameter_state``) and trained one step."""
    root = tmp_path_factory.mktemp("megatron_optim_legacy_dist")
    step, model, opt = _step_dir(root / "ck")
    out = convert(step, root / "export", "megatron", options={"tp": 2, "layout": "legacy", "optimizer": "distributed"})
    run_fixture("--tp", "2", "--dp", "2", "--train", str(out / "iter_0000002"), "--train-optimizer", "distributed",
                "--out", str(root / "trained.pt"))
    return torch.load(root / "trained.pt"), model, opt, out


def test_megatron_cores_distributed_optimizer_loads_a_legacy_export_bitwise_and_trains_on(trained_legacy_distributed):
    """Each DP rank's range of every parameter, gathered: the fp32 master copy and moments megatron-core scattered
    from the flat buffers are ckptio's, bitwise, the step 2; one step later it is 3 and everything has moved. ckptio's
    own reader lays the buffers out again and finds the source's state."""
    got, model, opt, out = trained_legacy_distributed
    assert got["iteration"] == 2 and torch.isfinite(torch.tensor(got["loss"]))
    _megatron_holds_ours(got, model, opt)
    _stepped_on_from_step_2(got)
    _ckptio_reads_back(out, model, opt)


@pytest.fixture(scope="module", params=["plain", "distributed"])
def trained_legacy_vpp_tied(request, tmp_path_factory):
    """The Llama with tied embeddings exported in the legacy layout at PP=2 x VPP=2 (rank files with ``model0``,
    ``model1``; the last stage's last chunk holds the tied embedding's copy as ``output_layer.weight``): with the plain
    optimizer at TP=2 (``mp_rank_TT_PPP``, Adam's state keyed by position in megatron-core's groups over both
    chunks), or with ``distrib_optim.pt`` (one buffer per chunk, the embedding and its copy each in a bucket of its
    own) at DP=2; loaded by megatron-core as Megatron-LM's legacy load_checkpoint does, and trained one step. Hidden
    size 48: the norms' 48 elements are no multiple of the buffers' 64-element alignment, so there is padding to
    place between the parameters as megatron-core does."""
    kind = request.param
    root = tmp_path_factory.mktemp(f"megatron_optim_legacy_vpp_tied_{kind}")
    step, model, opt = _step_dir(root / "ck", tied=True, hidden=48)
    tp = 2 if kind == "plain" else 1
    out = convert(step, root / "export", "megatron", options={"tp": tp, "pp": 2, "vpp": 2, "layout": "legacy",
                                                              "optimizer": kind})
    run_fixture("--tp", str(tp), "--pp", "2", "--vpp", "2", "--tied", "--hidden", "48",
                *(("--dp", "2") if kind == "distributed" else ()),
                "--train", str(out / "iter_0000002"), "--train-optimizer", kind, "--out", str(root / "trained.pt"))
    return torch.load(root / "trained.pt"), model, opt, out, kind


def test_megatron_core_loads_a_legacy_vpp_export_with_a_tied_embedding_bitwise_and_trains_on(trained_legacy_vpp_tied):
    """Every TP shard's and chunk's weights and Adam state are ckptio's, bitwise; the tied embedding's copy on the
    last stage is the embedding, its state the embedding's, before and after a step that moved everything (its
    gradient summed over both copies by finalize_model_grads). ckptio's own reader finds the source's state in the
    distributed optimizer's export."""
    got, model, opt, out, kind = trained_legacy_vpp_tied
    assert got["iteration"] == 2
    _megatron_holds_ours(got, model, opt)
    _stepped_on_from_step_2(got)
    copy, embedding = got["copies"]["output_layer.weight"], got["params"]["embedding.word_embeddings.weight"]
    for when in ("before", "after"):
        for key in ("param", "exp_avg", "exp_avg_sq"):
            assert torch.equal(copy[when][key], embedding[when][key]), (when, key)
    if kind == "plain":
        return  # the plain optimizer's state by position: ckptio reads a legacy run's distrib_optim.pt only
    _ckptio_reads_back(out, model, opt)


@pytest.fixture(scope="module", params=[("mixtral", "plain"), ("mixtral", "distributed"),
                                        *(pytest.param((family, kind), marks=pytest.mark.slow)
                                          for family in ("qwen2moe", "qwen3moe") for kind in ("plain", "distributed"))],
                ids="-".join)
def trained_legacy_vpp_ep(request, tmp_path_factory):
    """The mixture of experts (a Mixtral; a Qwen2-MoE with its gated shared expert; a Qwen3-MoE with its q/k norms)
    exported in the legacy layout at PP=2 x VPP=2 x EP=2 (``mp_rank_00_PPP_EEE`` rank files with ``model0``,
    ``model1``, each EP rank's two experts its local experts; the optimizer the chained dense and experts' one, each
    over both chunks, with the distributed optimizer a buffer per chunk in each), loaded by megatron-core on PP=2 x
    DP=2 (EP=2 over the data-parallel ranks: four ranks) as Megatron-LM's legacy load_checkpoint does, each chunk
    strictly, and trained one step."""
    family, kind = request.param
    root = tmp_path_factory.mktemp(f"megatron_optim_legacy_vpp_ep_{family}_{kind}")
    step, model, opt = _moe_step_dir(root / "ck", family)
    out = convert(step, root / "export", "megatron", options={"pp": 2, "vpp": 2, "ep": 2, "layout": "legacy",
                                                              "optimizer": kind})
    run_fixture("--family", family, "--pp", "2", "--vpp", "2", "--ep", "2", "--dp", "2",
                "--train", str(out / "iter_0000002"), "--train-optimizer", kind, "--out", str(root / "trained.pt"))
    return torch.load(root / "trained.pt"), model, opt, out, kind


def test_megatron_core_loads_a_mixtures_legacy_vpp_ep_export_bitwise_and_trains_on(trained_legacy_vpp_ep):
    """Every chunk's weights and Adam state, each expert's from the EP rank that holds it, are ckptio's, bitwise (a
    Qwen2-MoE's shared expert and its gate, a Qwen3-MoE's q/k norms too), the experts in the experts' optimizer
    (``is_expert_parallel``; a shared expert in the dense one); one step later the step is 3 and everything has
    moved. ckptio's own reader lays the distributed optimizer's buffers out again and finds the source's state."""
    from ckptio.formats.megatron.format import MegatronFormat

    got, model, opt, out, kind = trained_legacy_vpp_ep
    assert sorted(p.name for p in (out / "iter_0000002").iterdir()) == [
        f"mp_rank_00_{p:03d}_{e:03d}" for p in range(2) for e in range(2)]
    assert got["iteration"] == 2
    family_own = {"qwen2_moe": ("mlp.shared_experts.gate_weight", "mlp.shared_experts.linear_fc1.weight",
                                "self_attention.linear_qkv.bias"),
                  "qwen3_moe": ("self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight")}
    for part in family_own.get(model.config.model_type, ()):  # every layer's, loaded and stepped as the rest
        assert sum(n.endswith(part) for n in got["params"]) == 4, part
    _megatron_holds_ours(got, model, opt, _megatron_named_moe, (kind,))
    _stepped_on_from_step_2(got)
    experts = {n for n in got["params"] if ".mlp.experts." in n}
    assert len(experts) == 4 * 4 * 2
    assert all(p["hyper"]["is_expert_parallel"] == (name in experts) for name, p in got["params"].items())
    if kind == "plain":
        return  # the plain optimizer's state by position: ckptio reads a legacy run's distrib_optim.pt only
    step, moments = MegatronFormat().open_adam(out)
    assert step == 2.0
    for moment, source in moments.items():
        ours = _saved_moe(model, opt, moment)
        assert source.index().keys() == ours.index().keys()
        for name in ours.index():
            assert torch.equal(source.read(name), ours.read(name)), (moment, name)

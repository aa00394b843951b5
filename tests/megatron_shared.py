"""What the Megatron test files of every family and layout share: the model they resume into with Adam's state
(:func:`restore_with_adam`), and a NeMo 2.0 folder made from a Megatron export (:func:`nemo2_folder`)."""

from __future__ import annotations

from pathlib import Path

import torch


def restore_with_adam(source: str, config: str, train: bool = False) -> dict:
    """A Hugging Face model built from ``config`` (any family), in fp32 as Megatron's optimizer state, FSDP2-sharded
    when a process group is up, with ``AdamW``, restored by ckptio from ``source``: its full state (weights and
    moments, :func:`toy.full_state`, the DTensors gathered whole) and each parameter's step (run through
    ``distributed.run_ranks``). With ``train``: then one training step on fixed tokens, and ``loss`` its loss and
    ``steps_after`` each parameter's step after it (one more for every parameter that got a gradient)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from transformers import AutoConfig, AutoModelForCausalLM

    from ckptio import CheckpointConfig, CheckpointManager
    from toy import full_state

    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config)).float()  # fp32, as Megatron's state
    if dist.is_initialized():
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # the manager's own folder beside ``config`` (the test's), never beside ``source``: a megatron-core run shared by
    # the session's test files (fixture_cache.built) is only read
    with CheckpointManager(CheckpointConfig(checkpoint_dir=str(Path(config).parent / "run")), model=model,
                           optimizer=opt, rng=False) as mgr:
        info = mgr.restore(source)
    assert info.counters["optimizer_restored"] is True
    for name, p in model.named_parameters():  # each moment sharded as its parameter (whole, or an FSDP2 DTensor)
        for m in ("exp_avg", "exp_avg_sq"):
            moment = opt.state[p][m]
            assert isinstance(moment, DTensor) == isinstance(p, DTensor) and moment.shape == p.shape and \
                getattr(moment, "placements", None) == getattr(p, "placements", None), (name, m, moment.shape)
    out = full_state(model, opt)
    out["steps"] = torch.tensor([float(opt.state[p]["step"]) for p in model.parameters()])
    if train:  # the resumed optimizer steps on, every parameter (fused experts included) with a gradient
        ids = (torch.arange(48).reshape(2, 24) * 7) % model.config.vocab_size
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        out["loss"] = loss.detach()
        out["steps_after"] = torch.tensor([float(opt.state[p]["step"]) for p in model.parameters()])
    return out


def nemo2_folder(iteration: Path, root: Path, model_yaml: list[str]) -> Path:
    """``root`` made a NeMo 2.0 checkpoint of the torch_dist ``iteration`` folder: ``weights/`` a Megatron-Core
    distributed checkpoint with ``module.``-prefixed keys and an empty ``common.pt``, ``context/model.yaml`` the
    lines ``model_yaml`` (the model's TransformerConfig, as NeMo writes it)."""
    import json
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from ckptio.formats.dcp.format import load_all

    state = {f"module.{k}": v for k, v in load_all(iteration).items()}
    weights = root / "weights"
    weights.mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(weights)), no_dist=True,
                 planner=DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False))
    torch.save({}, weights / "common.pt")
    (weights / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                                                        "common_backend": "torch", "common_backend_version": 1}))
    (root / "context").mkdir()
    (root / "context" / "model.yaml").write_text("\n".join(model_yaml))
    return root


def fuzz_smoke(family: str, inputs: int, seed: int = 5) -> None:
    """A CI-sized run of one Megatron fuzz family of ``tools/fuzz_megatron.py`` (the long run: ``tools/fuzz_readers.py
    --family FAMILY --inputs 100000``): every damaged folder must end in a right read or a ckptio error, and the
    attacks must reach a reader."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import fuzz_readers

    tally = fuzz_readers.run([family], inputs=inputs, seed=seed, verbose=True)[family]
    failures = "\n".join(f"input {i}: {d} <- {'; '.join(notes)}" for i, d, notes in tally["failures"])
    assert tally["other"] == 0 and tally["harness"] == 0, failures
    assert tally["clean"] > 0 and tally["ok"] + tally["clean"] == inputs


def same_weights(a: Path, b: Path) -> None:
    """The two safetensors folders hold the same keys, bitwise the same tensors (a round trip's check)."""
    from ckptio.formats.safetensors.sharded import SafetensorsSource

    x, y = SafetensorsSource(a), SafetensorsSource(b)
    assert x.index().keys() == y.index().keys()
    for key in x.index():
        assert torch.equal(x.read(key), y.read(key)), f"{key} differs after the round trip"


def run_fixture(*args: str, timeout: float = 300) -> None:
    """Run ``tests/megatron_fixture.py`` with ``args`` (megatron-core itself, in processes of its own)."""
    import subprocess
    import sys

    fixture = Path(__file__).with_name("megatron_fixture.py")
    run = subprocess.run([sys.executable, str(fixture), *args], capture_output=True, text=True, timeout=timeout,
                         start_new_session=True)
    assert run.returncode == 0, f"megatron-core run {args} failed:\n{run.stderr[-3000:]}"


def check_fixture_adam(got: dict, params: int = 39) -> None:
    """``got`` (:func:`restore_with_adam`'s result) holds the fixture's one made-up Adam step for each of the
    ``params`` parameters: the moments of gradient ``g`` (``exp_avg = 0.1 g``, ``exp_avg_sq = 0.05 g²``) and the
    weights that step left (``2 g - 0.5 - 1e-3 sign(g)``)."""
    steps = got.pop("steps")
    assert steps.numel() == params and bool((steps == 1).all()), steps
    names = [k.removeprefix("model/") for k in got if k.startswith("model/")]
    assert len(names) == params
    for name in names:
        g = got[f"optim/state.{name}.exp_avg"] / 0.1
        assert torch.allclose(got[f"optim/state.{name}.exp_avg_sq"], 0.05 * g * g, rtol=1e-4, atol=1e-9), name
        assert torch.allclose(got[f"model/{name}"], 2 * g - 0.5 - 1e-3 * torch.sign(g), atol=2e-6, rtol=0), name


def routed_logits(hf: Path, ids: torch.Tensor, kind: type) -> tuple[torch.Tensor, list[set[int]]]:
    """The logits of the mixture of experts in ``hf`` (loaded as ``kind``, which it must be) and the experts each
    layer routed the tokens to."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf).eval()
    assert isinstance(model, kind)
    with torch.no_grad():
        out = model(ids, output_router_logits=True)
    k = model.config.num_experts_per_tok
    return out.logits, [set(r.topk(k, dim=-1).indices.flatten().tolist()) for r in out.router_logits]


def config_of(folder: Path) -> dict:
    """The ``config.json`` in ``folder``."""
    import json

    return json.loads((folder / "config.json").read_text())


def respelled(src: Path, **changes) -> Path:
    """``src``'s ``config.json`` with ``changes`` (a field given ``None`` removed), in place."""
    import json

    config = config_of(src)
    for k, v in changes.items():
        if v is None:
            config.pop(k, None)
        else:
            config[k] = v
    (src / "config.json").write_text(json.dumps(config))
    return src


def with_args(hf: Path, tmp_path: Path, layout: str = "dist", tp: int = 1, **changes) -> Path:
    """``hf`` exported to Megatron (``layout``, ``tp``) in ``tmp_path/mg``, its recorded Megatron ``args`` then changed
    by ``changes`` (:func:`rewrite_args`)."""
    from ckptio.convert.formats import convert

    out = convert(hf, tmp_path / "mg", "megatron", options={"layout": layout, "tp": tp})
    rewrite_args(out / "iter_0000000", **changes)
    return out


def megatron_as_hf(mega: dict, vocab: int = 128, groups: int = 2, head_dim: int = 16) -> dict[str, torch.Tensor]:
    """A torch_dist checkpoint of the fixture's Qwen-style mixtures of experts (``load_all`` of its iteration folder:
    each layer's tensors stacked along dimension 0), its weights and Adam's moments under the names :func:`restore_with_adam`
    gives them (``model/...``, ``optim/state....exp_avg``...): written out here from Megatron's layout, independently
    of ckptio's readers (the fused query/key/value rows grouped per query group: its heads' queries, a key, a value)."""
    out = {}
    for prefix, name in [("", "model/{}"), *((f"optimizer.state.{m}.", "optim/state.{}." + m)
                                             for m in ("exp_avg", "exp_avg_sq"))]:
        def put(ours: str, theirs: str, pick=lambda t: t) -> None:
            if prefix + theirs in mega:
                out[name.format(ours)] = pick(mega[prefix + theirs])

        put("model.embed_tokens.weight", "embedding.word_embeddings.weight", lambda t: t[:vocab])
        put("lm_head.weight", "output_layer.weight", lambda t: t[:vocab])
        put("model.norm.weight", "decoder.final_layernorm.weight")
        for i in range(mega[prefix + "decoder.layers.mlp.router.weight"].shape[0]):
            p, d = f"model.layers.{i}.", "decoder.layers."
            layer = lambda t, i=i: t[i]  # noqa: E731
            for ours, theirs in {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
                                 "post_attention_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
                                 "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
                                 "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
                                 "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
                                 "mlp.gate.weight": "mlp.router.weight",
                                 "mlp.experts.gate_up_proj": "mlp.experts.experts.linear_fc1.weight",
                                 "mlp.experts.down_proj": "mlp.experts.experts.linear_fc2.weight",
                                 "mlp.shared_expert.down_proj.weight": "mlp.shared_experts.linear_fc2.weight",
                                 "mlp.shared_expert_gate.weight": "mlp.shared_experts.gate_weight"}.items():
                put(p + ours, d + theirs, layer)
            for j, part in enumerate(("gate_proj", "up_proj")):
                put(f"{p}mlp.shared_expert.{part}.weight", d + "mlp.shared_experts.linear_fc1.weight",
                    lambda t, i=i, j=j: t[i].chunk(2)[j])
            for kind in ("weight", "bias"):
                for j, part in enumerate(("q_proj", "k_proj", "v_proj")):
                    put(f"{p}self_attn.{part}.{kind}", f"{d}self_attention.linear_qkv.{kind}",
                        lambda t, i=i, j=j: _qkv(t[i], groups, head_dim)[j])
    return out


def holds_megatrons_state(got: dict, iteration: Path, params: int) -> None:
    """``got`` (:func:`restore_with_adam`'s result for one of the fixture's Qwen-style mixtures of experts) holds the
    torch_dist checkpoint ``iteration``'s every weight and Adam moment as fp32, bit for bit (:func:`megatron_as_hf`),
    each parameter's step 1 and the fixture's one made-up Adam step for each of the ``params`` parameters."""
    from ckptio.formats.dcp.format import load_all

    want = megatron_as_hf(load_all(iteration))
    assert set(want) == {k for k in got if not k.endswith(".step") and k != "steps"}
    for key, value in want.items():
        assert got[key].dtype == torch.float32 and torch.equal(got[key], value), key
    assert {v.item() for k, v in got.items() if k.endswith(".step")} == {1.0}
    check_fixture_adam(got, params=params)


def _qkv(fused: torch.Tensor, groups: int, head_dim: int) -> tuple[torch.Tensor, ...]:
    """Megatron's fused query/key/value rows (per query group: its queries, one key, one value) as q, k, v."""
    per = fused.reshape(groups, -1, *fused.shape[1:])
    q = per.shape[1] - 2 * head_dim
    return tuple(t.reshape(-1, *fused.shape[1:]) for t in per.split([q, head_dim, head_dim], dim=1))


def rewrite_args(iteration: Path, **changes) -> None:
    """The Megatron ``args`` recorded in the iteration folder ``iteration`` changed by ``changes``, in place: in its
    ``common.pt`` (torch_dist), or in every legacy rank file (copy a shared fixture first)."""
    files = [iteration / "common.pt"] if (iteration / "common.pt").is_file() else \
        sorted(iteration.glob("mp_rank_*/model_optim_rng.pt"))
    assert files, f"no args in {iteration}"
    for f in files:
        state = torch.load(f, weights_only=False)
        for k, v in changes.items():
            setattr(state["args"], k, v)
        torch.save(state, f)

"""What the Megatron test files of every family and layout share: the model they resume into with Adam's state
(:func:`restore_with_adam`), and a NeMo 2.0 folder made from a Megatron export (:func:`nemo2_folder`)."""

from __future__ import annotations

from pathlib import Path

import torch


def restore_with_adam(source: str, config: str) -> dict:
    """A Hugging Face model built from ``config`` (any family), in fp32 as Megatron's optimizer state, FSDP2-sharded
    when a process group is up, with ``AdamW``, restored by ckptio from ``source``: its full state (weights and
    moments, :func:`toy.full_state`) and each parameter's step (run through ``distributed.run_ranks``)."""
    import torch.distributed as dist
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
    with CheckpointManager(CheckpointConfig(checkpoint_dir=str(Path(source).parent / "run")), model=model,
                           optimizer=opt, rng=False) as mgr:
        info = mgr.restore(source)
    assert info.counters["optimizer_restored"] is True
    out = full_state(model, opt)
    out["steps"] = torch.tensor([float(opt.state[p]["step"]) for p in model.parameters()])
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

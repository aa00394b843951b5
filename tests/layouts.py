"""The tiny Llama built for a parallel layout, with PyTorch's own APIs (used by the layout tests).

A layout is a string: ``"1"`` (one rank, plain model), ``"fsdp3"`` (FSDP2 over 3 ranks), ``"tp2"`` (tensor
parallel over 2 ranks: ``parallelize_module`` with column-wise q/k/v/gate/up and row-wise o/down
projections), ``"pp2"`` (2 pipeline stages, each rank holding its stage's modules under their original
names, as ``torch.distributed.pipelining`` stages are cut) or ``"fsdp2xtp2"`` (a 2-D mesh: TP inside,
FSDP2 across). :func:`build` makes the model and an AdamW with one step of state taken on made-up
gradients; :func:`full_state` returns every tensor whole (a collective under TP/FSDP) for comparing.
"""

from __future__ import annotations

import re

import torch

LAYERS = 4
TP_PLAN = {
    "self_attn.q_proj": "col", "self_attn.k_proj": "col", "self_attn.v_proj": "col", "self_attn.o_proj": "row",
    "mlp.gate_proj": "col", "mlp.up_proj": "col", "mlp.down_proj": "row",
}


def parse(layout: str) -> dict[str, int]:
    """``"fsdp2xtp2"`` -> ``{"fsdp": 2, "tp": 2, "pp": 1}``; ``"1"`` -> all ones."""
    sizes = {"fsdp": 1, "tp": 1, "pp": 1}
    if layout != "1":
        for part in layout.split("x"):
            m = re.fullmatch(r"(fsdp|tp|pp)(\d+)", part)
            assert m, f"bad layout {layout!r}"
            sizes[m.group(1)] = int(m.group(2))
    return sizes


def ranks(layout: str) -> int:
    s = parse(layout)
    return s["fsdp"] * s["tp"] * s["pp"]


def keep_stage(model: torch.nn.Module, stage: int, stages: int) -> None:
    """Keep this stage's layers (and the embedding on the first, the norm and head on the last); the other
    modules become parameter-less, so the kept parameters keep their names."""
    per = LAYERS // stages
    for i in range(LAYERS):
        if not stage * per <= i < (stage + 1) * per:
            model.model.layers[i] = torch.nn.Identity()
    if stage != 0:
        model.model.embed_tokens = torch.nn.Identity()
    if stage != stages - 1:
        model.model.norm = torch.nn.Identity()
        model.lm_head = torch.nn.Identity()


def build(layout: str, seed: int, *, dtype: torch.dtype = torch.float32, step: bool = True):
    """The model and optimizer of ``layout`` on this rank (``step``: give AdamW state by one update)."""
    import torch.distributed as dist
    from transformers import LlamaForCausalLM

    from toy import llama_config

    sizes = parse(layout)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(llama_config(num_hidden_layers=LAYERS, tie_word_embeddings=False,
                                          attention_dropout=0.0)).to(dtype)
    if sizes["pp"] > 1:
        keep_stage(model, dist.get_rank(), sizes["pp"])
    if sizes["tp"] > 1 or sizes["fsdp"] > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (sizes["fsdp"], sizes["tp"]), mesh_dim_names=("dp", "tp"))
        if sizes["tp"] > 1:
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            plan = {f"model.layers.{i}.{name}": ColwiseParallel() if kind == "col" else RowwiseParallel()
                    for i in range(LAYERS) for name, kind in TP_PLAN.items()}
            parallelize_module(model, mesh["tp"], plan)
        if sizes["fsdp"] > 1:
            from torch.distributed.fsdp import fully_shard

            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    if step:
        for p in model.parameters():  # made-up gradients of the parameter's own layout
            p.grad = p.detach() * 0.5 + 0.25
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt


def _whole(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.detach().to("cpu").clone()


def full_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """``model/<fqn>`` and ``optim/<fqn>/<state>`` of this rank, each tensor whole."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = {f"model/{k}": _whole(v) for k, v in model.state_dict().items()}
    for p in model.parameters():
        for k, v in opt.state.get(p, {}).items():
            out[f"optim/{names[id(p)]}/{k}"] = _whole(v)
    return out


def union(parts: list[dict]) -> dict:
    """The states of all ranks as one (pipeline stages each hold their own keys; replicas agree)."""
    out: dict = {}
    for part in parts:
        for k, v in part.items():
            if k in out:
                assert torch.equal(out[k], v), f"ranks disagree on {k}"
            out[k] = v
    return out


def assert_same(a: dict, b: dict, where: str) -> None:
    assert a.keys() == b.keys(), f"{where}: keys differ: {sorted(set(a) ^ set(b))[:5]}"
    assert len([k for k in a if k.startswith("optim/")]) > 40, f"{where}: too little optimizer state compared"
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), f"{where}: {k} differs"

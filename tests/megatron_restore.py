"""What the Megatron tests resume into: a Hugging Face model built from ``config`` (any family), in fp32 as Megatron's
optimizer state, FSDP2-sharded when a process group is up, with ``AdamW``, restored by ckptio from ``source``.
Returns the full state (weights and moments, :func:`toy.full_state`) and each parameter's step, for comparing with
Megatron's own. Shared by the test files of each family and layout (run through ``distributed.run_ranks``)."""

from __future__ import annotations

from pathlib import Path

import torch


def restore_with_adam(source: str, config: str) -> dict:
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

"""Megatron's distributed optimizer with several gradient buffers per rank: virtual pipeline stages, expert parallelism.

    python megatron_distopt_chunks.py --pp 2 --vpp 2 --dp 2 --bucket 6192 --out DIR           # VPP: one buffer per chunk
    python megatron_distopt_chunks.py --family mixtral --ep 2 --dp 2 --out DIR                # EP: dense + expert buffers
    python megatron_distopt_chunks.py --family mixtral --pp 2 --vpp 2 --ep 2 --dp 2 --dist --out DIR  # both, + torch_dist

megatron-core 0.16.1 builds each model chunk (``vp_stage=v``), wraps each in its ``DistributedDataParallel`` (bucketing
off for chunks after the first, as Megatron-LM's ``get_model`` does) and makes the optimizer with
``get_megatron_optimizer``: one ``DistributedOptimizer`` over every chunk's dense buffer, and with experts a second
one over the expert-parallel buffers, whose data-parallel group is the expert data-parallel group (DP / EP ranks).
Each of ``--iteration`` steps back-propagates a made-up loss ``sum(p * g)`` (``g`` seeded by the parameter's global
name, the step and the DP rank) through DDP's hooks, so that the real bucketed reduce-scatter runs, then steps.

Saves what Megatron-LM's legacy save does: ``mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt`` (on expert-DP rank 0;
``model0``, ``model1``... with chunks) and ``distrib_optim.pt`` (the optimizer's ``save_parameter_state``: with
experts a list of the two optimizers' states, ``None`` for the dense one where its DP rank is not 0), and
``reference_adam.pt``: every parameter's fp32 state from the optimizers' own bookkeeping, under global names, and
``reference.pt``: the trained model's logits (chunk by chunk and stage by stage, as ``megatron_vpp.chunk_logits``).

``--dist`` also saves torch_dist as Megatron-LM's ``generate_state_dict`` does (``model0``, ``model1``... with chunks,
the optimizer's ``sharded_state_dict`` of them): ``torch_dist/`` with today's metadata (the ``fully_reshardable`` format,
``chained_optim_avoid_prefix``), and ``torch_dist_chained/`` without ``chained_optim_avoid_prefix`` (megatron-core's
default, which Megatron-LM before 0.14 kept): with experts each chained optimizer's tensors under ``chained_N.``.
"""
import argparse
import os
import shutil
import sys
import tempfile
import zlib

import torch
import torch.multiprocessing as mp


def _owner(opt, param):
    """The chained DistributedOptimizer whose gradient buffers hold ``param``."""
    for inner in opt.chained_optimizers:
        if any(param is p for buffer in inner.buffers for p in buffer.params):
            return inner
    raise AssertionError("no optimizer holds the parameter")


def _local_adam(inner, param):
    """One local parameter's fp32 state, each DP rank's owned range gathered over the optimizer's DP group."""
    keys = ("param", "exp_avg", "exp_avg_sq")
    if param in inner.model_param_gbuf_map:
        span = inner._get_model_param_range_map(param)["param"]
        tensors = inner._get_main_param_and_optimizer_states(param)
        mine = (span.start, span.end, {k: tensors[k].detach().clone() for k in keys})
    else:
        mine = (0, 0, {k: torch.empty(0) for k in keys})
    group = inner.data_parallel_group_gloo
    parts = [None] * group.size()
    torch.distributed.all_gather_object(parts, mine, group=group)
    out = {k: torch.full((param.numel(),), float("nan")) for k in keys}
    for start, end, part in parts:
        for k in out:
            out[k][start:end] = part[k]
    assert not any(t.isnan().any() for t in out.values()), "a range of the parameter is owned by no DP rank"
    return {k: t.view(param.shape) for k, t in out.items()}, group.rank()


DIST_SAVES = {"torch_dist": {"distrib_optim_sharding_type": "fully_reshardable", "singleton_local_shards": False,
                             "chained_optim_avoid_prefix": True},
              "torch_dist_chained": {"distrib_optim_sharding_type": "fully_reshardable"}}


def _save_dist(modules, opt, args, out, iteration, rank):
    """Megatron-LM's torch_dist save of the model chunks and their (chained) distributed optimizer, once per
    metadata of :data:`DIST_SAVES`."""
    from argparse import Namespace

    from megatron.core import dist_checkpointing

    for name, metadata in DIST_SAVES.items():
        folder = os.path.join(out, name, f"iter_{iteration:07d}")
        os.makedirs(folder, exist_ok=True)
        torch.distributed.barrier()
        models = {"model": modules[0].sharded_state_dict(metadata=metadata)} if len(modules) == 1 else \
            {f"model{v}": m.sharded_state_dict(metadata=metadata) for v, m in enumerate(modules)}
        state = {"args": Namespace(**{**vars(args), "ckpt_format": "torch_dist"}), "checkpoint_version": 3.0,
                 "iteration": iteration, **models, "optimizer": opt.sharded_state_dict(models, metadata=metadata),
                 "num_floating_point_operations_so_far": 0}
        dist_checkpointing.save(state, folder, content_metadata=metadata)
        if rank == 0:
            with open(os.path.join(out, name, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write(str(iteration))


def worker(rank, tp, pp, vpp, dp, ep, out, iteration, bucket, dist, store_file):
    import megatron_fixture as mf
    import megatron_vpp

    tp_rank, pp_rank, dp_rank = mf.start_distopt_rank(rank, store_file, tp, pp, vpp, dp, ep)
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ep_rank = ps.get_expert_model_parallel_rank()
    offsets = [megatron_vpp.layer_offset(pp_rank, v, pp, vpp) if vpp else pp_rank * (mf.NUM_LAYERS // pp)
               for v in range(vpp or 1)]
    modules = [mf.build_model(tp, pp, vpp=vpp, vp_stage=v if vpp else None) for v in range(vpp or 1)]
    chunks = []
    for v, module in enumerate(modules):
        mf.fill_weights(module, tp, tp_rank, pp_rank, pp, offset=offsets[v])
        ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True,
                                                   overlap_grad_reduce=bucket is not None, bucket_size=bucket)
        chunks.append(DistributedDataParallel(module.config, ddp_config, module, disable_bucketing=v > 0))
    opt = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=1e-3, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, weight_decay=0.01,
        clip_grad=0.0, use_distributed_optimizer=True, params_dtype=torch.float32), chunks)
    for step in range(iteration):
        for chunk in chunks:
            chunk.zero_grad_buffer()
        opt.zero_grad()
        loss = 0.0
        for v, module in enumerate(modules):
            for name, p in module.named_parameters():
                seed = zlib.crc32(f"{mf.global_name(name, offsets[v])}/{step}/{dp_rank}".encode())
                g = 0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(seed))
                loss = loss + (p * g).sum()
        loss.backward()  # DDP's hooks: each bucket's reduce-scatter over its data-parallel group
        finalize_model_grads(chunks)
        ok, _, _ = opt.step()
        assert ok, "the optimizer step was skipped"

    sub = f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp > 1 else "") + (f"_{ep_rank:03d}" if ep > 1 else "")
    folder = os.path.join(out, "legacy", f"iter_{iteration:07d}", sub)
    os.makedirs(folder, exist_ok=True)
    torch.distributed.barrier()
    opt.save_parameter_state(os.path.join(folder, "distrib_optim.pt"))  # each optimizer's DP rank 0 writes
    args = mf.make_args(tp, pp, "torch")
    args.data_parallel_size, args.use_distributed_optimizer = dp, True
    args.overlap_grad_reduce, args.ddp_bucket_size = bucket is not None, bucket
    args.virtual_pipeline_model_parallel_size = vpp
    if vpp:
        args.num_layers_per_virtual_pipeline_stage = mf.NUM_LAYERS // (pp * vpp)
    if ps.get_expert_data_parallel_rank() == 0:  # Megatron-LM: one copy of each expert-parallel shard
        models = {"model": chunks[0].state_dict_for_save_checkpoint()} if not vpp else \
            {f"model{v}": c.state_dict_for_save_checkpoint() for v, c in enumerate(chunks)}
        torch.save({"args": args, "checkpoint_version": 3.0, "iteration": iteration, **models,
                    "optimizer": opt.state_dict(), "rng_state": mf.rng_state(),
                    "num_floating_point_operations_so_far": 0}, os.path.join(folder, "model_optim_rng.pt"))
    if dist:
        _save_dist(modules, opt, args, out, iteration, rank)
    for module in modules:
        module.eval()
    ids = torch.arange(mf.VOCAB).reshape(4, -1)  # every token once: enough to reach every expert of every layer
    logits = megatron_vpp.chunk_logits(modules, ids, tp, pp)
    if logits is not None and tp_rank == 0 and dp_rank == 0:
        torch.save({"input_ids": ids, "logits": logits}, os.path.join(out, "reference.pt"))

    local = {}
    for v, module in enumerate(modules):
        for name, p in module.named_parameters():
            state, group_rank = _local_adam(_owner(opt, p), p)
            if group_rank == 0:
                local[mf.global_name(name, offsets[v])] = state
    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, (tp_rank, local))
    if rank == 0:
        steps = opt.state_dict()
        steps = steps if isinstance(steps, list) else [steps]
        step = {float(g["step"]) for s in steps for g in s["optimizer"]["param_groups"]}
        assert len(step) == 1, step
        parts = {}
        for t, held in everyone:
            for name, state in held.items():
                parts.setdefault(name, {})[t] = state
        ref = {name: {k: mf._whole(name, [by_tp[t][k] for t in range(tp)], tp) for k in by_tp[0]}
               for name, by_tp in parts.items()}
        torch.save({"step": step.pop(), "state": ref}, os.path.join(out, "reference_adam.pt"))
        with open(os.path.join(out, "legacy", "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(iteration))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--vpp", type=int, default=None)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--family", default="llama")
    ap.add_argument("--hidden", type=int, default=48)
    ap.add_argument("--bucket", type=int, default=None)
    ap.add_argument("--iteration", type=int, default=2)
    ap.add_argument("--dist", action="store_true", help="also save torch_dist (torch_dist/, torch_dist_chained/)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    os.environ.update(MEGATRON_FIXTURE_FAMILY=a.family, MEGATRON_FIXTURE_EP=str(a.ep),
                      MEGATRON_FIXTURE_HIDDEN=str(a.hidden))  # read by megatron_fixture at import
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import megatron_fixture as mf

    mf.quiet_megatron()
    import megatron.core.models.gpt  # noqa: F401  (imported once, before the ranks fork)

    tmp = tempfile.mkdtemp(prefix="megatron_distopt_")
    try:
        mp.start_processes(worker, args=(a.tp, a.pp, a.vpp, a.dp, a.ep, a.out, a.iteration, a.bucket, a.dist,
                                         os.path.join(tmp, "store")),
                           nprocs=a.tp * a.pp * a.dp, join=True, start_method="fork")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()

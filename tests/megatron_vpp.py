"""Virtual pipeline stages for ``megatron_fixture.py --vpp V``: each pipeline rank holds V model chunks.

megatron-core builds chunk ``v`` of pipeline stage ``p`` with ``vp_stage=v``: the embedding on chunk 0 of the first
stage, the final norm and output layer on the last chunk of the last stage, and ``L / (P * V)`` layers per chunk
starting at global layer ``v * L / V + p * L / (P * V)`` (``get_transformer_layer_offset``). Hidden states go
(stage 0, chunk 0) -> (stage 1, chunk 0) -> ... -> (stage 0, chunk 1) -> ... -> (stage P-1, chunk V-1).

Writes what ``megatron_fixture.worker`` writes (torch_dist through ``dist_checkpointing.save`` of
``{"model0": ..., "model1": ...}``, Megatron-LM's legacy rank files with ``model0``, ``model1``... entries, each
chunk's state dict numbered from 0, and ``reference.pt``), and loads a torch_dist folder strictly, or a legacy
one chunk by chunk with ``load_state_dict(strict=True)``, into the chunks for their logits.
"""
import datetime
import os

import torch

import megatron_fixture as mf


def layer_offset(pp_rank, v, pp, vpp):
    """The global number of chunk ``v``'s first layer on stage ``pp_rank`` (even stages)."""
    return v * (mf.NUM_LAYERS // vpp) + pp_rank * (mf.NUM_LAYERS // (pp * vpp))


def _start(rank, tp, pp, vpp, store_file):
    mf.quiet_megatron()
    torch.distributed.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=tp * pp,
                                         timeout=datetime.timedelta(minutes=2))
    mf.apply_cpu_stubs()
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 virtual_pipeline_model_parallel_size=vpp)
    torch.manual_seed(mf.SEED)
    model_parallel_cuda_manual_seed(mf.SEED)
    return ps


def chunk_logits(chunks, ids, tp, pp):
    """Forward through every (chunk, stage) in turn; the TP-gathered logits on the last stage, else None."""
    from megatron.core import parallel_state as ps

    b, s = ids.shape
    pos = torch.arange(s).unsqueeze(0).expand(b, -1)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]
    stage, out = ps.get_pipeline_model_parallel_rank(), None
    with torch.no_grad():
        for v, chunk in enumerate(chunks):
            if not (v == 0 and stage == 0):
                hidden = torch.empty(s, b, mf.HIDDEN)
                torch.distributed.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank())
                chunk.set_input_tensor(hidden)
            out = chunk(ids, pos, mask)
            if not (v == len(chunks) - 1 and stage == pp - 1):
                torch.distributed.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
    if stage != pp - 1:
        return None
    parts = [torch.empty_like(out) for _ in range(tp)]
    torch.distributed.all_gather(parts, out.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, -1)[..., :mf.VOCAB]


def save_worker(rank, tp, pp, vpp, out, iteration, store_file):
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.optimizer import (get_param_id_to_sharded_param_map,
                                                            optim_state_to_sharding_state)

    ps = _start(rank, tp, pp, vpp, store_file)
    tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    chunks = [mf.build_model(tp, pp, vpp=vpp, vp_stage=v) for v in range(vpp)]
    for v, chunk in enumerate(chunks):
        mf.fill_weights(chunk, tp, tp_rank, pp_rank, pp, offset=layer_offset(pp_rank, v, pp, vpp))
        chunk.eval()
    params = [p for chunk in chunks for p in chunk.parameters()]
    opt = torch.optim.Adam(params, lr=1e-3, betas=(0.9, 0.95), eps=1e-8)  # as megatron_fixture.worker
    for p in params:
        p.grad = p.detach() * 0.5 + 0.25
    opt.step()
    opt.zero_grad(set_to_none=True)
    common = {"checkpoint_version": 3.0, "iteration": iteration, "num_floating_point_operations_so_far": 0}
    iter_name = f"iter_{iteration:07d}"

    models = {f"model{v}": chunk.sharded_state_dict() for v, chunk in enumerate(chunks)}
    optim_sd = opt.state_dict()
    step = next(iter(optim_sd["state"].values()))["step"]
    optim_state_to_sharding_state(optim_sd, get_param_id_to_sharded_param_map(models, params), exclude_keys=("step",))
    optim_sd["state"]["common_step"] = step
    args = mf.make_args(tp, pp, "torch_dist")
    args.virtual_pipeline_model_parallel_size = vpp
    args.num_layers_per_virtual_pipeline_stage = mf.NUM_LAYERS // (pp * vpp)
    sharded = dict(common, args=args, **models, optimizer=optim_sd,
                   rng_state=ShardedObject("rng_state", mf.rng_state(), (pp, tp), (pp_rank, tp_rank), replica_id=0))
    dist_checkpointing.save(sharded, os.path.join(out, "torch_dist", iter_name),
                            content_metadata={"singleton_local_shards": False})

    sub = f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    os.makedirs(os.path.join(out, "legacy", iter_name, sub), exist_ok=True)
    legacy_args = mf.make_args(tp, pp, "torch")
    legacy_args.virtual_pipeline_model_parallel_size = args.virtual_pipeline_model_parallel_size
    legacy_args.num_layers_per_virtual_pipeline_stage = args.num_layers_per_virtual_pipeline_stage
    legacy = {"args": legacy_args, **common}
    for v, chunk in enumerate(chunks):  # Megatron-LM: model0, model1... when there are chunks
        legacy[f"model{v}"] = chunk.state_dict_for_save_checkpoint()
    legacy.update(optimizer=opt.state_dict(), rng_state=mf.rng_state())
    torch.save(legacy, os.path.join(out, "legacy", iter_name, sub, "model_optim_rng.pt"))

    ids = torch.randint(0, mf.VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    logits = chunk_logits(chunks, ids, tp, pp)
    if logits is not None and tp_rank == 0:
        torch.save({"input_ids": ids, "logits": logits}, os.path.join(out, "reference.pt"))
    torch.distributed.barrier()
    if rank == 0:
        for fmt in ("torch_dist", "legacy"):
            with open(os.path.join(out, fmt, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write(str(iteration))
    torch.distributed.destroy_process_group()


def load_worker(rank, tp, pp, vpp, src, out, store_file):
    """Load ``src`` (a torch_dist iteration folder, strictly; or a legacy one, each chunk's entry strictly) into
    fresh chunks and save their logits to ``out``."""
    from megatron.core import dist_checkpointing

    ps = _start(rank, tp, pp, vpp, store_file)
    tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    legacy = os.path.join(src, f"mp_rank_{tp_rank:02d}_{pp_rank:03d}", "model_optim_rng.pt")
    if os.path.exists(legacy):
        obj = torch.load(legacy, weights_only=False)
        assert "model" not in obj and not any(f"model{v}" not in obj for v in range(vpp)), sorted(obj)
        assert obj["args"].virtual_pipeline_model_parallel_size == vpp
        vocab = (obj["model0"] if pp_rank == 0 else None)
    else:
        from torch.distributed.checkpoint import FileSystemReader

        meta = FileSystemReader(src).read_metadata().state_dict_metadata
        vocab = meta["embedding.word_embeddings.weight"].size[0]
    if vocab is not None and not isinstance(vocab, int):
        vocab = vocab["embedding.word_embeddings.weight"].shape[0] * tp
    chunks = [mf.build_model(tp, pp, vocab=vocab or mf.padded_vocab(tp), vpp=vpp, vp_stage=v) for v in range(vpp)]
    if os.path.exists(legacy):
        for v, chunk in enumerate(chunks):
            chunk.load_state_dict(obj[f"model{v}"], strict=True)
    else:
        wanted = {f"model{v}": chunk.sharded_state_dict() for v, chunk in enumerate(chunks)}
        loaded = dist_checkpointing.load(wanted, src)  # strict: every requested key must be in the checkpoint
        for v, chunk in enumerate(chunks):
            chunk.load_state_dict(loaded[f"model{v}"])
    for chunk in chunks:
        chunk.eval()
    ids = torch.randint(0, mf.VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    logits = chunk_logits(chunks, ids, tp, pp)
    if logits is not None and tp_rank == 0:
        torch.save({"input_ids": ids, "logits": logits}, out)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()

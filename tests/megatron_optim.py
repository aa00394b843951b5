"""``megatron_fixture.py --train SRC --out FILE [--dp N]``: megatron-core's own optimizer resumes from a torch_dist
checkpoint and trains one step (TP ranks, one pipeline stage, fp32 on CPU; with ``--dp``: TP x DP ranks and the
``DistributedOptimizer``, loading its ``fully_reshardable`` format). A legacy checkpoint (``mp_rank_TT/``) is loaded
as Megatron-LM's legacy ``load_checkpoint`` does: ``load_state_dict`` of its rank file's entries, and with the
distributed optimizer ``load_parameter_state`` of the ``distrib_optim.pt`` beside it.

Each rank builds its GPTModel shard in megatron-core's ``DistributedDataParallel`` with ``get_megatron_optimizer``
(Adam, non-distributed: ``FP32Optimizer`` over megatron's two parameter groups) and an ``OptimizerParamScheduler``
that takes its values from the checkpoint, then loads SRC as Megatron-LM's ``load_checkpoint`` does for torch_dist:
``dist_checkpointing.load({"model": ..., "optimizer": optimizer.sharded_state_dict(..., is_loading=True)}, strict
"raise_all")``, ``load_state_dict`` of model, optimizer and scheduler. Then one training step on a fixed batch.
FILE gets, per parameter (whole: TP shards merged, vocabulary padding cut), its value, moments and step before and
after the step, its gradient and its group's hyper-parameters at the step, and the loss.

With ``--pp 2 [--vpp V] [--tied]`` a legacy export is loaded stage by stage, chunk by chunk, and trained one step on a
made-up loss (:func:`train_pipeline_worker`); a tied embedding's last-stage copy goes under FILE's ``copies``; with
``--family mixtral --ep E`` too, each expert-parallel rank from its own ``mp_rank_TT_PPP_EEE`` folder.
"""
import datetime
import os

import torch

import megatron_fixture as mf

KEYS = ("exp_avg", "exp_avg_sq")


def _inners(opt):
    """The optimizers megatron-core chains (the dense one, and the experts' with expert parallelism)."""
    return opt.chained_optimizers if hasattr(opt, "chained_optimizers") else [opt]


def _snapshot(opt, module):
    out = {}
    for name, p in module.named_parameters():
        state = next(i.optimizer.state[p] for i in _inners(opt) if p in i.optimizer.state)
        out[name] = {"param": p.detach().clone(), **{k: state[k].detach().clone() for k in KEYS},
                     "step": float(state["step"])}
    return out


def _distributed_snapshot(opt, module):
    """Each parameter's fp32 state as the distributed optimizer holds it (each DP rank's range, gathered over the
    data-parallel group of the optimizer that holds it: the experts' is the expert data-parallel group)."""
    from megatron_distopt_chunks import _local_adam, _owner

    step = {float(g["step"]) for i in _inners(opt) for g in i.state_dict()["optimizer"]["param_groups"]}
    assert len(step) == 1
    step = step.pop()
    return {name: {**_local_adam(_owner(opt, p), p)[0], "step": step} for name, p in module.named_parameters()}


def _keep_step_apart(inner):
    """On CPU (torch's AdamW) the distributed optimizer's load of a fully_reshardable state copies every entry of
    the parameter's state from the checkpoint, ``step`` included, which that format keeps in the groups (TE's and
    apex's Adam have no per-parameter step): the step is left to ``load_state_dict``, which sets it from the groups."""
    set_states = inner._set_main_param_and_optimizer_states

    def without_step(model_param, tensors):
        group, order = inner.model_param_group_index_map[model_param]
        state = inner.optimizer.state[inner.optimizer.param_groups[group]["params"][order]]
        step = state.pop("step", None)
        set_states(model_param, tensors)
        if step is not None:
            state["step"] = step

    inner._set_main_param_and_optimizer_states = without_step


def _load_dist(src, module, opt, sched, distributed):
    """Megatron-LM's load_checkpoint of a torch_dist folder: strict, with the checkpoint's own content metadata
    (how chained optimizers are keyed)."""
    from megatron.core import dist_checkpointing

    model_sd = module.sharded_state_dict()
    metadata = {**(dist_checkpointing.load_content_metadata(src) or {}),
                **({"distrib_optim_sharding_type": "fully_reshardable"} if distributed else {})} or None
    wanted = {"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd, is_loading=True, metadata=metadata)}
    loaded = dist_checkpointing.load(wanted, src, strict="raise_all")
    module.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optimizer"])
    sched.load_state_dict(loaded["opt_param_scheduler"])
    return loaded


def train_worker(rank, tp, dp, src, out, store_file):
    distributed = os.environ.get("MEGATRON_FIXTURE_TRAIN_OPTIMIZER", "distributed" if dp > 1 else "plain") != "plain"
    mf.quiet_megatron()
    torch.distributed.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=tp * dp,
                                         timeout=datetime.timedelta(minutes=2))
    mf.apply_cpu_stubs()
    mf.apply_distopt_cpu_stubs()
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from torch.distributed.checkpoint import FileSystemReader

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=mf.EP)
    torch.manual_seed(mf.SEED)
    model_parallel_cuda_manual_seed(mf.SEED)
    legacy = os.path.join(src, f"mp_rank_{ps.get_tensor_model_parallel_rank():02d}" + (
        f"_{ps.get_expert_model_parallel_rank():03d}" if mf.EP > 1 else ""), "model_optim_rng.pt")
    if os.path.exists(legacy):  # Megatron-LM's legacy layout: each rank's torch.save, Adam's state by position
        obj = torch.load(legacy, weights_only=False)
        vocab = obj["model"]["embedding.word_embeddings.weight"].shape[0] * tp
    else:
        vocab = FileSystemReader(src).read_metadata().state_dict_metadata["embedding.word_embeddings.weight"].size[0]
    module = mf.build_model(tp, 1, vocab=vocab)
    model = DistributedDataParallel(module.config, DistributedDataParallelConfig(
        use_distributed_optimizer=distributed), module)
    # the run's own settings differ from the checkpoint's: what trains must come from the checkpoint
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=5e-2, min_lr=0.0, weight_decay=0.5,
                                                 adam_beta1=0.5, adam_beta2=0.5, adam_eps=1e-3, clip_grad=0.0,
                                                 params_dtype=torch.float32,
                                                 use_distributed_optimizer=distributed), [model])
    sched = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=5e-2, min_lr=0.0, lr_warmup_steps=0, lr_decay_steps=10,
                                    lr_decay_style="cosine", start_wd=0.5, end_wd=0.5, wd_incr_steps=10,
                                    wd_incr_style="constant", use_checkpoint_opt_param_scheduler=True)
    if distributed:  # on CPU the DistributedOptimizer wraps torch's AdamW, which keeps a step per parameter, and its
        # state_dict() (run before loading) asks for one; TE's and apex's Adam keep it in the groups. A fresh step 0:
        for inner in _inners(opt):
            inner.init_state_fn(inner.optimizer, inner.config)
            for state in inner.optimizer.state.values():
                state["step"] = torch.tensor(0.0)
            _keep_step_apart(inner)
    if os.path.exists(legacy):  # as Megatron-LM's load_checkpoint of the legacy layout
        module.load_state_dict(obj["model"], strict=True)
        opt.load_state_dict(obj["optimizer"])
        if distributed:  # its fp32 master copies and moments: the flat buffers of distrib_optim.pt, scattered.
            # megatron-core 0.16.1 copies them in place into its main params, which for fp32 parameters are views
            # of the parameters themselves: autograd refuses that unless gradients are off (its fully_reshardable
            # load is a torch.no_grad method; this one is not)
            with torch.no_grad():
                opt.load_parameter_state(os.path.join(os.path.dirname(legacy), "distrib_optim.pt"))
        sched.load_state_dict(obj["opt_param_scheduler"])
        loaded = {"iteration": obj["iteration"]}
    else:
        loaded = _load_dist(src, module, opt, sched, distributed)

    if distributed:  # its load_state_dict gives every parameter one shared step tensor, which torch's AdamW would
        for inner in _inners(opt):  # increment once per parameter (TE's Adam: the group's step)
            for state in inner.optimizer.state.values():
                state["step"] = state["step"].clone()
    snapshot = (lambda: _distributed_snapshot(opt, module)) if distributed else (lambda: _snapshot(opt, module))
    before = snapshot()
    keys = ("lr", "weight_decay", "betas", "eps", "wd_mult", "is_expert_parallel")
    hyper = {}
    for inner in _inners(opt):
        for group in inner.optimizer.param_groups:
            for p in group["params"]:
                hyper[id(p)] = {k: group[k] for k in keys}
    if distributed:  # the optimizer's groups hold its main params (shards): the model's params by their group
        from megatron_distopt_chunks import _owner

        # megatron's groups: no weight decay on 1-dim params; the experts' in an optimizer of their own
        hyper = {id(p): next({k: g[k] for k in keys} for g in _owner(opt, p).optimizer.param_groups
                             if g["wd_mult"] == (0.0 if p.dim() == 1 else 1.0)) for p in module.parameters()}

    ids = torch.randint(0, mf.VOCAB, (2, 12), generator=torch.Generator().manual_seed(5))
    b, s = ids.shape
    model.zero_grad_buffer()
    opt.zero_grad()
    loss = model(ids, torch.arange(s).unsqueeze(0).expand(b, -1), torch.triu(torch.ones(s, s, dtype=torch.bool), 1)
                 [None, None], labels=ids.roll(-1, 1)).float().mean()
    loss.backward()
    finalize_model_grads([model])
    ok, _, _ = opt.step()
    assert ok, "the optimizer step was skipped"
    after = snapshot()
    local = {mf.global_name(name, 0): {"before": before[name], "after": after[name],
                    "grad": torch.empty(0) if distributed else p.grad.detach().clone(),
                    "hyper": hyper[id(p)]} for name, p in module.named_parameters()}
    _report(rank, tp, dp, local, float(loss), loaded.get("iteration"), out, distributed)


def _report(rank, tp, dp, local, loss, iteration, out, distributed, world=None):
    """Gather every rank's ``local`` (global name: before, after, grad, hyper) on rank 0 and save it to ``out``, each
    parameter whole (TP shards merged); a name ``copy:N`` (a tied embedding's copy on the last stage) goes under
    ``copies``."""
    from megatron.core import parallel_state as ps

    everyone = [None] * (world or tp * dp)
    torch.distributed.all_gather_object(everyone, (ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank(),
                                                   local))
    if rank == 0:
        held = {}
        for t, d, part in everyone:  # DP rank 0's copy of each parameter; with EP, each expert from its EP rank
            for name, value in part.items():
                held.setdefault(t, {}).setdefault(name, value)
        result = {}
        for name in held[0]:
            shards = [held[t][name] for t in range(tp)]
            whole = {when: {k: mf._whole(name, [sh[when][k] for sh in shards], tp) for k in ("param", *KEYS)}
                     for when in ("before", "after")}
            for when in whole:
                whole[when]["step"] = shards[0][when]["step"]
            grad = None if distributed else mf._whole(name, [sh["grad"] for sh in shards], tp)
            result[name] = {**whole, "grad": grad,
                            "hyper": shards[0]["hyper"]}
        copies = {n.removeprefix("copy:"): result.pop(n) for n in list(result) if n.startswith("copy:")}
        torch.save({"params": result, "copies": copies, "loss": loss, "iteration": iteration}, out)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def train_pipeline_worker(rank, tp, pp, vpp, dp, tied, src, out, store_file):
    """``--train`` of a legacy export with ``--pp`` (``--vpp``, ``--tied``): each stage's rank file loaded into its
    model chunks (each in its ``DistributedDataParallel``, bucketing in the first only, as Megatron-LM's
    ``get_model``), megatron-core's optimizer over all of them (plain, or distributed with ``load_parameter_state``),
    then one step on a made-up loss ``sum(p * g)`` (``g`` seeded by the global name) through DDP's hooks and
    ``finalize_model_grads``, which all-reduces a tied embedding's gradient between its first- and last-stage copy."""
    import zlib

    import megatron_vpp
    from megatron_distopt_chunks import _owner

    distributed = os.environ.get("MEGATRON_FIXTURE_TRAIN_OPTIMIZER", "distributed" if dp > 1 else "plain") != "plain"
    tp_rank, pp_rank, dp_rank = mf.start_distopt_rank(rank, store_file, tp, pp, vpp, dp, mf.EP)
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    folder = os.path.join(src, f"mp_rank_{tp_rank:02d}_{pp_rank:03d}" + (  # Megatron-LM appends the EP rank
        f"_{ps.get_expert_model_parallel_rank():03d}" if mf.EP > 1 else ""))
    obj = torch.load(os.path.join(folder, "model_optim_rng.pt"), weights_only=False)
    states = [obj["model"]] if not vpp else [obj[f"model{v}"] for v in range(vpp)]
    vocab = next(t.shape[0] * tp for s in states for k, t in s.items()
                 if k.endswith(("word_embeddings.weight", "output_layer.weight")))
    offsets = [megatron_vpp.layer_offset(pp_rank, v, pp, vpp) if vpp else pp_rank * (mf.NUM_LAYERS // pp)
               for v in range(vpp or 1)]
    modules = [mf.build_model(tp, pp, vocab=vocab, tied=tied, vpp=vpp, vp_stage=v if vpp else None)
               for v in range(vpp or 1)]
    chunks = [DistributedDataParallel(m.config, DistributedDataParallelConfig(use_distributed_optimizer=distributed),
                                      m, disable_bucketing=v > 0) for v, m in enumerate(modules)]
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=5e-2, min_lr=0.0, weight_decay=0.5,
                                                 adam_beta1=0.5, adam_beta2=0.5, adam_eps=1e-3, clip_grad=0.0,
                                                 params_dtype=torch.float32,
                                                 use_distributed_optimizer=distributed), chunks)
    sched = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=5e-2, min_lr=0.0, lr_warmup_steps=0, lr_decay_steps=10,
                                    lr_decay_style="cosine", start_wd=0.5, end_wd=0.5, wd_incr_steps=10,
                                    wd_incr_style="constant", use_checkpoint_opt_param_scheduler=True)
    if distributed:  # as train_worker: torch's AdamW state made before loading, the step kept apart
        for inner in _inners(opt):
            inner.init_state_fn(inner.optimizer, inner.config)
            for state in inner.optimizer.state.values():
                state["step"] = torch.tensor(0.0)
            _keep_step_apart(inner)
    for module, state in zip(modules, states):  # Megatron-LM's legacy load_checkpoint, chunk by chunk
        module.load_state_dict(state, strict=True)
    opt.load_state_dict(obj["optimizer"])
    if distributed:
        with torch.no_grad():
            opt.load_parameter_state(os.path.join(folder, "distrib_optim.pt"))
        for inner in _inners(opt):  # one step tensor per parameter (see train_worker)
            for state in inner.optimizer.state.values():
                state["step"] = state["step"].clone()
    sched.load_state_dict(obj["opt_param_scheduler"])

    def global_named():
        for v, module in enumerate(modules):
            for name, p in module.named_parameters():
                name = mf.global_name(name, offsets[v])
                yield (f"copy:{name}" if tied and name == "output_layer.weight" else name), module, p

    def snapshot():
        out = {}
        for v, module in enumerate(modules):
            held = _distributed_snapshot(opt, module) if distributed else _snapshot(opt, module)
            out.update({mf.global_name(n, offsets[v]): s for n, s in held.items()})
        return {name: out[name.removeprefix("copy:")] for name, _, _ in global_named()}

    before = snapshot()
    keys = ("lr", "weight_decay", "betas", "eps", "wd_mult", "is_expert_parallel")
    groups = {id(p): g for inner in _inners(opt) for g in inner.optimizer.param_groups for p in g["params"]}
    hyper = {name: {k: groups[id(p)][k] for k in keys} if not distributed else next(
        {k: g[k] for k in keys} for g in _owner(opt, p).optimizer.param_groups
        if g["wd_mult"] == (0.0 if p.dim() == 1 else 1.0)) for name, _, p in global_named()}
    for chunk in chunks:
        chunk.zero_grad_buffer()
    opt.zero_grad()
    loss = 0.0
    for name, _, p in global_named():
        seed = zlib.crc32(f"{name}/{dp_rank}".encode())
        loss = loss + (p * torch.randn(p.shape, generator=torch.Generator().manual_seed(seed))).sum()
    loss.backward()
    finalize_model_grads(chunks)
    ok, _, _ = opt.step()
    assert ok, "the optimizer step was skipped"
    after = snapshot()
    local = {name: {"before": before[name], "after": after[name], "hyper": hyper[name],
                    "grad": torch.empty(0) if distributed else p.main_grad.detach().clone()}
             for name, _, p in global_named()}
    _report(rank, tp, dp, local, float(loss), obj.get("iteration"), out, distributed, world=tp * pp * dp)

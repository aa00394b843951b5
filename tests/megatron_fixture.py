"""Real Megatron checkpoints of a tiny Llama-style GPT on CPU, made and read by megatron-core itself.

    python megatron_fixture.py --tp T --pp P --out DIR [--iteration 2]          # write checkpoints
    python megatron_fixture.py --tp T --pp P --load SRC --out FILE              # load one, save its logits
    ... --family qwen2                                                          # Qwen2-style: q/k/v biases
    ... --family qwen3                                                          # Qwen3-style: q/k norms
    ... --family mixtral --ep E                                                 # Mixtral-style experts over EP=E
    ... --family qwen2moe --ep E [--norm-topk]                                  # Qwen2-MoE: + a gated shared expert
    ... --family qwen3moe --ep E [--norm-topk]                                  # Qwen3-MoE: experts + q/k norms

Used by ``tests/test_megatron_core.py``; needs the ``megatron-core`` package (a test extra).

Starts T*P gloo processes (torch.multiprocessing; rendezvous through a file store, no TCP port).
Each rank builds its shard of a GPTModel (local spec: RMSNorm, rope, GQA, SwiGLU, no biases,
untied embeddings, fp32). ``--family qwen2`` (Megatron-LM's ``--add-qkv-bias``) adds biases to the fused
query/key/value projection and uses Qwen2's norm epsilon (1e-6) and rotary base (1e6); ``--family qwen3``
(``--qk-layernorm``) adds an RMSNorm on each query and key head instead, with the same epsilon and base.
All ranks fill their shards from one full set of weights that depends only on a fixed seed. So
every (T, P) layout holds the same model and the layouts can be compared with each other. Each
rank then does one torch.optim.Adam step with made-up gradients, so exp_avg/exp_avg_sq exist.

Writes:
  DIR/torch_dist/latest_checkpointed_iteration.txt, DIR/torch_dist/iter_XXXXXXX/
      megatron.core.dist_checkpointing.save of model + Adam moments + rng_state, as sharded
      tensors. The common part (args, iteration, ...) goes to common.pt.
  DIR/legacy/latest_checkpointed_iteration.txt, DIR/legacy/iter_XXXXXXX/mp_rank_TT[_PPP]/model_optim_rng.pt
      Megatron-LM "torch" format: one torch.save per TP/PP rank.
  DIR/reference.pt
      {'input_ids': (2, 12) LongTensor, 'logits': (2, 12, 128)}. The logits are the saved model's
      output, gathered over TP (pipeline stages run in turn) and cut to the real vocab of 128.

With --load: builds the model for T x P with the padded vocabulary the checkpoint SRC (a torch_dist
iteration folder) holds, loads it with ``megatron.core.dist_checkpointing.load`` (strict, resharding as
Megatron does) and writes {'input_ids', 'logits'} for the same input ids to FILE.
"""
import argparse
import datetime
import os
import shutil
import tempfile
import warnings
import zlib

import torch
import torch.multiprocessing as mp

# Tiny model; the names follow Megatron-LM's argument names.
# (--hidden 48 makes the norms' 48 elements no multiple of the distributed optimizer's 64-element alignment)
HIDDEN = int(os.environ.get("MEGATRON_FIXTURE_HIDDEN", "64"))
NUM_LAYERS, FFN, HEADS, GROUPS, KV_CH = 4, 2 * HIDDEN, 4, 2, HIDDEN // 4
VOCAB, MAX_POS = 128, 64
# the model family (--family; an environment variable so that spawned ranks see it too)
FAMILY = os.environ.get("MEGATRON_FIXTURE_FAMILY", "llama")


def family_settings(family):
    """(q/k/v biases, q/k norms, norm epsilon, rotary base) of a family: the Qwens' epsilon and base, Mixtral's."""
    eps, base = {"llama": (1e-5, 10000), "mixtral": (1e-5, 1000000)}.get(family, (1e-6, 1000000))
    return family in ("qwen2", "qwen2moe"), family in ("qwen3", "qwen3moe"), eps, base


QKV_BIAS, QK_NORM, EPS, ROPE_BASE = family_settings(FAMILY)
# --family mixtral: every MLP a mixture of EXPERTS SwiGLU experts of MOE_FFN, TOPK of them per token (SequentialMLP,
# softmax over the top-k router logits), spread over --ep expert-parallel ranks (the data-parallel ranks)
EXPERTS, TOPK, MOE_FFN = 4, 2, HIDDEN // 2
EP = int(os.environ.get("MEGATRON_FIXTURE_EP", "1"))
# --family qwen2moe: the same experts (and Qwen2's q/k/v biases), plus a shared expert of SHARED_FFN gated by a sigmoid
# (moe_shared_expert_gate), routed as Qwen2-MoE's norm_topk_prob=False (softmax over all experts, top-k, not
# renormalised: moe_router_pre_softmax), or with --norm-topk as Mixtral (norm_topk_prob=True); --family qwen3moe: the
# same experts and routing with Qwen3's q/k norms, no shared expert, no biases
SHARED_FFN = 3 * HIDDEN // 4
NORM_TOPK = os.environ.get("MEGATRON_FIXTURE_NORM_TOPK") == "1"


def moe_family():
    return FAMILY in ("mixtral", "qwen2moe", "qwen3moe")
# --make-vocab-size-divisible-by of the run (Megatron-LM's default 128); --divisible-by sets it for the ranks
DIVISIBLE_BY = int(os.environ.get("MEGATRON_FIXTURE_DIVISIBLE_BY", "128"))
SEED = 1234
# with --dp: also save torch_dist, the distributed optimizer in these sharding formats (--dist-formats)
DIST_FORMATS = [f for f in os.environ.get("MEGATRON_FIXTURE_DIST_FORMATS", "").split(",") if f]
# with --dp: train in bf16 (--bf16; an environment variable so that spawned ranks see it too)
BF16 = os.environ.get("MEGATRON_FIXTURE_BF16") == "1"


def padded_vocab(tp):
    """Megatron-LM pads the vocab to a multiple of make_vocab_size_divisible_by * TP."""
    multiple = DIVISIBLE_BY * tp
    return (VOCAB + multiple - 1) // multiple * multiple


def quiet_megatron():
    """megatron-core warns at import about missing Apex / Transformer Engine etc.: noise here."""
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")


def apply_cpu_stubs():
    """The least CUDA faking megatron-core needs for model build, forward and checkpoint save."""
    # megatron passes torch.cuda.current_device() as device= (rope inv_freq, some buffers).
    torch.cuda.current_device = lambda: "cpu"
    # dist_checkpointing's filesystem writer calls torch.cuda.synchronize() before writing.
    torch.cuda.synchronize = lambda *a, **k: None
    # model_parallel_cuda_manual_seed / CudaRNGStatesTracker (used by attention dropout's fork())
    # and the checkpoint's rng_state read and write the "CUDA" RNG. Back it with a CPU generator.
    # So the saved cuda_rng_state / rng_tracker_states are CPU Mersenne states (5056 bytes),
    # not 16-byte Philox states.
    import megatron.core.tensor_parallel.random as mrandom

    gen = torch.Generator()
    torch.cuda.manual_seed = lambda seed: gen.manual_seed(int(seed))
    torch.cuda.get_rng_state = lambda device="cuda": gen.get_state()
    mrandom._get_cuda_rng_state = lambda *a, **k: gen.get_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: gen.set_state(state)
    # the router's gating linear asks for Transformer Engine's GEMM by a name megatron-core 0.16.1 defines only
    # when Transformer Engine is installed: without it, the plain matmul
    import megatron.core.transformer.moe.moe_utils as moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def apply_distopt_cpu_stubs():
    """What the distributed optimizer needs beyond :func:`apply_cpu_stubs`: its flag and norm tensors are made
    with ``device='cuda'`` (made on the CPU here), and it sorts parameters by ``Tensor.type()`` names, which say
    ``torch.cuda.FloatTensor`` for its fp32 parameters (a CPU tensor answers with that name here); a tied
    embedding is moved with ``.cuda()`` before its stages sync it (it stays where it is)."""
    def on_cpu(make):
        def made(*args, device=None, **kwargs):
            return make(*args, device="cpu" if device == "cuda" else device, **kwargs)
        return made

    for name in ("tensor", "zeros", "empty", "ones"):
        setattr(torch, name, on_cpu(getattr(torch, name)))
    type_of = torch.Tensor.type

    def cuda_type_name(self, *args, **kwargs):
        name = type_of(self, *args, **kwargs)
        return name.replace("torch.", "torch.cuda.", 1) if not args and not kwargs and isinstance(name, str) else name

    torch.Tensor.type = cuda_type_name
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # a tied embedding's copies are synced "on the GPU"


def start_distopt_rank(rank, store_file, tp, pp, vpp, dp, ep):
    """A rank of a distributed-optimizer run: its gloo group (``tp * pp * dp`` ranks), the CPU stubs,
    megatron-core's model-parallel state (``vpp`` chunks, ``ep`` expert ranks) and the fixture's seeds. Returns its
    tensor-, pipeline- and data-parallel ranks."""
    quiet_megatron()
    torch.distributed.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank,
                                         world_size=tp * pp * dp, timeout=datetime.timedelta(minutes=2))
    apply_cpu_stubs()
    apply_distopt_cpu_stubs()
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 virtual_pipeline_model_parallel_size=vpp, expert_model_parallel_size=ep)
    torch.manual_seed(SEED)
    model_parallel_cuda_manual_seed(SEED)
    return ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(), ps.get_data_parallel_rank()


def full_weight(name, full_shape, rows=None):
    """Deterministic full (unsharded) tensor for a global parameter name, the same for any layout.
    If `rows` is given (the vocab matrices), only rows[:rows] come from the name's seed. The padding
    rows below them are extra random rows and depend on the padded size."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    if name.endswith("layernorm.weight"):
        return 1.0 + 0.1 * torch.randn(full_shape, generator=g)  # non-unit norms
    if rows is None:
        return 0.1 * torch.randn(full_shape, generator=g)
    real = 0.1 * torch.randn((rows,) + tuple(full_shape[1:]), generator=g)
    pad = 0.1 * torch.randn((full_shape[0] - rows,) + tuple(full_shape[1:]), generator=g)
    return torch.cat([real, pad])


def tp_slice(name, local_shape, tp, rank):
    """Return (full_shape, fn(full) -> this TP rank's shard) for a local parameter."""
    if name.endswith("linear_fc1.weight"):
        # SwiGLU fc1 is [gate; up]. Each TP rank holds [gate_shard; up_shard].
        full = (local_shape[0] * tp,) + tuple(local_shape[1:])
        return full, lambda t: torch.cat([half.chunk(tp)[rank] for half in t.chunk(2)])
    if name.endswith(("linear_qkv.weight", "linear_qkv.bias", "word_embeddings.weight", "output_layer.weight")):
        # Column parallel. qkv rows are grouped per query group, so TP shards hold whole groups.
        return (local_shape[0] * tp,) + tuple(local_shape[1:]), lambda t: t.chunk(tp, 0)[rank]
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):  # row parallel
        return (local_shape[0], local_shape[1] * tp), lambda t: t.chunk(tp, 1)[rank]
    return tuple(local_shape), lambda t: t  # norms: replicated


def build_model(tp, pp, vocab=None, tied=False, vpp=None, vp_stage=None):
    """This rank's GPTModel (with ``vpp``: its model chunk ``vp_stage`` of the virtual pipeline stages)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=NUM_LAYERS, hidden_size=HIDDEN, ffn_hidden_size=FFN,
        num_attention_heads=HEADS, num_query_groups=GROUPS, kv_channels=KV_CH,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        normalization="RMSNorm", layernorm_epsilon=EPS, add_bias_linear=False, add_qkv_bias=QKV_BIAS,
        qk_layernorm=QK_NORM,
        hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False,
        masked_softmax_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False,
        # Create empty CPU params. The weights are filled in later by fill_weights().
        use_cpu_initialization=True, perform_initialization=False,
        params_dtype=torch.float32, pipeline_dtype=torch.float32,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
        **moe_config(),
    )
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=QK_NORM,
                                                        num_experts=EXPERTS if moe_family() else None),
        vocab_size=vocab or padded_vocab(tp), max_sequence_length=MAX_POS,
        pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
        post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
        share_embeddings_and_output_weights=tied, position_embedding_type="rope",
        rotary_percent=1.0, rotary_base=ROPE_BASE, vp_stage=vp_stage,
    )


def moe_config():
    """The MoE fields of the TransformerConfig (none for a dense family): Mixtral's routing, no token dropping."""
    if not moe_family():
        return {}
    return dict(num_moe_experts=EXPERTS, moe_router_topk=TOPK, moe_ffn_hidden_size=MOE_FFN, moe_grouped_gemm=False,
                moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.02,
                moe_router_pre_softmax=FAMILY in ("qwen2moe", "qwen3moe") and not NORM_TOPK,
                moe_router_score_function="softmax", moe_token_dispatcher_type="allgather",
                expert_model_parallel_size=EP, **(dict(
                    moe_shared_expert_intermediate_size=SHARED_FFN, moe_shared_expert_gate=True)
                    if FAMILY == "qwen2moe" else {}))


def global_name(name, layer_offset):
    """A parameter's name in the whole model: the layer numbered over all stages, a local expert by its global
    index (this expert-parallel rank's experts follow the earlier ranks')."""
    from megatron.core import parallel_state as ps

    parts = name.split(".")
    if name.startswith("decoder.layers."):
        parts[2] = str(int(parts[2]) + layer_offset)
    if "local_experts" in parts:
        at = parts.index("local_experts")
        j = int(parts[at + 1]) + ps.get_expert_model_parallel_rank() * (EXPERTS // EP)
        parts[at:at + 2] = [str(j)]
    return ".".join(parts)


def fill_weights(model, tp, tp_rank, pp_rank, pp, tied=False, offset=None):
    """Copy this rank's slice of the seeded full weights into the model (``offset``: its first layer's number)."""
    layer_offset = pp_rank * (NUM_LAYERS // pp) if offset is None else offset  # local numbering restarts per stage
    with torch.no_grad():
        for name, p in model.named_parameters():
            gname = global_name(name, layer_offset)  # local layer numbering restarts on each stage
            if tied and gname == "output_layer.weight":  # a later stage's copy of the tied embedding
                gname = "embedding.word_embeddings.weight"
            full_shape, shard = tp_slice(name, p.shape, tp, tp_rank)
            is_vocab = name.endswith(("word_embeddings.weight", "output_layer.weight"))
            p.copy_(shard(full_weight(gname, full_shape, VOCAB if is_vocab else None)))


def make_args(tp, pp, fmt):
    """The Megatron-LM argument names a converter reads from checkpoint['args']."""
    import signal
    from argparse import Namespace

    from megatron.core.transformer.enums import AttnBackend

    moe = {}
    if moe_family():  # Megatron-LM's own names: --num-experts, --moe-*, --expert-model-parallel-size
        moe = {("num_experts" if k == "num_moe_experts" else k): v for k, v in moe_config().items()}
    return Namespace(**moe,
        num_layers=NUM_LAYERS, hidden_size=HIDDEN, ffn_hidden_size=FFN,
        num_attention_heads=HEADS, num_query_groups=GROUPS, group_query_attention=True,
        kv_channels=KV_CH, padded_vocab_size=padded_vocab(tp), vocab_size=VOCAB,
        make_vocab_size_divisible_by=DIVISIBLE_BY, max_position_embeddings=MAX_POS, seq_length=MAX_POS,
        norm_epsilon=EPS, rotary_base=ROPE_BASE, rotary_percent=1.0, rotary_interleaved=False,
        position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
        global_batch_size=1, untie_embeddings_and_output_weights=True, add_bias_linear=False, add_qkv_bias=QKV_BIAS, qk_layernorm=QK_NORM,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, data_parallel_size=1,
        params_dtype=torch.float32, fp16=False, bf16=False, transformer_impl="local",
        attention_backend=AttnBackend.auto, exit_signal=signal.SIGTERM, ckpt_format=fmt,
    )


def rng_state():
    """One rng-state dict per DP rank (DP=1 here), laid out as Megatron-LM saves it."""
    import random

    import numpy as np
    from megatron.core import tensor_parallel

    return [{
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": torch.cuda.get_rng_state(),
        "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }]


def pipeline_logits(model, input_ids, tp):
    """Forward through all PP stages in turn (hidden states go over send/recv). Returns the
    TP-gathered logits on the last stage and None on the other stages."""
    from megatron.core import parallel_state as ps

    b, s = input_ids.shape
    pos = torch.arange(s).unsqueeze(0).expand(b, -1)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]  # True = masked
    with torch.no_grad():
        if not ps.is_pipeline_first_stage():
            hidden = torch.empty(s, b, HIDDEN)  # [seq, batch, hidden] between stages
            torch.distributed.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(hidden)
        out = model(input_ids, pos, mask)
        if not ps.is_pipeline_last_stage():
            torch.distributed.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
            return None
    parts = [torch.empty_like(out) for _ in range(tp)]  # out: [b, s, vocab/tp]
    torch.distributed.all_gather(parts, out.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, -1)[..., :VOCAB]


def worker(rank, tp, pp, out, iteration, store_file):
    import random

    import numpy as np

    quiet_megatron()

    torch.distributed.init_process_group(  # short timeout: a failed rank must not hang the others
        "gloo", init_method=f"file://{store_file}", rank=rank, world_size=tp * pp * EP,
        timeout=datetime.timedelta(minutes=2))
    apply_cpu_stubs()
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map, optim_state_to_sharding_state)
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 expert_model_parallel_size=EP)
    random.seed(SEED)
    np.random.seed(SEED)
    torch.manual_seed(SEED)
    model_parallel_cuda_manual_seed(SEED)
    tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()

    model = build_model(tp, pp)
    fill_weights(model, tp, tp_rank, pp_rank, pp)
    model.eval()

    # One Adam step with deterministic elementwise gradients. Adam is elementwise too, so the
    # updated full weights and moments are still the same in every layout.
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    for p in model.parameters():
        p.grad = p.detach() * 0.5 + 0.25
    opt.step()
    opt.zero_grad(set_to_none=True)
    sched = {"max_lr": 1e-3, "min_lr": 1e-4, "lr_warmup_steps": 0, "lr_decay_steps": 100,
             "lr_decay_style": "cosine", "num_steps": iteration, "start_wd": 0.0, "end_wd": 0.0,
             "wd_incr_steps": 100, "wd_incr_style": "constant"}
    common = {"checkpoint_version": 3.0, "iteration": iteration, "opt_param_scheduler": sched,
              "num_floating_point_operations_so_far": 0}
    iter_name = f"iter_{iteration:07d}"

    # (a) torch_dist. Sharded tensors (model + Adam moments) go to .distcp files. Everything
    # else in the dict is the common state, which rank 0 writes to common.pt.
    model_sd = model.sharded_state_dict()
    optim_sd = opt.state_dict()
    id_map = get_param_id_to_sharded_param_map(model_sd, model.parameters())
    step = next(iter(optim_sd["state"].values()))["step"]
    # -> 'optimizer.state.exp_avg.<model key>' / 'optimizer.state.exp_avg_sq.<model key>'
    optim_state_to_sharding_state(optim_sd, id_map, exclude_keys=("step",))
    optim_sd["state"]["common_step"] = step  # Megatron stores one shared step
    sharded_sd = dict(
        common, args=make_args(tp, pp, "torch_dist"), model=model_sd, optimizer=optim_sd,
        rng_state=ShardedObject("rng_state", rng_state(), (pp, tp), (pp_rank, tp_rank), replica_id=ps.get_data_parallel_rank()),
    )
    dist_dir = os.path.join(out, "torch_dist", iter_name)
    dist_checkpointing.save(sharded_sd, dist_dir, content_metadata={"singleton_local_shards": False})

    # (b) legacy "torch" format: one file per TP/PP rank, per-layer names, stage-local layer ids.
    sub = f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    if EP > 1:  # Megatron-LM's get_checkpoint_name: the expert-parallel rank last, after the pipeline's if any
        sub += f"_{ps.get_expert_model_parallel_rank():03d}"
    os.makedirs(os.path.join(out, "legacy", iter_name, sub), exist_ok=True)
    legacy = dict(
        args=make_args(tp, pp, "torch"), **common, model=model.state_dict_for_save_checkpoint(),
        optimizer=opt.state_dict(), rng_state=rng_state(),
    )
    # Megatron-LM's key order
    order = ["args", "checkpoint_version", "iteration", "model", "optimizer", "opt_param_scheduler",
             "rng_state", "num_floating_point_operations_so_far"]
    if ps.get_expert_data_parallel_rank() == 0:  # as Megatron-LM: one copy of each expert-parallel shard
        torch.save({k: legacy[k] for k in order}, os.path.join(out, "legacy", iter_name, sub, "model_optim_rng.pt"))

    # (c) reference logits from the saved weights
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    logits = pipeline_logits(model, ids, tp)
    if logits is not None and tp_rank == 0 and ps.get_data_parallel_rank() == 0:
        torch.save({"input_ids": ids, "logits": logits}, os.path.join(out, "reference.pt"))

    torch.distributed.barrier()
    if rank == 0:
        for fmt in ("torch_dist", "legacy"):
            with open(os.path.join(out, fmt, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write(str(iteration))
    torch.distributed.destroy_process_group()


def _local_adam(opt, param):
    """Megatron's own fp32 state of one local (TP-shard) parameter: each DP rank's owned range, put together.

    Uses the distributed optimizer's own bookkeeping (which range of the parameter this DP rank owns, its main
    param and Adam tensors for that range), gathered over the data-parallel group: an account of the state
    independent of the flat buffers ``save_parameter_state`` writes."""
    from megatron.core import parallel_state as ps

    inner = opt.chained_optimizers[0] if hasattr(opt, "chained_optimizers") else opt
    keys = ("param", "exp_avg", "exp_avg_sq")
    if param in inner.model_param_gbuf_map:  # this DP rank owns part of the parameter
        span = inner._get_model_param_range_map(param)["param"]
        tensors = inner._get_main_param_and_optimizer_states(param)
        mine = (span.start, span.end, {k: tensors[k].detach().clone() for k in keys})
    else:
        mine = (0, 0, {k: torch.empty(0) for k in keys})
    parts = [None] * ps.get_data_parallel_world_size()
    torch.distributed.all_gather_object(parts, mine, group=ps.get_data_parallel_group_gloo())
    out = {k: torch.full((param.numel(),), float("nan")) for k in keys}
    for start, end, part in parts:
        for k in out:
            out[k][start:end] = part[k]
    assert not any(t.isnan().any() for t in out.values()), "a range of the parameter is owned by no DP rank"
    return {k: t.view(param.shape) for k, t in out.items()}


def _whole(name, local, tp):
    """The whole tensor of a parameter from its TP shards (TP rank order), as tp_slice splits it; vocab rows cut."""
    if name.endswith("linear_fc1.weight"):
        halves = [t.chunk(2) for t in local]
        whole = torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    elif name.endswith(("linear_qkv.weight", "linear_qkv.bias", "word_embeddings.weight", "output_layer.weight")):
        whole = torch.cat(local)
    elif name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        whole = torch.cat(local, 1)
    else:
        whole = local[0]
    return whole[:VOCAB] if name.endswith(("word_embeddings.weight", "output_layer.weight")) else whole


def _train_step(model, module, ids, pp):
    """Forward and backward of one batch; with two pipeline stages the hidden states and their gradient go over
    send/recv between them (the first stage's output, the last stage's input)."""
    from megatron.core import parallel_state as ps

    b, s = ids.shape
    pos = torch.arange(s).unsqueeze(0).expand(b, -1)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]
    labels = ids.roll(-1, 1)
    if pp == 1:
        model(ids, pos, mask, labels=labels).float().mean().backward()
    elif ps.is_pipeline_first_stage():
        hidden = model(ids, pos, mask)
        torch.distributed.send(hidden.detach().contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
        grad = torch.empty_like(hidden)
        torch.distributed.recv(grad, src=ps.get_pipeline_model_parallel_next_rank())
        hidden.backward(grad)
    else:
        hidden = torch.empty(s, b, HIDDEN, dtype=torch.bfloat16 if BF16 else torch.float32)
        torch.distributed.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank())
        hidden.requires_grad_(True)
        module.set_input_tensor(hidden)
        model(ids, pos, mask, labels=labels).float().mean().backward()
        torch.distributed.send(hidden.grad.contiguous(), dst=ps.get_pipeline_model_parallel_prev_rank())


def distopt_worker(rank, tp, pp, dp, out, iteration, bucket, tied, store_file):
    """Train with Megatron's distributed optimizer on TP x PP x DP ranks and save Megatron-LM's legacy layout:
    ``mp_rank_TT[_PPP]/model_optim_rng.pt`` (DP rank 0) and ``distrib_optim.pt`` (``save_parameter_state``)."""
    import random

    import numpy as np

    quiet_megatron()
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{store_file}", rank=rank, world_size=tp * pp * dp,
        timeout=datetime.timedelta(minutes=2))
    apply_cpu_stubs()
    apply_distopt_cpu_stubs()
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    random.seed(SEED)
    np.random.seed(SEED)
    torch.manual_seed(SEED)
    model_parallel_cuda_manual_seed(SEED)
    tp_rank, pp_rank, dp_rank = (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
                                 ps.get_data_parallel_rank())

    module = build_model(tp, pp, tied=tied)
    fill_weights(module, tp, tp_rank, pp_rank, pp, tied=tied)
    chunk = module
    if BF16:  # as Megatron-LM's --bf16: the model in bf16, fp32 master copies in the optimizer
        from megatron.core.transformer.module import Float16Module

        module.config.bf16 = True
        chunk = Float16Module(module.config, module)
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=bucket is not None,
                                               bucket_size=bucket)
    model = DistributedDataParallel(module.config, ddp_config, chunk)
    opt = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=1e-3, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, weight_decay=0.01,
        clip_grad=0.0, use_distributed_optimizer=True, bf16=BF16,
        params_dtype=torch.bfloat16 if BF16 else torch.float32), [model])
    for step in range(iteration):  # each DP rank its own batch; every TP and PP rank of it the same
        ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(100 * step + dp_rank))
        model.zero_grad_buffer()
        opt.zero_grad()
        _train_step(model, module, ids, pp)
        finalize_model_grads([model])  # DP reduce-scatter, and a tied embedding's grads over the first/last stage
        ok, _, _ = opt.step()
        assert ok, "the optimizer step was skipped"

    sub = f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    folder = os.path.join(out, "legacy", f"iter_{iteration:07d}", sub)
    os.makedirs(folder, exist_ok=True)
    torch.distributed.barrier()
    opt.save_parameter_state(os.path.join(folder, "distrib_optim.pt"))  # collective over DP; DP rank 0 writes
    args = make_args(tp, pp, "torch")
    args.data_parallel_size, args.use_distributed_optimizer = dp, True
    args.overlap_grad_reduce, args.ddp_bucket_size = bucket is not None, bucket
    args.untie_embeddings_and_output_weights = not tied
    if BF16:
        args.bf16, args.params_dtype = True, torch.bfloat16
    sched = {"max_lr": 1e-3, "min_lr": 1e-4, "lr_warmup_steps": 0, "lr_decay_steps": 100,
             "lr_decay_style": "cosine", "num_steps": iteration, "start_wd": 0.01, "end_wd": 0.01,
             "wd_incr_steps": 100, "wd_incr_style": "constant"}
    if dp_rank == 0:
        state = {"args": args, "checkpoint_version": 3.0, "iteration": iteration,
                 "model": model.state_dict_for_save_checkpoint(), "optimizer": opt.state_dict(),
                 "opt_param_scheduler": sched, "rng_state": rng_state(), "num_floating_point_operations_so_far": 0}
        torch.save(state, os.path.join(folder, "model_optim_rng.pt"))

    for fmt in DIST_FORMATS:  # --dist-formats: torch_dist too, the optimizer in megatron-core's sharding format
        _save_dist_distopt(module, opt, args, sched, os.path.join(out, f"torch_dist_{fmt}"), iteration, fmt, rank)

    # Megatron's own state of every parameter, whole (gathered over DP, then over TP and PP), for the tests
    offset = pp_rank * (NUM_LAYERS // pp)
    local = {}
    for name, p in module.named_parameters():
        state = _local_adam(opt, p)
        if name.startswith("decoder.layers."):
            parts = name.split(".")
            name = ".".join(parts[:2] + [str(int(parts[2]) + offset)] + parts[3:])
        if not (tied and name == "output_layer.weight"):  # the last stage's copy of the tied embedding
            local[name] = state
    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, (tp_rank, dp_rank, local))
    if rank == 0:
        step = {float(g["step"]) for g in opt.state_dict()["optimizer"]["param_groups"]}
        assert len(step) == 1
        parts = {}
        for t, d, held in everyone:
            for name, state in held.items():
                if d == 0:
                    parts.setdefault(name, {})[t] = state
        ref = {name: {k: _whole(name, [by_tp[t][k] for t in range(tp)], tp) for k in by_tp[0]}
               for name, by_tp in parts.items()}
        torch.save({"step": step.pop(), "state": ref}, os.path.join(out, "reference_adam.pt"))
        with open(os.path.join(out, "legacy", "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(iteration))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _save_dist_distopt(module, opt, legacy_args, sched, run, iteration, fmt, rank):
    """Megatron-LM's torch_dist save of a DistributedOptimizer run: model and optimizer sharded state dicts (the
    optimizer's in sharding format ``fmt``) through ``dist_checkpointing.save``, into the run folder ``run``."""
    from argparse import Namespace

    from megatron.core import dist_checkpointing

    folder = os.path.join(run, f"iter_{iteration:07d}")
    os.makedirs(folder, exist_ok=True)
    torch.distributed.barrier()
    model_sd = module.sharded_state_dict()
    state = {"args": Namespace(**{**vars(legacy_args), "ckpt_format": "torch_dist"}), "checkpoint_version": 3.0,
             "iteration": iteration, "model": model_sd,
             "optimizer": opt.sharded_state_dict(model_sd, metadata={"distrib_optim_sharding_type": fmt}),
             "opt_param_scheduler": sched, "num_floating_point_operations_so_far": 0}
    dist_checkpointing.save(state, folder, content_metadata={"singleton_local_shards": False})
    if rank == 0:
        with open(os.path.join(run, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(iteration))


def load_worker(rank, tp, pp, src, out, store_file):
    """Load the checkpoint ``src`` into a fresh T x P (x EP) model with Megatron's loader (torch_dist), or each
    rank's own legacy ``mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt``, strictly; save its logits."""
    quiet_megatron()
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{store_file}", rank=rank, world_size=tp * pp * EP,
        timeout=datetime.timedelta(minutes=2))
    apply_cpu_stubs()
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from torch.distributed.checkpoint import FileSystemReader

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 expert_model_parallel_size=EP)
    model_parallel_cuda_manual_seed(SEED)
    sub = f"mp_rank_{ps.get_tensor_model_parallel_rank():02d}" + (
        f"_{ps.get_pipeline_model_parallel_rank():03d}" if pp > 1 else "") + (
        f"_{ps.get_expert_model_parallel_rank():03d}" if EP > 1 else "")
    legacy = os.path.join(src, sub, "model_optim_rng.pt")
    if os.path.exists(legacy):  # Megatron-LM's legacy layout: this rank's own file, loaded strictly
        state = torch.load(legacy, weights_only=False)["model"]
        vocab = tp * next(v.shape[0] for k, v in state.items() if k.endswith(("word_embeddings.weight",
                                                                               "output_layer.weight")))
    else:
        vocab = FileSystemReader(src).read_metadata().state_dict_metadata["embedding.word_embeddings.weight"].size[0]
    model = build_model(tp, pp, vocab=vocab)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    if os.path.exists(legacy):
        model.load_state_dict(state, strict=True)
    else:
        wanted = model.sharded_state_dict()
        loaded = dist_checkpointing.load(wanted, src)  # strict: every requested key must be in the checkpoint
        model.load_state_dict({k: v for k, v in loaded.items() if k in wanted})
    model.eval()
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    logits = pipeline_logits(model, ids, tp)
    if logits is not None and ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0:
        torch.save({"input_ids": ids, "logits": logits}, out)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--out", required=True)
    ap.add_argument("--iteration", type=int, default=2)
    ap.add_argument("--load", default=None, help="a torch_dist iteration folder to load (then --out is a file)")
    ap.add_argument("--divisible-by", type=int, default=None, help="--make-vocab-size-divisible-by (default 128)")
    ap.add_argument("--ep", type=int, default=1, help="expert-parallel ranks (--family mixtral; the data-parallel "
                    "ranks: TP x PP x EP processes)")
    ap.add_argument("--norm-topk", action="store_true", help="--family qwen2moe, qwen3moe: norm_topk_prob=True")
    ap.add_argument("--family", choices=["llama", "qwen2", "qwen3", "mixtral", "qwen2moe", "qwen3moe"],
                    default="llama",
                    help="qwen2: biases on the query/key/value projection (Megatron-LM's --add-qkv-bias); "
                         "qwen3: RMSNorms on each query and key head (--qk-layernorm)")
    ap.add_argument("--dp", type=int, default=None,
                    help="train --iteration steps with the distributed optimizer on TP x PP x DP ranks and save the "
                         "legacy layout with distrib_optim.pt, and reference_adam.pt: Megatron's own state per parameter")
    ap.add_argument("--hidden", type=int, default=None, help="the hidden size (default 64; FFN twice that)")
    ap.add_argument("--bucket", type=int, default=None, help="with --dp: the grad buffer's bucket size (elements)")
    ap.add_argument("--tied", action="store_true", help="with --dp or --train: embeddings tied to the output layer")
    ap.add_argument("--bf16", action="store_true", help="with --dp: a bf16 model with fp32 master copies")
    ap.add_argument("--dist-formats", default=None,
                    help="with --dp: also save torch_dist in these comma-separated sharding formats of the "
                         "distributed optimizer (fully_sharded_model_space, fully_reshardable, dp_reshardable)")
    ap.add_argument("--vpp", type=int, default=None,
                    help="virtual pipeline stages: V model chunks per pipeline rank (tests/megatron_vpp.py)")
    ap.add_argument("--train", default=None,
                    help="a torch_dist iteration folder with Adam's state: megatron-core's optimizer loads it and "
                         "trains one step on TP ranks; --out FILE gets the state before and after (megatron_optim.py)")
    ap.add_argument("--train-optimizer", choices=["plain", "distributed"], default=None,
                    help="with --train: megatron-core's optimizer (default: distributed with --dp, else plain)")
    ap.add_argument("--start-method", choices=["fork", "spawn"], default="fork",
                    help="fork (default) lets the ranks inherit the parent's megatron import (~2.5 s each)")
    a = ap.parse_args()
    if a.divisible_by is not None:
        global DIVISIBLE_BY
        DIVISIBLE_BY = a.divisible_by
        os.environ["MEGATRON_FIXTURE_DIVISIBLE_BY"] = str(a.divisible_by)  # for spawned ranks
    if a.hidden is not None:
        global HIDDEN, FFN, KV_CH
        os.environ["MEGATRON_FIXTURE_HIDDEN"] = str(a.hidden)  # for spawned ranks
        HIDDEN, FFN, KV_CH = a.hidden, 2 * a.hidden, a.hidden // HEADS
    if a.dist_formats:
        global DIST_FORMATS
        DIST_FORMATS = a.dist_formats.split(",")
        os.environ["MEGATRON_FIXTURE_DIST_FORMATS"] = a.dist_formats  # for spawned ranks
    if a.bf16:
        global BF16
        BF16 = True
        os.environ["MEGATRON_FIXTURE_BF16"] = "1"  # for spawned ranks
    if a.family != FAMILY:
        global QKV_BIAS, QK_NORM, EPS, ROPE_BASE
        globals()["FAMILY"] = a.family
        os.environ["MEGATRON_FIXTURE_FAMILY"] = a.family  # for spawned ranks
        QKV_BIAS, QK_NORM, EPS, ROPE_BASE = family_settings(a.family)
    if a.norm_topk:
        global NORM_TOPK
        NORM_TOPK = True
        os.environ["MEGATRON_FIXTURE_NORM_TOPK"] = "1"  # for spawned ranks
    global EP
    if a.ep != EP:
        EP = a.ep
        os.environ["MEGATRON_FIXTURE_EP"] = str(a.ep)  # for spawned ranks
    assert EP == 1 or moe_family(), "--ep needs experts (--family mixtral, qwen2moe or qwen3moe)"
    assert GROUPS % a.tp == 0 and NUM_LAYERS % a.pp == 0, "unsupported TP/PP for the tiny model"
    if a.load is None and a.dp is None and a.train is None:  # dist_checkpointing.save expects the target directory to exist
        os.makedirs(os.path.join(a.out, "torch_dist", f"iter_{a.iteration:07d}"), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="megatron_fixture_")
    try:
        store_file = os.path.join(tmp, "store")  # FileStore rendezvous; must not exist yet
        if a.start_method == "fork":  # import once here; the parent runs no torch ops before forking
            quiet_megatron()
            import megatron.core.dist_checkpointing  # noqa: F401
            import megatron.core.models.gpt  # noqa: F401
        fn, args = (worker, (a.tp, a.pp, a.out, a.iteration, store_file)) if a.load is None else \
            (load_worker, (a.tp, a.pp, a.load, a.out, store_file))
        ranks = a.tp * a.pp * EP
        if a.dp is not None:
            assert a.load is None and a.pp <= 2, "--dp trains on TP x PP x DP ranks, at most two pipeline stages"
            fn, args = distopt_worker, (a.tp, a.pp, a.dp, a.out, a.iteration, a.bucket, a.tied, store_file)
            ranks = a.tp * a.pp * a.dp
        if a.vpp is not None and a.train is None:
            import megatron_vpp

            fn, args = (megatron_vpp.save_worker, (a.tp, a.pp, a.vpp, a.out, a.iteration, store_file)) \
                if a.load is None else (megatron_vpp.load_worker, (a.tp, a.pp, a.vpp, a.load, a.out, store_file))
        if a.train is not None:
            import megatron_optim

            dp = a.dp or 1
            if a.train_optimizer:
                os.environ["MEGATRON_FIXTURE_TRAIN_OPTIMIZER"] = a.train_optimizer  # for the ranks
            fn, args, ranks = megatron_optim.train_worker, (a.tp, dp, a.train, a.out, store_file), a.tp * dp
            if a.pp > 1:  # a legacy export's pipeline stages (and model chunks, and a tied embedding's copy)
                fn, args = megatron_optim.train_pipeline_worker, (a.tp, a.pp, a.vpp, dp, a.tied, a.train, a.out,
                                                                  store_file)
                ranks = a.tp * a.pp * dp
        mp.start_processes(fn, args=args, nprocs=ranks, join=True, start_method=a.start_method)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()

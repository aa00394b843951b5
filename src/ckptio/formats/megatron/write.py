"""Hugging Face Llama (or Mistral, Qwen2, Qwen3) weights written as a Megatron checkpoint, split for a chosen TP × PP.

``ckptio convert SRC OUT --to megatron --tp T --pp P`` writes a Megatron-LM run folder::

    OUT/latest_checkpointed_iteration.txt          the iteration (the source's step, else 0)
    OUT/iter_NNNNNNN/                              Megatron-Core torch_dist (the default) ...
        metadata.json  common.pt  .metadata  __0_0.distcp
    OUT/iter_NNNNNNN/mp_rank_TT[_PPP]/model_optim_rng.pt   ... or, with --megatron-layout legacy

The model is renamed with the ``llama-to-megatron`` converter (``linear_qkv`` fused per query group, a Qwen2's
q/k/v biases into ``linear_qkv.bias`` the same way, with ``add_qkv_bias`` in the args; a Qwen3's q/k norms as
``q_layernorm``/``k_layernorm``, with ``qk_layernorm``; ``linear_fc1`` =
``[gate; up]``) and the vocabulary padded as Megatron-LM pads it (to a multiple of
D × T, D being ``--vocab-divisible-by``, Megatron-LM's ``--make-vocab-size-divisible-by``, 128 by default; the
added rows are zeros). ``--like RUN`` takes T, P and D from an existing Megatron run's recorded arguments. The torch_dist layout holds whole tensors with the layers stacked,
as Megatron-Core stores them, and Megatron-Core reshards them to its own TP × PP on load; its
``common.pt`` records the run's ``args`` (sizes, TP, PP) for loaders and for ckptio. The legacy layout
holds each rank's shard under per-layer names, layer numbers restarting on every pipeline stage. From a
Hugging Face model both carry the weights only, like a converted release checkpoint; from a ckptio checkpoint with
Adam's state, the optimizer too (:mod:`~ckptio.formats.megatron.optim_write`).
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import re
import warnings
from pathlib import Path
from typing import Any

import torch

from ...errors import CheckpointError, ConfigError
from .. import hf_fields
from . import moe
from .layout import GLOBAL_SPLIT, ITERATION_FILE, LAYER_SPLIT, OPTIONAL, RANK_FILE, SIDE_FILES, VOCAB_KEYS, run_args

DIVISIBLE_BY = 128
"""Megatron-LM's default ``--make-vocab-size-divisible-by``."""
EXTRA_STATE_MODULES = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
_LEGACY_NAMES = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
                 "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight"}


def megatron_args(config: dict[str, Any], tp: int, pp: int, layout: str,
                  divisible_by: int = DIVISIBLE_BY, where: object = "config.json") -> argparse.Namespace:
    """The Megatron-LM arguments that describe a Hugging Face Llama (Mistral, Qwen2, Qwen3) ``config`` split over
    ``tp`` × ``pp``, the vocabulary padded to a multiple of ``divisible_by`` × ``tp`` (Megatron-LM's
    ``--make-vocab-size-divisible-by``); a Qwen2 is a Llama with ``add_qkv_bias``, a Qwen3 one with ``qk_layernorm``.

    The config may use transformers 5's or 4's spelling (:mod:`ckptio.formats.hf_fields`); a field Megatron
    cannot hold (a scaled RoPE, biases other than Qwen2's, a sliding window, a Gemma...) is refused by name."""
    rope = hf_fields.refuse(config, where, "Megatron", types=hf_fields.MEGATRON_TYPES)
    kind = config.get("model_type")
    heads = int(config["num_attention_heads"])
    groups = int(config.get("num_key_value_heads") or heads)
    layers, ffn, hidden = int(config["num_hidden_layers"]), int(config["intermediate_size"]), int(config["hidden_size"])
    problems = [f"{what} ({n}) is not divisible by {by}" for what, n, by in (
        ("num_attention_heads", heads, tp), ("num_key_value_heads", groups, tp), ("intermediate_size", ffn, tp),
        ("num_hidden_layers", layers, pp)) if n % by]
    if problems:
        raise ConfigError(f"cannot split this model for TP={tp} PP={pp}: " + "; ".join(problems))
    if not isinstance(divisible_by, int) or divisible_by < 1:
        raise ConfigError(f"--vocab-divisible-by must be a positive integer, got {divisible_by!r}")
    vocab = int(config["vocab_size"])
    step = divisible_by * tp
    dtype = hf_fields.dtype_name(config)
    return argparse.Namespace(
        num_layers=layers, hidden_size=hidden, ffn_hidden_size=ffn, num_attention_heads=heads,
        num_query_groups=groups, group_query_attention=groups != heads,
        kv_channels=int(config.get("head_dim") or hidden // heads), vocab_size=vocab,
        padded_vocab_size=-(-vocab // step) * step, make_vocab_size_divisible_by=divisible_by,
        max_position_embeddings=int(config.get("max_position_embeddings") or 4096),
        norm_epsilon=float(config.get("rms_norm_eps", hf_fields.DEFAULT_EPS[str(kind)])),
        rotary_base=rope.theta, rotary_percent=1.0, position_embedding_type="rope", normalization="RMSNorm",
        swiglu=True, add_bias_linear=False, add_qkv_bias=kind in ("qwen2", "qwen2_moe"), qk_layernorm=kind in ("qwen3", "qwen3_moe"),
        untie_embeddings_and_output_weights=not config.get("tie_word_embeddings", False),
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, ckpt_format=layout,
        bf16=dtype == "bfloat16", fp16=dtype == "float16",
        attention_dropout=float(config.get("attention_dropout", 0.0)), **moe.megatron_args(config, tp),
    )


def _tensors(source: Any, config: dict[str, Any], args: argparse.Namespace) -> dict[str, torch.Tensor]:
    """The whole model under per-layer Megatron-Core names, the vocabulary padded with zero rows."""
    from ..naming import _RenamedSource, get_converter

    index = source.index()
    if "model.embed_tokens.weight" not in index:
        raise CheckpointError(f"{source.folder}: a Megatron export takes a Hugging Face model (model.embed_tokens."
                              f"weight, model.layers.N...), not {sorted(index)[:3]}; it renames with llama-to-megatron "
                              "itself, so convert without --naming")
    for suffix, what, switch, kind in (("self_attn.q_proj.bias", "q_proj biases", "add_qkv_bias", "qwen2"),
                                       ("self_attn.q_norm.weight", "q_norm weights", "qk_layernorm", "qwen3")):
        held = sum(k.endswith(suffix) for k in index)
        if held != (args.num_layers if getattr(args, switch) else 0):
            raise CheckpointError(f"{source.folder}: {held} of its {args.num_layers} layers have {what}, but its "
                                  f"config is a {config.get('model_type', 'llama')}'s (Megatron holds them in every "
                                  f"layer, as a {kind} model_type, or in none)")
    tied = "lm_head.weight" not in index
    naming = {"mixtral": "mixtral-to-megatron", "qwen2_moe": "qwen2moe-to-megatron", "qwen3_moe": "qwen2moe-to-megatron"}.get(
        str(config.get("model_type")), "llama-to-megatron")
    if naming != "llama-to-megatron":  # a checkpoint of transformers 5's live model: its experts fused
        from ..live_experts import as_saved

        source = as_saved(source, config.get("model_type"))
    renamed = _RenamedSource(_WithHead(source) if tied else source, get_converter(naming), config)
    out = {}
    for key in renamed.index():
        t = renamed.read(key).contiguous()
        if key in VOCAB_KEYS and t.shape[0] < args.padded_vocab_size:
            t = torch.cat([t, t.new_zeros(args.padded_vocab_size - t.shape[0], *t.shape[1:])])
        out[key] = t
    if tied and not args.untie_embeddings_and_output_weights:
        out.pop("output_layer.weight", None)
    return out


class _WithHead:
    """A tied model's source with ``lm_head.weight`` named (the embedding) so the converter's rules all match."""

    def __init__(self, source: Any) -> None:
        self.source, self.folder = source, source.folder

    def index(self) -> dict[str, Any]:
        index = self.source.index()
        return {**index, "lm_head.weight": index["model.embed_tokens.weight"]}

    def read(self, key: str) -> torch.Tensor:
        return self.source.read("model.embed_tokens.weight" if key == "lm_head.weight" else key)


def _split(t: torch.Tensor, split: Any, tp: int) -> list[torch.Tensor]:
    if split is None:
        return [t] * tp
    if split == "glu":
        gate, up = t.chunk(2, dim=0)
        return [torch.cat([g, u]) for g, u in zip(gate.chunk(tp), up.chunk(tp))]
    return [p.contiguous() for p in t.chunk(tp, dim=split)]


def _suffixes(args: argparse.Namespace) -> list[str]:
    """The per-layer parameters of the run: all of :data:`LAYER_SPLIT`, the :data:`OPTIONAL` ones when their switch
    (``add_qkv_bias``, ``qk_layernorm``) is on."""
    return moe.suffixes(args, [s for s in LAYER_SPLIT if s not in OPTIONAL or getattr(args, OPTIONAL[s])])


def write_dist(folder: Path, tensors: dict[str, torch.Tensor], args: argparse.Namespace, iteration: int,
               moments: dict[str, dict[str, torch.Tensor]] | None = None, common: dict[str, Any] | None = None) -> None:
    """Megatron-Core's torch_dist layout: whole tensors, layers stacked, ``_extra_state`` for each linear; with
    ``moments`` (Adam's, named like ``tensors``) under ``optimizer.state.<moment>.``, and ``common`` entries
    added to ``common.pt`` (:mod:`~ckptio.formats.megatron.optim_write`)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    layers = args.num_layers
    state: dict[str, Any] = {}
    for prefix, named in [("", tensors)] + [(f"optimizer.state.{m}.", t) for m, t in (moments or {}).items()]:
        state.update({prefix + k: v for k, v in named.items() if k in GLOBAL_SPLIT})
        for suffix in _suffixes(args):
            state[f"{prefix}decoder.layers.{suffix}"] = torch.stack([named[f"decoder.layers.{i}.{suffix}"]
                                                                     for i in range(layers)])
        if prefix:  # the experts' moments, stacked as their weights (whose _extra_state is the model's alone)
            state.update({prefix + k: v for k, v in moe.dist_experts(named, args).items() if "_extra_state" not in k})
    for module in moe.extra_state_modules(args, EXTRA_STATE_MODULES):  # Megatron-Core's strict load asks for
        for i in range(layers):
            state[f"decoder.layers.{module}._extra_state/shard_{i}_{layers}"] = [None]
    state.update(moe.dist_experts(tensors, args))
    with warnings.catch_warnings():  # a single-process save is what is meant here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(folder), thread_count=1), no_dist=True,
                 planner=DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False))
    torch.save({"args": args, "iteration": iteration, "checkpoint_version": 3.0, **(common or {})},
               folder / "common.pt")
    (folder / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                                                      "common_backend": "torch", "common_backend_version": 1}))


def write_legacy(folder: Path, tensors: dict[str, torch.Tensor], args: argparse.Namespace, iteration: int,
                 moments: dict[str, dict[str, torch.Tensor]] | None = None, common: dict[str, Any] | None = None) -> None:
    """Megatron-LM's legacy layout: each TP × PP rank's shard in ``mp_rank_TT[_PPP]/model_optim_rng.pt``, under
    ``model`` (or ``model0``, ``model1``... with virtual pipeline stages, :mod:`~ckptio.formats.megatron.vpp`); with
    ``moments``, each rank's plain optimizer state (:func:`~ckptio.formats.megatron.optim_write.legacy_state`)
    or the distributed optimizer's, its ``distrib_optim.pt`` beside the rank file
    (:func:`~ckptio.formats.megatron.optim_write.legacy_distributed`), and the ``common`` scheduler."""
    from .distrib_optim import DISTRIB_OPTIM_FILE
    from .optim_write import legacy_state, registered

    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    vpp = getattr(args, "virtual_pipeline_model_parallel_size", None) or 1
    ep = getattr(args, "expert_model_parallel_size", None) or 1
    for stage in range(pp):
        chunks = [_legacy_chunk(tensors, args, stage, v, vpp) for v in range(vpp)]
        parts = {m: [_legacy_chunk(named, args, stage, v, vpp) for v in range(vpp)]
                 for m, named in (moments or {}).items()}
        for t, e in itertools.product(range(tp), range(ep)):
            rank_dir = folder / (f"mp_rank_{t:02d}" + (f"_{stage:03d}" if pp > 1 else "") +
                                 (f"_{e:03d}" if ep > 1 else ""))  # Megatron-LM appends the EP rank last
            rank_dir.mkdir()
            held = [_ep_rank(c[t], e, ep) for c in chunks]
            optim = {}
            if moments and common:
                held = [registered(c) for c in held]  # as megatron-core's state_dict orders them
                optimizer, flat = legacy_state([{n: w for n, w in c.items() if w is not None} for c in held],
                                               [{m: _ep_rank(p[v][t], e, ep) for m, p in parts.items()}
                                                for v in range(vpp)], common["optimizer"], args, stage, e)
                if flat is not None:  # the distributed optimizer's fp32 state
                    torch.save(flat, rank_dir / DISTRIB_OPTIM_FILE)
                optim = {"optimizer": optimizer, "opt_param_scheduler": common["opt_param_scheduler"]}
            models = {"model": held[0]} if vpp == 1 else {f"model{v}": c for v, c in enumerate(held)}
            torch.save({"args": args, "checkpoint_version": 3.0, "iteration": iteration, **models, **optim},
                       rank_dir / RANK_FILE)


_LOCAL_EXPERT = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts\.local_experts\.)(\d+)(\..+)$")


def _ep_rank(shard: dict[str, Any], e: int, ep: int) -> dict[str, Any]:
    """Expert-parallel rank ``e``'s part of a rank's ``shard`` (which holds every expert): the experts
    ``e × E/EP`` to ``(e + 1) × E/EP - 1`` as its local experts from 0, everything else as it is."""
    if ep == 1:
        return shard
    local = len({m.group(2) for m in map(_LOCAL_EXPERT.match, shard) if m}) // ep
    out = {}
    for name, value in shard.items():
        m = _LOCAL_EXPERT.match(name)
        if m is None:
            out[name] = value
        elif e * local <= int(m.group(2)) < (e + 1) * local:
            out[f"{m.group(1)}{int(m.group(2)) - e * local}{m.group(3)}"] = value
    return out


def _legacy_chunk(tensors: dict[str, torch.Tensor], args: argparse.Namespace, stage: int, chunk: int,
                  vpp: int) -> list[dict[str, torch.Tensor | None]]:
    """Each TP rank's state dict of model chunk ``chunk`` of pipeline ``stage``, its layers numbered from 0."""
    from .vpp import chunk_layers

    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    shards: list[dict[str, torch.Tensor | None]] = [collections.OrderedDict() for _ in range(tp)]
    if stage == 0 and chunk == 0:
        for t, part in enumerate(_split(tensors["embedding.word_embeddings.weight"], 0, tp)):
            shards[t]["embedding.word_embeddings.weight"] = part.clone()
    for local, i in enumerate(chunk_layers(args.num_layers, pp, vpp, stage, chunk)):
        for suffix in _suffixes(args):
            name = f"decoder.layers.{local}.{_LEGACY_NAMES.get(suffix, suffix)}"
            expert = moe.kind(suffix)  # a router (whole on every rank) or a shared expert's parameter
            split = LAYER_SPLIT[suffix] if suffix in LAYER_SPLIT else expert[1] if expert else None
            for t, part in enumerate(_split(tensors[f"decoder.layers.{i}.{suffix}"], split, tp)):
                shards[t][name] = part.clone()
        for module in moe.extra_state_modules(args, EXTRA_STATE_MODULES):
            for shard in shards:
                shard[f"decoder.layers.{local}.{module}._extra_state"] = None
        moe.legacy_experts(shards, tensors, args, i, local, _split)
    if stage == pp - 1 and chunk == vpp - 1:
        for t in range(tp):
            shards[t]["decoder.final_layernorm.weight"] = tensors["decoder.final_layernorm.weight"].clone()
        head = tensors.get("output_layer.weight")
        if head is None and pp > 1:  # megatron-core's copy of the tied embedding on the last stage, a parameter
            head = tensors["embedding.word_embeddings.weight"]  # that its state dict holds (and its optimizer)
        if head is not None:
            for t, part in enumerate(_split(head, 0, tp)):
                shards[t]["output_layer.weight"] = part.clone()
                shards[t]["output_layer._extra_state"] = None
    return shards


_BUCKETING = ("data_parallel_size", "overlap_grad_reduce", "ddp_bucket_size", "overlap_param_gather_with_optimizer_step")
"""The run's arguments that decide its gradient buckets, and so the distributed optimizer's flat buffers."""
# the model sizes a run's args must share with the exported model (Megatron-LM name, what the Llama config gives)
_SIZES = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
          "vocab_size", "untie_embeddings_and_output_weights", "add_qkv_bias", "qk_layernorm", "num_experts",
          "moe_router_topk")


def like_run(run: Path, ours: argparse.Namespace, tp: int | None, pp: int | None,
             divisible_by: int | None) -> tuple[int, int, int]:
    """TP, PP and vocabulary divisor taken from the Megatron run ``run`` (explicit values must agree with it),
    after checking that the run's model has the sizes of the model being exported."""
    from .layout import run_args

    theirs = run_args(Path(run))
    wrong = [f"{k}: the run has {getattr(theirs, k)}, the model {getattr(ours, k)}" for k in _SIZES
             if getattr(theirs, k, None) is not None and getattr(ours, k) != getattr(theirs, k)
             and not (k == "num_query_groups" and not getattr(theirs, "group_query_attention", False))]
    if wrong:
        raise ConfigError(f"--like {run}: that run's model is not this one ({'; '.join(wrong)})")
    found = {"--tp": getattr(theirs, "tensor_model_parallel_size", 1) or 1,
             "--pp": getattr(theirs, "pipeline_model_parallel_size", 1) or 1,
             "--vocab-divisible-by": getattr(theirs, "make_vocab_size_divisible_by", DIVISIBLE_BY) or DIVISIBLE_BY}
    for flag, given in (("--tp", tp), ("--pp", pp), ("--vocab-divisible-by", divisible_by)):
        if given is not None and given != found[flag]:
            raise ConfigError(f"{flag} {given} contradicts --like {run}, which was run with {flag} {found[flag]}")
    return int(found["--tp"]), int(found["--pp"]), int(found["--vocab-divisible-by"])


def _expert_parallel(args: argparse.Namespace, ep: int | None, layout: str) -> None:
    """Record ``ep`` expert-parallel ranks in ``args`` (a legacy export then has a rank folder per EP rank,
    ``mp_rank_TT[_PPP]_EEE``), after checking that they split the experts evenly."""
    if ep is None or ep == 1:
        return
    experts = moe.experts_of(args)
    if type(ep) is not int or ep < 1:
        raise ConfigError(f"--ep must be a positive integer, got {ep!r}")
    if layout != "legacy":
        raise ConfigError(f"--ep {ep} applies to the legacy layout (a rank folder per expert-parallel rank); "
                          "megatron-core reshards a torch_dist checkpoint to any expert parallelism itself")
    if not experts or experts % ep:
        raise ConfigError(f"cannot split the model's {experts} experts over --ep {ep} expert-parallel ranks evenly")
    args.expert_model_parallel_size = ep


def _optimizer_args(args: argparse.Namespace, like: str | Path | None, optimizer: str) -> None:
    """What the optimizer's export takes from the ``--like`` run into ``args``: its batch size (the scheduler counts
    samples) and, for the distributed optimizer, its gradient buckets (the legacy ``distrib_optim.pt``'s layout)."""
    if like is not None:
        theirs = run_args(Path(like))
        args.global_batch_size = getattr(theirs, "global_batch_size", None)
        for name in _BUCKETING if optimizer == "distributed" else ():
            setattr(args, name, getattr(theirs, name, None))
    if optimizer == "distributed":
        args.use_distributed_optimizer = True


def write(source: Any, extras: Path | None, out: Path, *, tp: int | None, pp: int | None, layout: str, iteration: int,
          divisible_by: int | None = None, like: str | Path | None = None, vpp: int | None = None,
          adam: Any = None, optimizer: str = "plain", ep: int | None = None) -> None:
    """The run folder ``out`` (new), appearing whole: written beside it, then renamed into place.

    ``tp``/``pp``/``divisible_by`` default to 1, 1 and Megatron-LM's 128; ``like``: an existing Megatron run
    whose recorded arguments give them (and whose model sizes must be this model's); ``vpp``: virtual pipeline
    stages (model chunks per stage, :mod:`~ckptio.formats.megatron.vpp`); ``ep``: expert-parallel ranks, each its
    own legacy rank folder of its share of the experts (:func:`_expert_parallel`); ``adam``: the source's Adam state
    (:class:`~ckptio.formats.megatron.optim_write.SourceAdam`), written beside the weights for megatron-core's
    ``optimizer`` ("plain" or "distributed")."""
    from . import vpp as virtual
    from ..common import read_json

    if layout not in ("dist", "legacy"):
        raise ConfigError(f"megatron layout {layout!r}: use 'dist' (torch_dist) or 'legacy' (mp_rank_*)")
    cfg = None if extras is None else extras / "config.json"
    if cfg is None or not cfg.is_file():
        raise CheckpointError("a Megatron export needs the model's config.json beside its weights (a Llama config)")
    config = read_json(cfg)
    ckpt_format = "torch_dist" if layout == "dist" else "torch"
    if like is not None:
        tp, pp, divisible_by = like_run(Path(like), megatron_args(config, 1, 1, ckpt_format, where=cfg), tp, pp,
                                           divisible_by)
    tp, pp = (1 if tp is None else int(tp)), (1 if pp is None else int(pp))
    if tp < 1 or pp < 1:
        raise ConfigError(f"--tp and --pp must be at least 1, got TP={tp} PP={pp}")
    args = megatron_args(config, tp, pp, ckpt_format, DIVISIBLE_BY if divisible_by is None else divisible_by,
                         where=cfg)
    virtual.apply(args, vpp)
    _expert_parallel(args, ep, layout)
    if adam is not None:
        _optimizer_args(args, like, optimizer)
    extra: dict[str, Any] = {}
    if adam is not None:
        from .optim_write import MOMENTS, common_entries

        extra["common"] = common_entries(adam, args, layout, optimizer)
        extra["moments"] = {m: _tensors(adam.moments[m], config, args) for m in MOMENTS}
    tensors = _tensors(source, config, args)
    if adam is not None and optimizer == "distributed":
        extra["moments"]["param"] = tensors  # the fp32 master copies are the (fp32) weights
    from ...storage import LocalFolderWriter
    from ...storage.confined import Folder

    writer = LocalFolderWriter.create(out)  # fsynced and renamed into place at commit, like every convert output
    try:
        if layout == "dist":
            write_dist(writer.local_path(f"iter_{iteration:07d}"), tensors, args, iteration, **extra)
        else:
            write_legacy(writer.local_path(f"iter_{iteration:07d}"), tensors, args, iteration, **extra)
        writer.write_bytes(ITERATION_FILE, str(iteration).encode())
        for name in SIDE_FILES:  # generation config and tokenizer, for the way back to Hugging Face
            if extras is not None and (extras / name).is_file():
                writer.write_bytes(name, Folder(extras).read_bytes(name, max_size=256 << 20))
        writer.commit()
    except BaseException:
        writer.abort()
        raise
